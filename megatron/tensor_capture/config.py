"""`CaptureConfig`: the capture decision, built once from the flags by megatron.training.

Everything below the training loop (callback, policy, writer) reads this object, never the
argparse Namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import FrozenSet, Optional, Pattern

from megatron.tensor_capture.policy import KindSelection, parse_kinds

MODES = ("full", "stats")


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture, where, and how the writer behaves (docs/capture-format.md)."""

    root: str                                 # --tensor-save-dir
    quant_scheme: str                         # records go to root/<quant_scheme>/
    mode: str = "full"                        # full: tensor files; stats: manifest only
    control_iter: int = 1                     # iterations captured from the run's start; 0 = all
    micro_batches: int = 1                    # first M micro-batches of a captured iteration
    layers: Optional[FrozenSet[int]] = None   # None = every layer; 0 = the output layer
    kinds: KindSelection = parse_kinds(None)
    name_filter: Optional[Pattern] = None
    continue_on_error: bool = False
    queue_records: int = 256
    queue_bytes: int = 1 << 30
    drain_timeout: float = 600.0
    train_iters: int = 0                      # the run's last iteration: drain before it ends
    num_micro_batches: int = 1                # micro-batches per iteration on this rank
    # The run's shapes, for the estimate of the capture's size before it starts.
    micro_batch_size: int = 1
    seq_length: int = 0
    element_bytes: int = 4                    # bytes per element of the training dtype

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"capture mode {self.mode!r} is invalid; valid: {', '.join(MODES)}")

    @property
    def directory(self) -> str:
        return os.path.join(self.root, self.quant_scheme)

    @property
    def full(self) -> bool:
        return self.mode == "full"
