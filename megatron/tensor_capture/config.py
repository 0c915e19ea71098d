"""`CaptureConfig`: the capture decision, built once from the flags by megatron.training.

Everything below the training loop (callback, policy, writer) reads this object, never the
argparse Namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import FrozenSet, Optional, Pattern, Tuple

from megatron.tensor_capture.policy import CaptureRule

MODES = ("full", "stats")


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture, where, and how the writer behaves (docs/capture-format.md)."""

    root: str                                 # --tensor-save-dir
    quant_scheme: str                         # records go to root/<quant_scheme>/
    # Which records, in which mode, at which iterations (the first rule selecting a record
    # decides); from --tensor-save-config and the flags that override it.
    rules: Tuple[CaptureRule, ...] = (CaptureRule(),)
    # --control-iter: capture iterations S+1..S+N of a run resumed at S and end the run after
    # them; 0 = every iteration, no stop; None = neither (a schedule alone).
    control_iter: Optional[int] = 1
    micro_batches: int = 1                    # first M micro-batches of a captured iteration
    layers: Optional[FrozenSet[int]] = None   # None = every layer; 0 = the output layer
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
    config_file: Optional[str] = None         # --tensor-save-config, for the run file

    def __post_init__(self):
        for rule in self.rules:
            if rule.mode not in MODES + ("off",):
                raise ValueError(f"capture mode {rule.mode!r} is invalid; valid: "
                                 f"{', '.join(MODES)}, off")

    @property
    def directory(self) -> str:
        return os.path.join(self.root, self.quant_scheme)

    @property
    def mode(self) -> str:
        return rules_mode(self.rules)


def rules_mode(rules) -> str:
    """full or stats, `mixed` when rules use both, `off` when no rule captures."""
    modes = {rule.mode for rule in rules} - {"off"}
    return modes.pop() if len(modes) == 1 else ("mixed" if modes else "off")
