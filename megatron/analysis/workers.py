"""Parallel per-file work: batches of manifest entries -> merged `Stats` per group.

Each worker loads one record at a time, summarises it (`summarize.py`) and merges the result
into its batch's groups, so what crosses process boundaries is a few histograms per group,
never tensors. Batches are balanced by bytes. `workers=1` runs in-process.
"""

from __future__ import annotations

import logging
import os
import time
from collections import namedtuple
from concurrent.futures import as_completed
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from megatron.analysis import forking
from megatron.analysis.accumulators import Stats
from megatron.analysis.hifp8 import (add_cast_histogram, add_grid_histogram, hifp8_scale_exponent,
                                    hifp8_seen_by_grid)
from megatron.analysis.loading import (MISMATCH, Entry, UnreadableRecord, check_record,
                                      finite_or_none, load_record, metadata_mismatch)
from megatron.analysis.progress import Progress
from megatron.analysis.ranges import format_ranges
from megatron.analysis.summarize import summarize_manifest_only, summarize_tensors
from megatron.tensor_capture.format import short_module_name
from megatron.tensor_capture.replay import stats_options

log = logging.getLogger("megatron.analysis")

KEY_FIELDS = ("quant_scheme", "format", "component", "layer", "module", "tensor_name",
              "operation", "phase", "gemm", "operand")
GroupKey = namedtuple("GroupKey", KEY_FIELDS)

# Writer statistics compared with the recomputed ones (relative tolerance; fractions absolute).
_CHECKED = (("mse", 1e-6), ("sqnr_db", 1e-6), ("flushed_fraction", 1e-9),
            ("saturated_fraction", 1e-9), ("nonfinite_fraction", 1e-9))


def short_module(path: str) -> str:
    """Module field of record names: last path element; experts keep their index."""
    return short_module_name(str(path))


def group_key(entry: Entry) -> GroupKey:
    m = entry.metadata
    layer = m.get("layer_idx")
    return GroupKey(
        quant_scheme=entry.quant_scheme, format=str(m.get("format") or "none"),
        component=str(m.get("component") or m.get("layer_type") or ""),
        layer=int(layer) if layer is not None else -1,
        module=short_module(m.get("module") or ""), tensor_name=str(m.get("tensor_name") or ""),
        operation=str(m.get("operation") or ""), phase=str(m.get("phase") or ""),
        gemm=str(m.get("gemm") or ""), operand=str(m.get("operand") or ""))


@dataclass
class BatchResult:
    """What one batch of records reduces to."""

    groups: Dict[GroupKey, Stats] = field(default_factory=dict)
    rows: List[dict] = field(default_factory=list)
    problems: List[dict] = field(default_factory=list)
    records: int = 0
    bytes: int = 0
    seconds_load: float = 0.0
    seconds_compute: float = 0.0

    def merge(self, other: "BatchResult") -> None:
        for key, stats in other.groups.items():
            if key in self.groups:
                self.groups[key].merge(stats)
            else:
                self.groups[key] = stats
        self.rows.extend(other.rows)
        self.problems.extend(other.problems)
        self.records += other.records
        self.bytes += other.bytes
        self.seconds_load += other.seconds_load
        self.seconds_compute += other.seconds_compute


def _problem(kind, message):
    return {"kind": kind, "level": "warning", "message": message}


