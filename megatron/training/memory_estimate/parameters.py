"""Per-rank parameters of every pipeline stage, their gradients (main-grad buffer) and optimizer
state, with and without the distributed optimizer."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import List

from megatron.quantization.gemm import rotation_fused
from megatron.training.memory_estimate.kernels import build_meta_model
from megatron.training.memory_estimate.layout import Layout, single_rank_args

# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StageParameters:
    dense: int = 0        # parameters on the rank, replicated over data parallel
    expert: int = 0       # expert parameters on the rank
    bytes: int = 0
    weight_cache_bytes: int = 0   # quantized weight copies kept between optimizer steps

    @property
    def count(self) -> int:
        return self.dense + self.expert


_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")


def _stages_of(name: str, layout: Layout, tied: bool) -> List[int]:
    """The pipeline stages holding parameter `name` of the single-rank model."""
    match = _LAYER.search(name)
    if match:
        return [int(match.group(1)) // layout.layers_per_stage]
    last = layout.pp - 1
    if name.startswith("embedding."):
        # With tied embeddings the last stage keeps its own copy for the output layer.
        if tied and layout.pp > 1 and name == "embedding.word_embeddings.weight":
            return [0, last]
        return [0]
    return [last]                          # final norm, output layer


def _rank_divisor(param, layout: Layout) -> int:
    """How many ranks share `param` of the single-rank model: TP for tensor-parallel
    parameters, times EP for expert parameters (allreduce=False)."""
    split_by_tp = bool(getattr(param, "tensor_model_parallel", False))
    is_expert = getattr(param, "allreduce", True) is False
    return (layout.tp if split_by_tp else 1) * (layout.ep if is_expert else 1)


def cached_weight_copies(config, shape, element_size: int) -> int:
    """Bytes of the quantized copies megatron.quantization.gemm keeps of one linear weight
    [N, K] until the next optimizer step: for fprop (blocked along K) and dgrad (along N),
    when that GEMM quantizes the weight reusably (round to nearest, not delayed-scaled), one
    copy of the weight's dtype -- two when the GEMM applies the Hadamard transform in a copy
    of its own (gemm.rotation_fused: not for MX and 1-D NVFP4 weights whose length the block
    divides), which is kept (zero-padded to the block along the axis) beside the quantized
    one."""
    total = 0
    for gemm, axis in (("fprop", 1), ("dgrad", 0)):
        fmt = getattr(config, gemm).b
        if fmt == "none" or not config.reusable(gemm, "b", fmt):
            continue
        dims, copies = list(shape), 1
        if gemm in config.rht.gemms and not rotation_fused(config, fmt, shape[axis],
                                                           weight=True):
            dims[axis] = math.ceil(dims[axis] / config.rht.block) * config.rht.block
            copies = 2
        total += copies * math.prod(dims) * element_size
    return total


def _rank_shape(param, layout: Layout) -> List[int]:
    """The shape of one rank's shard of `param` of the single-rank model."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] //= layout.tp
    return shape


def _weight_cache_bytes(model, args, layout: Layout):
    """(module name, bytes per rank) of the cached quantized copies of every quantized linear
    weight of the single-rank `model` (an expert's spread over EP: each rank holds 1/EP of
    the experts); nothing under --no-quant-weight-cache."""
    from megatron.quantization.layers import QuantizedLinearMixin

    if not args.quant_config.backend.weight_cache:
        return
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinearMixin) or module.quant_site is None:
            continue
        weight = module.weight
        if weight is None:               # the output layer of tied embeddings
            weight = model.shared_embedding_or_output_weight()
        size = cached_weight_copies(module.quant_config, _rank_shape(weight, layout),
                                    weight.element_size())
        is_expert = getattr(weight, "allreduce", True) is False
        if size:
            yield name, size // (layout.ep if is_expert else 1)


def parameters_per_stage(args, layout: Layout, padded_vocab: int) -> List[StageParameters]:
    """Per-rank parameter counts and bytes of every pipeline stage, and the quantized weight
    copies each keeps (persistent: every optimizer step only replaces them)."""
    model = build_meta_model(single_rank_args(args, padded_vocab_size=padded_vocab),
                             expert_parallel=layout.ep)
    tied = not args.untie_embeddings_and_output_weights
    stages = [StageParameters() for _ in range(layout.pp)]
    for name, param in model.named_parameters():
        is_expert = getattr(param, "allreduce", True) is False
        count = param.numel() // _rank_divisor(param, layout)
        for stage in _stages_of(name, layout, tied):
            if is_expert:
                stages[stage].expert += count
            else:
                stages[stage].dense += count
            stages[stage].bytes += count * param.element_size()
    for name, size in _weight_cache_bytes(model, args, layout):
        # The copies follow the layer's stage (output layer: the last).
        for stage in _stages_of(f"{name}.weight", layout, tied):
            stages[stage].weight_cache_bytes += size
    return stages


def gradient_bytes(args, params: StageParameters) -> int:
    """megatron's main-grad buffer: fp32 unless --grad-reduce-in-bf16."""
    return params.count * (2 if args.grad_reduce_in_bf16 else 4)


def optimizer_bytes(args, params: StageParameters, layout: Layout, distributed: bool) -> int:
    """fp32 optimizer state, plus fp32 master weights of bf16/fp16 parameters."""
    per_param = 8 if args.optimizer == "adam" else 4    # exp_avg + exp_avg_sq, or momentum
    if args.bf16 or args.fp16:
        per_param += 4
    if not distributed:
        return params.count * per_param
    return (math.ceil(params.dense / layout.dp) + math.ceil(params.expert / layout.expert_dp)) \
        * per_param
