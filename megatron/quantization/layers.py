"""Quantized ColumnParallelLinear / RowParallelLinear.

They override megatron-core's `_forward_impl` (the GEMM of the layer) and keep everything else:
weights, initialisation, sharded checkpoints and the tensor-parallel communication around the
GEMM. Tensor-parallel input handling is done with megatron's autograd-aware mappings, which is
exactly what `linear_with_grad_accumulation_and_async_allreduce` does inline:
sequence parallel -> all-gather the input (reduce-scatter its gradient); otherwise an all-reduce
of the input gradient when the layer asks for it. The GEMM itself is `quantized_linear`, which
quantizes each of fprop / dgrad / wgrad along its own reduction axis.

Each instance is a GEMM site: `apply_quantization` (converter.py) sets `quant_site` after the
model is built, when the module path and layer number are known.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron.quantization.gemm import MatmulQuantConfig, quantized_linear
from megatron.quantization.observers import GemmSite, observer_for


class QuantizedLinearMixin:
    """The shared GEMM of both parallel linears."""

    quant_site: Optional[GemmSite] = None

    @property
    def quant_config(self) -> MatmulQuantConfig:
        return self.quant_site.config if self.quant_site is not None else MatmulQuantConfig()

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                      grad_output_buffer=None, wgrad_deferral_limit=None, **_unused):
        if gradient_accumulation_fusion:
            raise ValueError("gradient accumulation fusion is not supported by the quantized "
                             "linear layers (it needs TransformerEngine/apex kernels)")
        if grad_output_buffer is not None:
            raise ValueError("deferred embedding wgrad compute is not supported by the "
                             "quantized linear layers")
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        observer = observer_for(self.quant_site) if self.quant_site is not None else None
        state = self.quant_site.state if self.quant_site is not None else None
        return quantized_linear(input, weight, bias, self.quant_config, observer=observer,
                                state=state)


class QuantColumnParallelLinear(QuantizedLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose GEMMs are simulated in the configured formats."""


class QuantRowParallelLinear(QuantizedLinearMixin, RowParallelLinear):
    """RowParallelLinear whose GEMMs are simulated in the configured formats."""
