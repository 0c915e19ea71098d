"""A dependency-free progress bar for long analyses (stderr; a log line when not a terminal)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("megatron.analysis")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TB"


class Progress:
    """Tracks records and bytes done; redraws one line on a TTY, logs every ~10 s otherwise."""

    def __init__(self, total_records: int, total_bytes: int, enabled: bool = True,
                 stream=None, label: str = "analysing"):
        self.total_records = total_records
        self.total_bytes = max(int(total_bytes), 0)
        self.records = 0
        self.bytes = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = label
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, records: int, nbytes: int) -> None:
        self.records += records
        self.bytes += nbytes
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and now - self._last >= 0.1:
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self.tty and now - self._last >= 10.0:
            self._last = now
            log.info(self._line(now))

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        frac = self.records / self.total_records if self.total_records else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = self.bytes / elapsed
        eta = (elapsed / frac - elapsed) if frac > 0 else float("nan")
        return (f"{self.label} [{bar}] {self.records}/{self.total_records} records, "
                f"{_human_bytes(self.bytes)}/{_human_bytes(self.total_bytes)}, "
                f"{_human_bytes(rate)}/s, {elapsed:.1f} s elapsed, eta {eta:.0f} s")

    def close(self) -> float:
        """Finish the bar; returns the elapsed seconds."""
        elapsed = time.perf_counter() - self.start
        if self.enabled and self.tty:
            self.stream.write("\r" + self._line(time.perf_counter()) + "\n")
            self.stream.flush()
        return elapsed
