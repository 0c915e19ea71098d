"""Counter-based random streams for stochastic rounding: reproducible bit for bit.

Every stochastically rounded operand draws its numbers from a fresh torch.Generator seeded
with a 63-bit hash of

    (run seed, iteration, data-parallel rank, GEMM site path, GEMM, operand, call number)

where the call number counts that operand's quantizations at that site within the iteration
(micro-batches, in the schedule's deterministic order). Nothing is carried from one iteration
to the next, so a run resumed from a checkpoint draws exactly the bits of the uninterrupted
run; tensor-parallel ranks (which hold replicas of their inputs) draw the same bits, data-
parallel ranks (other data) different ones. The key lives in the model's QuantRuntime
(`RoundingDraws`); the training loop calls `start_iteration` before each iteration, and outside
training (tests, tools) the iteration is 0.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch


class RoundingDraws:
    """The key of one model's stochastic-rounding draws and their call counters."""

    def __init__(self):
        self.seed, self.iteration, self.stream = 0, 0, 0
        self.calls: Counter = Counter()

    def start_iteration(self, seed: int, iteration: int, stream: int = 0) -> None:
        """Key the draws of the coming iteration; `stream` separates data-parallel ranks."""
        self.seed, self.iteration, self.stream = int(seed), int(iteration), int(stream)
        self.calls.clear()

    def draw_seed(self, site: str, gemm: str, operand: str) -> int:
        """The generator seed of the next stochastically rounded (site, gemm, operand)."""
        call = self.calls[(site, gemm, operand)]
        self.calls[(site, gemm, operand)] += 1
        key = f"{self.seed}/{self.iteration}/{self.stream}/{site}/{gemm}/{operand}/{call}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                              "little") >> 1


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed` (what a capture needs to redraw the bits)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
