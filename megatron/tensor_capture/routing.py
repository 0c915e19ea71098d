"""Each record in the mode of the capture rule that selects it.

The observer hands GEMM reports to a `RuleRouter` as it would to a Recorder. The router asks
the policy which rule captures the record at this iteration (none: it is dropped here, before
anything is copied) and lets the one Recorder build it in that rule's mode (full: a record
file; stats: a manifest line only), its manifest line keeping the rule's statistics. One
recorder keeps one counter, so records stay numbered in the order they were produced.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from megatron.tensor_capture.policy import CapturePolicy
from megatron.tensor_capture.records import CaptureItem, Recorder


class RuleRouter:
    """Recorder-compatible `capture()` that applies the policy's rules per record."""

    def __init__(self, policy: CapturePolicy, submit: Callable[..., bool]):
        self.policy = policy
        self._submit = submit              # CaptureWriter.submit(item, metrics)
        self._metrics = None
        self._lock = threading.Lock()      # the mode is the recorder's, set per record
        self.recorder: Optional[Recorder] = None

    def submit(self, item: CaptureItem) -> bool:
        """The Recorder's submit: passes the deciding rule's statistics on to the writer."""
        return self._submit(item, self._metrics)

    def capture(self, info, config, role, iteration, micro_batch, gemm, operand, hp, q, fmt,
                axis, extra=None) -> bool:
        rule = self.policy.rule_at(iteration, info, role, q is not None)
        if rule is None:
            return False
        with self._lock:
            self.recorder.full = rule.mode == "full"
            self._metrics = rule.stats
            return self.recorder.capture(info, config, role, iteration, micro_batch, gemm,
                                         operand, hp, q, fmt, axis, extra=extra)
