"""Quantized ColumnParallelLinear / RowParallelLinear.

They override megatron-core's `_forward_impl` (the GEMM of the layer) and keep everything else:
weights, initialisation, sharded checkpoints and the tensor-parallel communication around the
GEMM. Like megatron-core's LinearWithGradAccumulationAndAsyncCommunication, the GEMM's autograd
function (`quantized_linear`) does the layer's own communication: with sequence parallelism it
all-gathers the input shard, saves only the shard and gathers it again in backward while the
dgrad GEMM runs, then reduce-scatters dX while the wgrad GEMM runs; without it, a layer that
asks for it all-reduces dX while the wgrad GEMM runs (tp_comm.py). Its weight gradient is
summed into the fp32 main gradient (gradient-accumulation fusion, main_grad.py) unless
`fuse_wgrad_accumulation` is off (--no-gradient-accumulation-fusion). `quantized_linear`
quantizes each of fprop / dgrad / wgrad along its own reduction axis.

Each instance is a GEMM site: `apply_quantization` (converter.py) sets `quant_site` after the
model is built, when the module path and layer number are known.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron.quantization.config import MatmulQuantConfig
from megatron.quantization.gemm import quantized_linear
from megatron.quantization.observers import GemmSite, observer_for
from megatron.quantization.tp_comm import TensorParallelComm


class QuantizedLinearMixin:
    """The shared GEMM of both parallel linears."""

    quant_site: Optional[GemmSite] = None
    # Weight gradients summed into the fp32 main gradient (Megatron-LM's default).
    fuse_wgrad_accumulation: bool = True

    @property
    def quant_config(self) -> MatmulQuantConfig:
        """The site's config as the precision schedule runs it now."""
        return self.quant_site.active_config if self.quant_site is not None \
            else MatmulQuantConfig()

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                      grad_output_buffer=None, wgrad_deferral_limit=None, **_unused):
        if grad_output_buffer is not None:
            raise ValueError("deferred embedding wgrad compute is not supported by the "
                             "quantized linear layers")
        comm = None
        if sequence_parallel or allreduce_dgrad:
            comm = TensorParallelComm(tp_group, sequence_parallel=sequence_parallel,
                                      allreduce_dgrad=allreduce_dgrad)
        observer = observer_for(self.quant_site) if self.quant_site is not None else None
        state = self.quant_site.state if self.quant_site is not None else None
        fuse = gradient_accumulation_fusion or self.fuse_wgrad_accumulation
        return quantized_linear(input, weight, bias, self.quant_config, observer=observer,
                                state=state, comm=comm, fuse_wgrad=fuse)


def set_wgrad_fusion(model: torch.nn.Module, enabled: bool) -> None:
    """Turn gradient-accumulation fusion on or off for every linear layer of `model`."""
    for module in model.modules():
        if isinstance(module, QuantizedLinearMixin):
            module.fuse_wgrad_accumulation = bool(enabled)


class QuantColumnParallelLinear(QuantizedLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose GEMMs are simulated in the configured formats."""


class QuantRowParallelLinear(QuantizedLinearMixin, RowParallelLinear):
    """RowParallelLinear whose GEMMs are simulated in the configured formats."""
