"""Model presets: published parameter counts, hyperparameters, and what the builder makes of them."""

import math

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.training.arguments import parse_args, validate_args
from megatron.training.model import build_gpt_model, core_transformer_config_from_args, count_parameters
from megatron.training.presets import MODEL_PRESETS, NATIVE_VOCAB_SIZE, PUBLISHED_PARAMETER_COUNTS
from megatron.training.tokenizer import vocab_size_with_padding

COMMON = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def preset_args(name, *extra, vocab=None):
    args = validate_args(parse_args(["--model-preset", name, *COMMON, *extra]), check_paths=False)
    vocab = vocab if vocab is not None else NATIVE_VOCAB_SIZE.get(name, 128256)
    args.padded_vocab_size = vocab_size_with_padding(vocab, args.make_vocab_size_divisible_by, 1)
    return args


def build_on_meta(args):
    config = core_transformer_config_from_args(args)
    config.perform_initialization = False
    with torch.device("meta"):
        return build_gpt_model(args, config, args.quant_config)


@pytest.mark.parametrize("name", ["llama32-1b", "llama31-8b", "deepseek2-lite"])
def test_parameter_count_matches_published(world_size_one, name):
    model = build_on_meta(preset_args(name))
    assert next(model.parameters()).device.type == "meta"
    assert count_parameters(model) == PUBLISHED_PARAMETER_COUNTS[name]


def test_llama_hyperparameters():
    one, eight = MODEL_PRESETS["llama32-1b"], MODEL_PRESETS["llama31-8b"]
    assert (one["num_layers"], one["hidden_size"], one["ffn_hidden_size"]) == (16, 2048, 8192)
    assert (eight["num_layers"], eight["hidden_size"], eight["ffn_hidden_size"]) == (32, 4096, 14336)
    for preset in (one, eight):
        assert preset["num_attention_heads"] == 32 and preset["num_query_groups"] == 8
        assert preset["rotary_base"] == 500000 and preset["use_rope_scaling"]
        assert preset["normalization"] == "RMSNorm" and preset["layernorm_epsilon"] == 1e-5
        assert preset["swiglu"] and preset["add_bias_linear"] is False
    assert one["rope_scaling_factor"] == 32.0 and eight["rope_scaling_factor"] == 8.0
    assert one["untie_embeddings_and_output_weights"] is False
    assert eight["untie_embeddings_and_output_weights"] is True


def test_deepseek_v2_lite_hyperparameters():
    p = MODEL_PRESETS["deepseek2-lite"]
    assert p["multi_latent_attention"] and p["q_lora_rank"] is None and p["kv_lora_rank"] == 512
    assert (p["qk_head_dim"], p["qk_pos_emb_head_dim"], p["v_head_dim"]) == (128, 64, 128)
    assert p["num_experts"] == 64 and p["moe_router_topk"] == 6
    assert p["moe_ffn_hidden_size"] == 1408 and p["moe_shared_expert_intermediate_size"] == 2816
    assert p["moe_layer_freq"] == [0] + [1] * 26
    assert (p["mscale"], p["mscale_all_dim"], p["rotary_scaling_factor"]) == (0.707, 0.707, 40.0)


def _llama3_scaled_inv_freq(dim, base, factor, low=1.0, high=4.0, original=8192):
    """Llama 3's published frequency scaling, written out independently of megatron-core."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("factor", [32.0, 8.0])
def test_rope_scaling_factor_reaches_the_model(world_size_one, factor):
    args = preset_args("llama-tiny", "--rope-scaling-factor", str(factor), vocab=512)
    model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config)
    expected = _llama3_scaled_inv_freq(args.kv_channels, args.rotary_base, factor)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_tiny_llama_keeps_llama_features(world_size_one):
    args = preset_args("llama-tiny", vocab=512)
    model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config)
    attention = model.decoder.layers[0].self_attention
    assert attention.config.num_query_groups < attention.config.num_attention_heads  # GQA
    assert model.share_embeddings_and_output_weights  # tied, like Llama 3.2 1B
    assert isinstance(model.decoder.layers[0].input_layernorm, torch.nn.RMSNorm)
    assert model.config.gated_linear_unit and model.config.add_bias_linear is False


def test_tiny_deepseek_has_mla_and_moe(world_size_one):
    args = preset_args("deepseek-tiny", vocab=512)
    model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config)
    layers = model.decoder.layers
    assert all(isinstance(layer.self_attention, MLASelfAttention) for layer in layers)
    assert not isinstance(layers[0].mlp, MoELayer)  # dense first layer, as DeepSeek-V2-Lite
    assert all(isinstance(layer.mlp, MoELayer) for layer in layers[1:])
    assert isinstance(layers[1].mlp.shared_experts, SharedExpertMLP)
    assert len(layers[1].mlp.experts.local_experts) == MODEL_PRESETS["deepseek-tiny"]["num_experts"]
