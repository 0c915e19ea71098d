"""The tensor-parallel communication of one linear GEMM, run inside its autograd function.

Megatron-LM's linear layers (LinearWithGradAccumulationAndAsyncCommunication) communicate
inside the GEMM's own autograd function, and the quantized linear does the same:

sequence parallel   the layer's input is this rank's shard of the sequence, [s/tp, ...].
                    Forward all-gathers it for the GEMM; only the shard is saved for backward,
                    which all-gathers it again while the dgrad GEMM runs and reduce-scatters
                    dX while the wgrad GEMM runs.
all-reduce dgrad    (tensor parallel without sequence parallelism, column-parallel layers) dX is
                    all-reduced while the wgrad GEMM runs.

The collectives are the ones megatron-core's mappings run (all-gather and reduce-scatter
along the first dimension, all-reduce), so the numbers are the same; what changes is the
activation memory (the shard, not the gathered input, is kept) and the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

Wait = Callable[[], None]


def _no_wait() -> None:
    return None


def _waiter(work) -> Wait:
    return _no_wait if work is None else work.wait


@dataclass(frozen=True)
class TensorParallelComm:
    """How one linear layer's input and input gradient cross its tensor-parallel group."""

    group: Optional[dist.ProcessGroup]
    sequence_parallel: bool = False
    allreduce_dgrad: bool = False

    def __post_init__(self):
        if self.sequence_parallel and self.allreduce_dgrad:
            raise ValueError("a sequence-parallel linear reduce-scatters its input gradient; "
                             "it cannot also all-reduce it")

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def gather_input(self, shard: torch.Tensor, async_op: bool = False
                     ) -> Tuple[torch.Tensor, Wait]:
        """(the whole sequence, wait): the shards of every rank concatenated along dim 0; the
        result may be read only after wait() (async_op) ."""
        if not self.sequence_parallel or self.size == 1:
            return shard, _no_wait
        shard = shard.contiguous()
        full = shard.new_empty((shard.size(0) * self.size, *shard.shape[1:]))
        work = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op)
        return full, _waiter(work)

    def reduce_input_grad(self, grad: torch.Tensor, async_op: bool = False
                          ) -> Tuple[torch.Tensor, Wait]:
        """(this rank's input gradient, wait): dX reduce-scattered along dim 0 (sequence
        parallel) or all-reduced (allreduce_dgrad), otherwise dX itself."""
        if self.size == 1 or not (self.sequence_parallel or self.allreduce_dgrad):
            return grad, _no_wait
        grad = grad.contiguous()
        if self.allreduce_dgrad:
            work = dist.all_reduce(grad, group=self.group, async_op=async_op)
            return grad, _waiter(work)
        if grad.size(0) % self.size:
            raise ValueError(f"sequence-parallel input gradient of {grad.size(0)} rows cannot "
                             f"be split over {self.size} tensor-parallel ranks")
        shard = grad.new_empty((grad.size(0) // self.size, *grad.shape[1:]))
        work = dist.reduce_scatter_tensor(shard, grad, group=self.group, async_op=async_op)
        return shard, _waiter(work)