def summarize_entry(entry: Entry, result: BatchResult, use_tensors: bool = True) -> None:
    """Summarise one record into `result` (problems are recorded, never raised)."""
    key = group_key(entry)
    fmt = format_ranges(key.format)
    m = entry.metadata
    t0 = time.perf_counter()
    stats = None
    if entry.path and use_tensors:
        try:
            record = load_record(entry.path, entry.directory)
        except Exception as exc:  # a missing or corrupt file must not stop the analysis
            reason = str(exc) if isinstance(exc, UnreadableRecord) else f"{entry.path}: {exc}"
            result.problems.append(_problem("unreadable_record", f"{reason}; skipped"))
            return
        t1 = time.perf_counter()
        result.seconds_load += t1 - t0
        why = check_record(record, entry.path, m, entry.tensor_info)
        if why:
            result.problems.append(_problem("bad_record", why))
            return
        # The manifest line (validated) must be the record's own metadata as written: a line
        # edited by hand, or a record file swapped with another of the same shape, would
        # otherwise put one record's numbers under another format or site.
        why = metadata_mismatch(record.get("metadata"), m)
        if why:
            result.problems.append(_problem(MISMATCH, f"{entry.path}: {why}; record skipped"))
            return
        axis, k = m.get("axis"), hifp8_scale_exponent(m)
        try:
            stats = summarize_tensors(record["tensor"], record.get("quantized") if fmt.quantized
                                      else None, hifp8_seen_by_grid(fmt, k),
                                      axis=-1 if axis is None else int(axis),
                                      scale_mode=str(m.get("scale_mode") or "floor"),
                                      options=stats_options(m))
        except Exception as exc:
            result.problems.append(_problem("bad_record", f"{entry.path}: {exc}; skipped"))
            return
        del record
        add_grid_histogram(stats, fmt, k)
        add_cast_histogram(stats, fmt, k)
        result.seconds_compute += time.perf_counter() - t1
        result.bytes += entry.bytes or _file_size(entry.path)
    else:
        stats = summarize_manifest_only(entry.tensor_info, entry.quant_error if fmt.quantized
                                        else None, fmt, hifp8_scale_exponent(m) is not None)
    stats.bytes = entry.bytes
    result.records += 1
    if key in result.groups:
        result.groups[key].merge(stats)
    else:
        result.groups[key] = stats
    result.rows.append(_row(entry, key, stats))


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _row(entry: Entry, key: GroupKey, stats: Stats) -> dict:
    """One line of records.csv: identity, size and the record's own error metrics."""
    m = entry.metadata
    metrics = stats.metrics()
    quant = metrics.get("quantization") or {}
    row = dict(key._asdict())
    row.update(iteration=m.get("iteration"), micro_batch=m.get("micro_batch"),
               rank=m.get("rank"), file=entry.file, numel=stats.n, absmax=metrics["absmax"],
               std=metrics["std"], from_tensors=bool(stats.from_tensors))
    for name in ("mse", "sqnr_db", "relative_error", "flushed_fraction", "saturated_fraction",
                 "nonfinite_fraction"):
        row[name] = quant.get(name)
    if stats.from_tensors and entry.quant_error and stats.quantized:
        row["writer_mismatch"] = ",".join(_mismatches(entry.quant_error, quant))
    else:
        row["writer_mismatch"] = ""
    return row


def _mismatches(writer: dict, ours: dict) -> List[str]:
    bad = []
    for name, tol in _CHECKED:
        a, b = writer.get(name), ours.get(name)
        fa, fb = finite_or_none(a), finite_or_none(b)
        if fa is None or fb is None:
            # inf / None must agree as such
            if (a is None) != (b is None) or (fa is None) != (fb is None):
                if not (a in (None, 0.0) and b in (None, 0.0)):
                    bad.append(name)
            continue
        scale = max(abs(fa), abs(fb), 1.0 if "fraction" in name else 0.0)
        if abs(fa - fb) > tol * max(scale, 1e-300):
            bad.append(name)
    return bad


def summarize_batch(entries: List[Entry], use_tensors: bool = True) -> BatchResult:
    result = BatchResult()
    for entry in entries:
        summarize_entry(entry, result, use_tensors)
    return result


def make_batches(entries: List[Entry], workers: int, target_bytes: int = 256 << 20,
                 max_records: int = 64) -> List[List[Entry]]:
    """Split entries into batches of similar byte size (several per worker, for balance)."""
    total = sum(max(e.bytes, 1) for e in entries)
    per = max(1, min(target_bytes, total // max(1, workers * 8)))
    batches, current, size = [], [], 0
    for entry in entries:
        current.append(entry)
        size += max(entry.bytes, 1)
        if size >= per or len(current) >= max_records:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    return batches


def _init_worker():
    import torch
    torch.set_num_threads(1)     # one process per core; intra-op threads would oversubscribe


def run_batches(entries: List[Entry], workers: int = 1, progress: bool = True,
                use_tensors: bool = True) -> BatchResult:
    """Summarise all entries with `workers` processes. Results are merged in batch order,
    whatever order the workers finish in, so the float sums (and the report) are the same
    from run to run."""
    total_bytes = sum(e.bytes for e in entries)
    bar = Progress(len(entries), total_bytes, enabled=progress)
    merged = BatchResult()
    batches = make_batches(entries, workers)
    if workers <= 1 or len(batches) <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)      # the kernels are sized for one core per worker
        try:
            for batch in batches:
                part = summarize_batch(batch, use_tensors)
                merged.merge(part)
                bar.update(len(batch), sum(e.bytes for e in batch))
        finally:
            torch.set_num_threads(threads)
    else:
        with forking.pool(workers, initializer=_init_worker) as pool:
            futures = {pool.submit(summarize_batch, batch, use_tensors): index
                       for index, batch in enumerate(batches)}
            parts = [None] * len(batches)
            for future in as_completed(futures):
                index = futures[future]
                batch = batches[index]
                try:
                    parts[index] = future.result()
                except Exception as exc:  # a crashed worker loses its batch, not the report
                    parts[index] = _problem(
                        "worker_failure", f"a worker failed on {len(batch)} records "
                                          f"({batch[0].source} ...): {exc}")
                bar.update(len(batch), sum(e.bytes for e in batch))
            for part in parts:
                if isinstance(part, BatchResult):
                    merged.merge(part)
                else:
                    merged.problems.append(part)
    elapsed = bar.close()
    log.info("summarised %d records (%.1f MB) in %.2f s with %d worker(s)", merged.records,
             merged.bytes / 1e6, elapsed, max(1, workers))
    return merged
