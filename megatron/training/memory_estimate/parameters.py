"""Per-rank parameters of every pipeline stage, their gradients (main-grad buffer) and optimizer
state, with and without the distributed optimizer."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import List

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


def parameters_per_stage(args, layout: Layout, padded_vocab: int) -> List[StageParameters]:
    """Per-rank parameter counts and bytes of every pipeline stage."""
    model = build_meta_model(single_rank_args(args, padded_vocab_size=padded_vocab),
                             expert_parallel=layout.ep)
    tied = not args.untie_embeddings_and_output_weights
    stages = [StageParameters() for _ in range(layout.pp)]
    for name, param in model.named_parameters():
        split_by_tp = bool(getattr(param, "tensor_model_parallel", False))
        is_expert = getattr(param, "allreduce", True) is False
        divisor = (layout.tp if split_by_tp else 1) * (layout.ep if is_expert else 1)
        count = param.numel() // divisor
        for stage in _stages_of(name, layout, tied):
            if is_expert:
                stages[stage].expert += count
            else:
                stages[stage].dense += count
            stages[stage].bytes += count * param.element_size()
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
