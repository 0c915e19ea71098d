"""The quantization converter: `apply_quantization(model, quant_config)`.

The model builder calls it once on the built GPTModel (one pipeline stage). It

1. turns every ColumnParallelLinear / RowParallelLinear into its quantized subclass and every
   `LocalDotProductAttention` into `QuantDotProductAttention` -- same parameters, buffers and
   state, only the GEMMs differ -- which covers QKV, proj, fc1, fc2, MLA projections (including
   the down projections megatron-core only accepts as the exact ColumnParallelLinear class at
   construction time), routed and shared experts, the output layer and core attention;
2. names each GEMM site by its module path and global layer number and hands it its resolved
   per-GEMM configuration;
3. gives the model one QuantRuntime (runtime.py: kernel mode, observers, stochastic-rounding
   draws, weight-cache generation) that every site shares, kept when the model is quantized
   again, and the attention modules the config's attention settings.

Nothing registers itself at import time: the classes a built model has depend only on the
config passed here. The bf16 scheme runs the very same modules with quantization off, so a
comparison differs only in the quantization.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Dict, List

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.quantization.attention import QuantDotProductAttention
from megatron.quantization.layers import (
    QuantColumnParallelLinear,
    QuantizedLinearMixin,
    QuantRowParallelLinear,
)
from megatron.quantization.local_attention import LocalDotProductAttention
from megatron.quantization.config import QuantConfig
from megatron.quantization.gemm import SiteState
from megatron.quantization.observers import GemmSite
from megatron.quantization.recipes import global_module_path
from megatron.quantization.runtime import QuantRuntime

# Exact class -> quantized subclass (subclasses of these are someone else's modules: left alone).
QUANTIZED_CLASS = MappingProxyType({
    ColumnParallelLinear: QuantColumnParallelLinear,
    RowParallelLinear: QuantRowParallelLinear,
    LocalDotProductAttention: QuantDotProductAttention,
})

# Modules whose GEMMs run in TransformerEngine kernels, which this converter cannot simulate.
_TE_MODULE_PREFIXES = ("transformer_engine.", "megatron.core.extensions.transformer_engine")


class QuantizationError(ValueError):
    """A model the converter cannot quantize as asked."""


def _layer_numbers(model: torch.nn.Module) -> Dict[str, int]:
    return {name: m.layer_number for name, m in model.named_modules()
            if isinstance(m, TransformerLayer)}


def _owning_layer(name: str, layers: Dict[str, int]):
    best = None
    for prefix, number in layers.items():
        if name.startswith(prefix + ".") and (best is None or len(prefix) > len(best[0])):
            best = (prefix, number)
    return best[1] if best else None


def _reject_transformer_engine(model: torch.nn.Module) -> None:
    """A TransformerEngine module would silently stay in high precision: refuse it when
    anything is to be quantized."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith(_TE_MODULE_PREFIXES):
            raise QuantizationError(
                f"{name or 'model'} is a TransformerEngine module ({type(module).__name__}); "
                "simulated quantization needs megatron-core's local modules (build the model "
                "with the local layer spec)")


def apply_quantization(model: torch.nn.Module, quant: QuantConfig) -> List[GemmSite]:
    """Swap in the quantized modules and give every GEMM site of `model` its configuration.

    Returns the sites in module order.
    """
    if quant.enabled:
        _reject_transformer_engine(model)
    for module in model.modules():
        if type(module) in QUANTIZED_CLASS:
            module.__class__ = QUANTIZED_CLASS[type(module)]
    output_layer = getattr(model, "output_layer", None)
    layers = _layer_numbers(model)
    sites = []
    runtime = getattr(model, "quant_runtime", None)
    if not isinstance(runtime, QuantRuntime):
        runtime = model.quant_runtime = QuantRuntime(quant.backend)
    runtime.backend = quant.backend

    def site(name: str, kind: str, layer) -> GemmSite:
        path = global_module_path(name, layer)
        config = quant.for_site(kind, layer, path)
        if config.rht.gemms and kind in ("attn_qk", "attn_pv"):
            raise QuantizationError(
                f"{path}: the random Hadamard transform applies to linear layers only (the "
                f"recipe file's config for this attention site sets rht)")
        return GemmSite(name, kind, layer, config, SiteState(path, config, runtime))

    for name, module in model.named_modules():
        layer = _owning_layer(name, layers)
        if isinstance(module, QuantizedLinearMixin):
            kind = "output_layer" if module is output_layer else "linear"
            module.quant_site = site(name, kind, layer)
            sites.append(module.quant_site)
        elif isinstance(module, QuantDotProductAttention):
            module.qk_site = site(f"{name}.qk", "attn_qk", layer)
            module.pv_site = site(f"{name}.pv", "attn_pv", layer)
            module.attention = quant.backend.attention
            sites.extend([module.qk_site, module.pv_site])
    return sites


def check_recipe_matchers(quant: QuantConfig, sites: List[GemmSite],
                          matched_elsewhere=()) -> None:
    """A recipe file's enabled matchers each decide at least one GEMM site of the model: one
    that decides none (a mistyped pattern, or one every site matches earlier) would leave the
    sites it was written for in another format without a word. `matched_elsewhere`: the
    matchers that decided sites of the model's other pipeline stages."""
    rules = quant.rules
    if rules is None:
        return
    matched = {s.state.path for s in sites} & set(rules.matched_by)
    names = {rules.matched_by[path] for path in matched} | set(matched_elsewhere)
    unmatched = rules.unmatched(names)
    if unmatched:
        example = sites[0].state.path if sites else "none"
        raise QuantizationError(
            f"--quant-recipe-file {rules.path}: matcher(s) {', '.join(unmatched)} decide no "
            f"GEMM site of this model (a pattern that matches nothing, or only sites an earlier "
            f"matcher takes; site paths look like {example})")
