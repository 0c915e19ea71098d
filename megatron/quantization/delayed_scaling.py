"""Delayed FP8 scaling (TransformerEngine's `DelayedScaling`): the scale an operand uses at a
step comes from the amax history recorded BEFORE that step.

Each quantized operand slot of a GEMM site -- (gemm, operand), e.g. ("fprop", "input") --
keeps the amaxes of its last `length` quantizations (a step is one quantization: a micro-batch's
forward or backward, as TE updates its scales after every forward and backward pass). The amax
the scale is computed from is the maximum of the history ("max") or its latest entry
("most_recent"); the history starts at zeros, and an amax of 0 gives the scale 1.0, so the first
step uses TE's initial scale 1.0. The operand's own amax is then reduced (max) over the ranks
TE reduces it over -- the tensor- and data-parallel group of the pipeline stage -- and pushed.
Everything stays on the device: no host synchronisation per GEMM.

The histories are part of a checkpoint (`state_dict` / `load_state_dict`), so a resumed run
scales exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.quantization.formats import fp8_amax

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _reduce_max(amax: torch.Tensor) -> torch.Tensor:
    """amax reduced (max) over the stage's tensor- and data-parallel ranks, as TE does."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return amax
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return amax
    group = parallel_state.get_amax_reduction_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


class AmaxHistories:
    """The amax histories of one GEMM site, one per quantized operand slot."""

    def __init__(self, length: int, algo: str):
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"amax history length must be a positive int, got {length!r}")
        if algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"unknown amax compute algorithm {algo!r}; valid: "
                             f"{', '.join(AMAX_COMPUTE_ALGOS)}")
        self.length, self.algo = length, algo
        self.histories: Dict[Tuple[str, str], torch.Tensor] = {}     # ring buffers
        self.newest: Dict[Tuple[str, str], int] = {}
        # True: every step uses the operand's own amax (current scaling) and records it, to
        # fill the histories in one pass (an evaluation's warm-up, evaluation/losses.py).
        self.current = False

    def _ring(self, slot, device) -> torch.Tensor:
        """slot's history as a ring buffer: the newest entry at self.newest[slot], older ones
        after it (cyclically), so that a step writes one entry instead of shifting them all."""
        ring = self.histories.get(slot)
        if ring is None:
            ring = self.histories[slot] = torch.zeros(self.length, dtype=torch.float32,
                                                      device=device)
            self.newest[slot] = 0
        return ring

    def step(self, slot: Tuple[str, str], x: torch.Tensor, amax_into=None) -> torch.Tensor:
        """The amax (0-d float32) `slot`'s scale uses now; then x's amax joins the history.

        amax_into(x, out) writes max |x| into `out`, the history's new one-element entry (a
        kernel can reduce into it directly: no temporary, no copy); by default the eager
        reduction (NaN if x holds a NaN, else Inf if it holds an Inf)."""
        if x.numel() == 0:
            return self._step(slot, x.device, lambda entry: entry.zero_())
        if amax_into is None:
            return self._step(slot, x.device, lambda entry: entry.copy_(fp8_amax(x)))
        return self._step(slot, x.device, lambda entry: amax_into(x, entry))

    def step_with(self, slot: Tuple[str, str], amax: torch.Tensor) -> torch.Tensor:
        """step() for an operand whose amax is given (one seen in pieces, as chunked attention
        sees P and dS: the max over the pieces)."""
        return self._step(slot, amax.device,
                          lambda entry: entry.copy_(amax.detach().float().reshape(1)))

    def _step(self, slot, device, record) -> torch.Tensor:
        """The amax the scale uses now; then record(entry) writes the new amax into the
        history's new entry, which is reduced over the ranks."""
        ring = self._ring(slot, device)
        used = self._used(slot, ring)
        entry = self._push(slot, ring)
        record(entry)
        _reduce_max(entry)
        return entry[0].clone() if self.current else used

    def _used(self, slot, ring: torch.Tensor) -> torch.Tensor:
        """The amax the scale comes from: the history's max, or its newest entry (a new 0-d
        tensor either way: the entry itself will be overwritten)."""
        if self.algo == "max":
            return ring.max()
        return ring.narrow(0, self.newest[slot], 1).amax()

    def _push(self, slot, ring: torch.Tensor) -> torch.Tensor:
        """The one-element view of the slot that the next amax goes into (the oldest entry's,
        which it replaces)."""
        newest = self.newest[slot] = (self.newest[slot] - 1) % self.length
        return ring[newest:newest + 1]

    def ordered(self, slot) -> torch.Tensor:
        """slot's history, newest first (a copy)."""
        return self.histories[slot].roll(-self.newest[slot])

    def state_dict(self) -> dict:
        return {f"{gemm}.{operand}": self.ordered((gemm, operand)).cpu().tolist()
                for (gemm, operand) in sorted(self.histories)}

    def load_state_dict(self, state: dict, device) -> None:
        self.histories, self.newest = {}, {}
        for name, values in state.items():
            gemm, operand = name.split(".", 1)
            values = list(values)[:self.length]
            values += [0.0] * (self.length - len(values))
            self.histories[(gemm, operand)] = torch.tensor(values, dtype=torch.float32,
                                                           device=device)
            self.newest[(gemm, operand)] = 0


def histories_state(sites) -> dict:
    """{site path: {"gemm.operand": [amax, ...]}} of the sites with delayed scaling."""
    return {site.state.path: site.state.amax.state_dict() for site in sites
            if site.state is not None and site.state.amax is not None}


def load_histories_state(sites, state: dict, device) -> int:
    """Restore the histories saved by histories_state; returns how many sites were restored."""
    restored = 0
    for site in sites:
        if site.state is not None and site.state.amax is not None and site.state.path in state:
            site.state.amax.load_state_dict(state[site.state.path], device)
            restored += 1
    return restored
