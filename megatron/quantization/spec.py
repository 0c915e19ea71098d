"""Wiring of the quantized modules into the GPT model.

1. `quantized_module_swaps` puts the quantized core attention into the layer spec (registered
   in megatron.training.model.MODULE_SWAPS when this module is imported).
2. `assign_quantization` runs after the model is built. It turns every Column/RowParallelLinear
   into its quantized subclass (same parameters and state; only `_forward_impl` differs) -- this
   covers QKV, proj, fc1, fc2, MLA projections, experts, shared experts and the output layer,
   including the MLA down projections that megatron-core only accepts as the exact
   ColumnParallelLinear class at construction time -- then names each site by its module path
   and global layer number and hands it its resolved per-GEMM configuration.
The bf16 scheme runs the very same modules with quantization off, so baselines differ only in
the quantization.
"""

from __future__ import annotations

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
from megatron.quantization.observers import GemmSite
from megatron.quantization.schemes import QuantConfig
from megatron.training import model as model_module
from megatron.training.modules import LocalDotProductAttention


def quantized_module_swaps(_args) -> Dict[type, type]:
    return {LocalDotProductAttention: QuantDotProductAttention}


_QUANTIZED_CLASS = {ColumnParallelLinear: QuantColumnParallelLinear,
                    RowParallelLinear: QuantRowParallelLinear}


if quantized_module_swaps not in model_module.MODULE_SWAPS:
    model_module.MODULE_SWAPS.append(quantized_module_swaps)


def _layer_numbers(model: torch.nn.Module) -> Dict[str, int]:
    return {name: m.layer_number for name, m in model.named_modules()
            if isinstance(m, TransformerLayer)}


def _owning_layer(name: str, layers: Dict[str, int]):
    best = None
    for prefix, number in layers.items():
        if name.startswith(prefix + ".") and (best is None or len(prefix) > len(best[0])):
            best = (prefix, number)
    return best[1] if best else None


def assign_quantization(model: torch.nn.Module, quant: QuantConfig) -> List[GemmSite]:
    """Give every GEMM site of `model` (a GPTModel for one pipeline stage) its configuration.

    Returns the sites in module order.
    """
    for module in model.modules():
        if type(module) in _QUANTIZED_CLASS:
            module.__class__ = _QUANTIZED_CLASS[type(module)]
    output_layer = getattr(model, "output_layer", None)
    layers = _layer_numbers(model)
    sites = []
    for name, module in model.named_modules():
        layer = _owning_layer(name, layers)
        if isinstance(module, QuantizedLinearMixin):
            kind = "output_layer" if module is output_layer else "linear"
            module.quant_site = GemmSite(name, kind, layer, quant.for_site(kind, layer))
            sites.append(module.quant_site)
        elif isinstance(module, QuantDotProductAttention):
            module.qk_site = GemmSite(f"{name}.qk", "attn_qk", layer,
                                      quant.for_site("attn_qk", layer))
            module.pv_site = GemmSite(f"{name}.pv", "attn_pv", layer,
                                      quant.for_site("attn_pv", layer))
            sites.extend([module.qk_site, module.pv_site])
    return sites
