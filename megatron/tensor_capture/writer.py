"""The capture writer: a bounded queue drained by one background thread.

Guarantees (docs/capture-format.md):
- the training step only waits when the queue is full (back-pressure, counted as stall time);
- each record file is written under a temporary name and renamed into place, so a file with
  the final name is always complete;
- a manifest line is appended only after its file has been renamed, in one `write` that is
  cut back off if it fails (diskio.append_line), so the manifest lists only complete files
  and never ends in a partial line, not even on a full disk;
- the first failure (full disk, unwritable directory, ...) is kept as `error`: the writer
  removes the partial file, drops everything still queued and accepts nothing more. A full
  disk reads "no space left on device (<dir>)" however it surfaced.

The thread runs at a lower priority than the training step (see `_run_in_background`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from datetime import datetime
from typing import Optional

import torch

from megatron.tensor_capture.diskio import (
    append_line, describe_error, hidden_temporary, is_no_space, open_for_append,
    remove_quietly)
from megatron.tensor_capture.format import json_line, keep_metrics
from megatron.tensor_capture.records import CaptureItem


class CaptureWriter:
    """Writes CaptureItems to `directory` and their manifest lines to `manifest_path`."""

    def __init__(self, directory: str, manifest_path: str, max_records: int = 256,
                 max_bytes: int = 1 << 30):
        self.directory = directory
        self.manifest_path = manifest_path
        self.max_records = max(1, int(max_records))
        self.max_bytes = max(1, int(max_bytes))
        self.error: Optional[str] = None
        # Counters for the run summary.
        self.records = 0          # manifest lines written
        self.files = 0            # record files renamed into place
        self.bytes = 0            # bytes of those files
        self.write_seconds = 0.0  # writer thread busy time
        self.stall_seconds = 0.0  # training-step time spent waiting for queue space
        self.dropped = 0          # records not written because of an error or a timeout
        self._queue = deque()
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._manifest = open_for_append(manifest_path)
        self._thread = threading.Thread(target=self._run, name="tensor-capture-writer",
                                        daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------

    def submit(self, item: CaptureItem, metrics=None) -> bool:
        """Queue `item`; waits while the queue is full. False if the item was dropped.
        `metrics`: the statistics its manifest line keeps (format.keep_metrics; None = all)."""
        size = item.nbytes
        with self._cond:
            if self.error is not None or self._closed:
                self.dropped += 1
                return False
            if self._full(size):
                start = time.perf_counter()
                while self.error is None and self._full(size):
                    self._cond.wait()
                self.stall_seconds += time.perf_counter() - start
                if self.error is not None:
                    self.dropped += 1
                    return False
            self._queue.append((item, metrics))
            self._queued_bytes += size
            self._cond.notify_all()
        return True

    def _full(self, size: int) -> bool:
        # A record larger than the byte budget is still accepted into an empty queue.
        return len(self._queue) >= self.max_records or \
            (bool(self._queue) and self._queued_bytes + size > self.max_bytes)

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + int(self._busy)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued record is written (or dropped). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Drain, stop the thread and close the manifest. False if records were abandoned."""
        drained = self.drain(timeout)
        with self._cond:
            if not drained:
                self.dropped += len(self._queue)
                self._queue.clear()
                if self.error is None:
                    self.error = f"writer did not finish within {timeout:g} s; pending " \
                                 "records were abandoned"
            self._closed = True
            self._cond.notify_all()
        if drained:
            self._thread.join(timeout)
        if not self._thread.is_alive() and self._manifest is not None:
            os.close(self._manifest)
            self._manifest = None
        return drained

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        _run_in_background()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item, metrics = self._queue.popleft()
                self._busy = True
            size = item.nbytes
            start = time.perf_counter()
            try:
                if self.error is None:
                    self._write(item, metrics)
                else:
                    self.dropped += 1
            except BaseException as exc:  # noqa: BLE001 - any failure stops capture cleanly
                with self._cond:
                    self.error = self.error or describe_error(
                        exc, os.path.join(self.directory, item.file_name or ""),
                        self.directory, getattr(exc, "no_space", None))
                    self.dropped += 1 + len(self._queue)
                    self._queue.clear()
            finally:
                self.write_seconds += time.perf_counter() - start
                with self._cond:
                    self._busy = False
                    self._queued_bytes -= size
                    if not self._queue:
                        self._queued_bytes = 0
                    self._cond.notify_all()

    def _write(self, item: CaptureItem, metrics=None) -> None:
        item.finish_stats()
        item.metadata["save_time"] = datetime.now().astimezone().isoformat(timespec="milliseconds")
        file_name, nbytes, path = item.file_name, 0, None
        if file_name is not None:          # full mode: a record file; stats mode: none
            path = os.path.join(self.directory, file_name)
            nbytes = self._write_record(item, path)
        entry = item.manifest_entry(file_name, nbytes)
        if metrics is not None:
            entry = keep_metrics(entry, metrics)
        line = json_line(entry).encode("utf-8")
        try:
            append_line(self._manifest, line)
        except BaseException:
            # Not listed, so not kept: the manifest is the index of complete records.
            if path is not None:
                remove_quietly(path)
            raise
        if path is not None:
            self.files += 1
            self.bytes += nbytes
        self.records += 1
        item.release()

    def _write_record(self, item: CaptureItem, path: str) -> int:
        """Write the record file under a temporary name, rename it; its size in bytes."""
        tmp = hidden_temporary(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(item.record(), f)
                nbytes = f.tell()
            os.replace(tmp, path)
            return nbytes
        except BaseException as exc:
            # Judged while the partial file still fills the disk (see diskio.is_no_space).
            exc.no_space = is_no_space(exc, self.directory, item.nbytes)
            remove_quietly(tmp)
            raise

    def summary(self) -> dict:
        return {"records": self.records, "files": self.files, "bytes": self.bytes,
                "write_seconds": round(self.write_seconds, 6),
                "stall_seconds": round(self.stall_seconds, 6), "dropped": self.dropped,
                "error": self.error}


WRITER_NICENESS = 10


def _run_in_background() -> None:
    """Make the calling (writer) thread yield to the training step.

    One intra-op thread (a thread-local setting), and a lower scheduling priority (Linux
    threads have their own niceness): on a machine whose cores the training step keeps busy,
    an equal-priority writer takes a core from one of the step's OpenMP threads, and every
    parallel region of the step then waits for that thread. At lower priority the writer
    runs in idle time, and when it falls behind, back-pressure lets it catch up.
    """
    torch.set_num_threads(1)
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + WRITER_NICENESS))
    except (AttributeError, OSError):
        pass        # no per-thread priorities here: run at normal priority
