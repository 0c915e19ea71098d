"""Model presets: exact published hyperparameters, and tiny CPU variants with the same features.

A preset is a mapping from argument dest to value, applied beneath the command line by
`parse_args` (explicit flags win). Sources of the full presets: the Hugging Face configs of
meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B and deepseek-ai/DeepSeek-V2-Lite as mapped by
Megatron-Bridge v0.3.1 and Megatron-LM's modelopt configuration files.

`NATIVE_VOCAB_SIZE` is the vocabulary each full model was published with; the training
vocabulary comes from the tokenizer (the Llama 3 tokenizer has 128256 entries).
"""

from __future__ import annotations

from typing import Any, Dict

_LLAMA3_COMMON: Dict[str, Any] = dict(
    group_query_attention=True,
    num_query_groups=8,
    normalization="RMSNorm",
    layernorm_epsilon=1e-5,
    swiglu=True,
    add_bias_linear=False,
    position_embedding_type="rope",
    rotary_base=500000,
    rotary_percent=1.0,
    use_rope_scaling=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    init_method_std=0.02,
    make_vocab_size_divisible_by=128,
)

_DEEPSEEK_V2_COMMON: Dict[str, Any] = dict(
    multi_latent_attention=True,
    q_lora_rank=None,
    qk_layernorm=True,
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    rotary_base=10000,
    rotary_scaling_factor=40.0,
    mscale=0.707,
    mscale_all_dim=0.707,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    init_method_std=0.02,
    moe_router_score_function="softmax",
    moe_router_pre_softmax=True,
    moe_router_topk_scaling_factor=1.0,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-3,
    moe_router_dtype="fp32",
)

MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama32-1b": dict(
        _LLAMA3_COMMON,
        num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        rope_scaling_factor=32.0, untie_embeddings_and_output_weights=False,
        max_position_embeddings=131072, seq_length=8192,
    ),
    "llama31-8b": dict(
        _LLAMA3_COMMON,
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        rope_scaling_factor=8.0, untie_embeddings_and_output_weights=True,
        max_position_embeddings=131072, seq_length=8192,
    ),
    "deepseek2-lite": dict(
        _DEEPSEEK_V2_COMMON,
        num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16,
        kv_channels=16, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        num_experts=64, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
        moe_router_topk=6, moe_layer_freq=[0] + [1] * 26,
        make_vocab_size_divisible_by=3200, max_position_embeddings=4096, seq_length=4096,
    ),
    # Tiny CPU variants: same architecture features (GQA, RoPE with Llama 3 scaling, SwiGLU,
    # RMSNorm, tied embeddings; MLA + MoE with shared experts and a dense first layer), with
    # widths that are multiples of the MX block size 32.
    "llama-tiny": dict(
        _LLAMA3_COMMON,
        num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8,
        num_query_groups=2, rope_scaling_factor=32.0, untie_embeddings_and_output_weights=False,
        max_position_embeddings=2048, seq_length=256,
    ),
    "deepseek-tiny": dict(
        _DEEPSEEK_V2_COMMON,
        num_layers=3, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
        kv_channels=16, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=32, v_head_dim=32,
        num_experts=8, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128,
        moe_router_topk=2, moe_layer_freq=[0, 1, 1],
        make_vocab_size_divisible_by=128, max_position_embeddings=2048, seq_length=256,
    ),
}

NATIVE_VOCAB_SIZE = {
    "llama32-1b": 128256,
    "llama31-8b": 128256,
    "deepseek2-lite": 102400,
}

# Published totals, computed from the configs above (see megatron-conventions.md).
PUBLISHED_PARAMETER_COUNTS = {
    "llama32-1b": 1_235_814_400,
    "llama31-8b": 8_030_261_248,
    "deepseek2-lite": 15_706_484_224,
}


def preset_defaults(name: str) -> Dict[str, Any]:
    """A copy of the preset `name` (argument dest -> value)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(sorted(MODEL_PRESETS))}")
    values = dict(MODEL_PRESETS[name])
    if isinstance(values.get("moe_layer_freq"), list):
        values["moe_layer_freq"] = list(values["moe_layer_freq"])
    return values
