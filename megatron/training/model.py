"""GPT model construction: TransformerConfig from args, the layer spec, and GPTModel.

The layer spec is megatron-core's local spec with its norm and attention classes swapped for
the CPU/SP-safe ones (`LOCAL_MODULES`). `build_gpt_model` then hands the built model to the
quantization converter (`apply_quantization`), which swaps in the quantized linears and
attention and names the GEMM sites: the classes of a built model depend only on its
QuantConfig, never on what was imported before.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.training.errors import ConfigError
from megatron.quantization.converter import (
    QuantizationError, apply_quantization, check_recipe_matchers)
from megatron.quantization.layers import set_wgrad_fusion
from megatron.quantization.local_attention import LocalDotProductAttention
from megatron.quantization.config import QuantConfig
from megatron.training.modules import Norm

# Argument dests whose name differs from the TransformerConfig field they set.
_RENAMED_FIELDS = {"num_experts": "num_moe_experts"}


def _torch_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def core_transformer_config_from_args(args) -> TransformerConfig:
    """Copy every arg named like a config field, then translate the rest (as Megatron-LM does)."""
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    kwargs = {name: value for name, value in vars(args).items() if name in fields}
    for arg_name, field_name in _RENAMED_FIELDS.items():
        kwargs[field_name] = getattr(args, arg_name)
    kwargs["params_dtype"] = _torch_dtype(args)
    kwargs["pipeline_dtype"] = kwargs["params_dtype"]
    # On a CPU, initialise full weights and split them (identical weights for any TP size).
    # On GPUs each rank initialises its own shard on the device: full-size host copies of an 8B
    # model on every rank would exhaust host memory. MEGATRON_LOWP_CPU_INIT=1 takes the CPU path
    # on GPUs too (a CPU run's weights: the GPU tests compare against one).
    kwargs["use_cpu_initialization"] = (not torch.cuda.is_available()
                                        or os.environ.get("MEGATRON_LOWP_CPU_INIT") == "1")
    kwargs["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    kwargs["calculate_per_token_loss"] = True
    # The linear layers fuse the wgrad accumulation themselves (layers.py); megatron-core's
    # own flag would demand Apex's fused_weight_gradient_mlp_cuda.
    kwargs["gradient_accumulation_fusion"] = False
    # megatron-core 0.16's default scope "full" warns that it is deprecated; [] means the same.
    kwargs["cuda_graph_scope"] = []
    if args.swiglu:
        kwargs["gated_linear_unit"] = True
        kwargs["activation_func"] = F.silu
    if args.num_experts is not None:
        kwargs["moe_grouped_gemm"] = False  # SequentialMLP: every expert is a parallel linear
    if args.multi_latent_attention:
        kwargs["rope_type"] = "yarn"
    else:
        for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim", "qk_head_dim",
                     "qk_pos_emb_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank"):
            kwargs.pop(name, None)
    return config_class(**kwargs)


# The local spec's norm and attention classes -> our CPU- and SP-safe versions.
LOCAL_MODULES: Dict[type, type] = {
    WrappedTorchNorm: Norm,
    gpt_layer_specs.LNImpl: Norm,
    DotProductAttention: LocalDotProductAttention,
}


def replace_modules(spec, mapping: Dict[type, type]):
    """A copy of a spec tree with every class in `mapping` replaced (ModuleSpecs, submodule
    dataclasses, lists), leaving everything else as it is."""
    if isinstance(spec, type):
        return mapping.get(spec, spec)
    if isinstance(spec, (list, tuple)):
        return type(spec)(replace_modules(s, mapping) for s in spec)
    if isinstance(spec, ModuleSpec) or dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            new = replace_modules(value, mapping)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def build_layer_spec(args, config: TransformerConfig, vp_stage: Optional[int] = None):
    """The decoder block spec for this pipeline stage, with LOCAL_MODULES swapped in."""
    if args.num_experts is not None or args.multi_latent_attention:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization, vp_stage=vp_stage)
    else:
        layer = get_gpt_layer_local_spec(normalization=args.normalization,
                                         qk_layernorm=args.qk_layernorm)
        spec = TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=Norm)
    return replace_modules(spec, LOCAL_MODULES)


def build_gpt_model(args, config: TransformerConfig, quant_config: QuantConfig,
                    pre_process: bool = True, post_process: bool = True,
                    vp_stage: Optional[int] = None) -> GPTModel:
    """GPTModel for one pipeline stage with its GEMM sites quantized per `quant_config`
    (Megatron-LM's gpt_builder, with rope_scaling_factor actually passed: Megatron-LM 0.16 drops
    it, which would give Llama 3.2 the wrong factor)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
    )
    try:
        # The sites stay with the model: the start-up table, checkpoints (amax histories).
        model.quant_sites = apply_quantization(model, quant_config)
    except QuantizationError as exc:
        raise ConfigError(str(exc)) from None
    set_wgrad_fusion(model, getattr(args, "gradient_accumulation_fusion", True))
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embedding and output weight counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_recipe_file_matchers(model, quant_config: QuantConfig) -> None:
    """Every enabled matcher of a recipe file decides a site on some pipeline stage (the
    names are gathered over the pipeline-parallel group); ConfigError naming the others."""
    rules = quant_config.rules
    if rules is None:
        return
    from megatron.core import parallel_state

    names = sorted({rules.matched_by[s.state.path] for s in model.quant_sites
                    if s.state.path in rules.matched_by})
    elsewhere = [names]
    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        elsewhere = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(elsewhere, names, group=group)
    try:
        check_recipe_matchers(quant_config, model.quant_sites,
                              {name for part in elsewhere for name in part})
    except QuantizationError as exc:
        raise ConfigError(str(exc)) from None
