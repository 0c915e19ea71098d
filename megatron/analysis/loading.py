"""Finding capture directories and reading their manifests, run files and records.

A capture is read through its manifests only (docs/capture-format.md): every manifest line that
parses names one complete record, so no directory listing or unpickling is needed to know what
a capture holds. Accepted inputs: a `--tensor-save-dir` (one sub-directory per quant type), a
single quant-type directory, or several of either.

When the capture package provides `megatron.tensor_capture.load` (`load_record`,
`read_manifest`), those are used; the readers here implement the same contract otherwise.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

log = logging.getLogger("megatron.analysis")

FORMAT_VERSIONS = (1,)
MANIFEST_GLOB = "manifest-*.jsonl"


class Problems:
    """Warnings about bad input, kept for statistics.json and the report (and logged)."""

    def __init__(self):
        self.items: List[Dict[str, str]] = []

    def add(self, kind: str, message: str, level: str = "warning") -> None:
        getattr(log, level if level in ("warning", "error", "info") else "warning")(message)
        self.items.append({"kind": kind, "level": level, "message": message})

    def extend(self, items) -> None:
        for item in items:
            log.warning(item["message"])
            self.items.append(item)

    def __len__(self):
        return len(self.items)


@dataclass
class Entry:
    """One manifest line: a record of a capture (its file is None in stats mode)."""

    quant_type: str
    directory: str
    file: Optional[str]
    bytes: int
    metadata: dict
    tensor_info: dict
    quant_error: Optional[dict]
    source: str = ""                     # manifest file and line, for messages

    @property
    def path(self) -> Optional[str]:
        return None if not self.file else os.path.join(self.directory, self.file)


@dataclass
class Capture:
    """One quant-type directory: its runs, per-rank summaries and manifest entries."""

    directory: str
    quant_type: str
    runs: List[dict] = field(default_factory=list)
    summaries: List[dict] = field(default_factory=list)
    entries: List[Entry] = field(default_factory=list)


def _capture_loader():
    try:
        from megatron.tensor_capture import load as capture_load
    except Exception:
        return None
    return capture_load


def _is_capture_dir(path: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(path), MANIFEST_GLOB)))


def discover(paths: List[str], problems: Problems) -> List[str]:
    """Quant-type directories (those holding manifests) found under the given paths."""
    found: List[str] = []
    for path in paths:
        if not os.path.exists(path):
            problems.add("missing_directory", f"capture directory {path} does not exist")
            continue
        if not os.path.isdir(path):
            problems.add("missing_directory", f"{path} is not a directory")
            continue
        if _is_capture_dir(path):
            found.append(os.path.abspath(path))
            continue
        subdirs = sorted(d for d in glob.glob(os.path.join(glob.escape(path), "*"))
                         if os.path.isdir(d) and _is_capture_dir(d))
        if not subdirs:
            problems.add("empty_directory", f"no capture manifests ({MANIFEST_GLOB}) in {path} "
                                            f"or its sub-directories")
        found.extend(os.path.abspath(d) for d in subdirs)
    unique = []
    for d in found:
        if d not in unique:
            unique.append(d)
    return unique


def _decode_nonfinite(value):
    """The manifest writes inf/nan as strings; turn them back into floats."""
    if isinstance(value, str) and value.lower() in ("inf", "+inf", "-inf", "nan", "infinity",
                                                     "-infinity"):
        return float(value)
    if isinstance(value, dict):
        return {k: _decode_nonfinite(v) for k, v in value.items()}
    return value


def read_manifest_file(path: str, problems: Problems) -> List[dict]:
    """Parsed lines of one manifest; lines that do not parse (a killed run) are skipped."""
    loader = _capture_loader()
    if loader is not None and hasattr(loader, "read_manifest"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            items = loader.read_manifest(path)
        for warning in caught:
            problems.add("truncated_manifest_line", f"{warning.message} (the rest of the "
                                                    f"manifest is used)")
        for number, item in enumerate(items, 1):
            item["_source"] = f"{os.path.basename(path)} entry {number}"
        return [item for item in items if isinstance(item, dict)]
    lines = []
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                problems.add("truncated_manifest_line",
                             f"{path}:{number}: skipping a manifest line that does not parse "
                             f"(truncated by a killed run?)")
                continue
            if not isinstance(item, dict):
                problems.add("bad_manifest_line", f"{path}:{number}: not a JSON object, skipped")
                continue
            item["_source"] = f"{os.path.basename(path)}:{number}"
            lines.append(item)
    return lines


def _read_json(path: str, problems: Problems, kind: str) -> Optional[dict]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        problems.add(kind, f"cannot read {path}: {exc}")
        return None


def read_capture(directory: str, problems: Problems) -> Capture:
    """Run files, summaries and manifest entries of one quant-type directory."""
    capture = Capture(directory=directory, quant_type=os.path.basename(directory.rstrip("/")))
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "run-*.json"))):
        run = _read_json(path, problems, "bad_run_file")
        if run is not None:
            capture.runs.append(run)
            capture.quant_type = run.get("quant_type") or capture.quant_type
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "summary-*.json"))):
        summary = _read_json(path, problems, "bad_summary_file")
        if summary is not None:
            summary["_file"] = os.path.basename(path)
            capture.summaries.append(summary)
            if summary.get("error"):
                problems.add("run_error", f"{path}: the capture reported an error: "
                                          f"{summary['error']}")
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), MANIFEST_GLOB))):
        for item in read_manifest_file(path, problems):
            entry = _entry(item, directory, capture.quant_type, problems)
            if entry is not None:
                capture.entries.append(entry)
    return capture


def _entry(item: dict, directory: str, default_qt: str, problems: Problems) -> Optional[Entry]:
    source = f"{directory}/{item.get('_source', '?')}"
    version = item.get("format_version")
    if version not in FORMAT_VERSIONS:
        problems.add("unknown_format_version",
                     f"{source}: manifest line has format_version {version!r} (this analysis "
                     f"reads {', '.join(map(str, FORMAT_VERSIONS))}); skipped")
        return None
    metadata = item.get("metadata") or {}
    if not isinstance(metadata, dict):
        problems.add("bad_manifest_line", f"{source}: metadata is not an object; skipped")
        return None
    quant_error = item.get("quant_error")
    return Entry(
        quant_type=str(metadata.get("quant_type") or default_qt),
        directory=directory, file=item.get("file"), bytes=int(item.get("bytes") or 0),
        metadata=metadata, tensor_info=_decode_nonfinite(item.get("tensor_info") or {}),
        quant_error=_decode_nonfinite(quant_error) if isinstance(quant_error, dict) else None,
        source=source)


def load_record(path: str) -> dict:
    """A record dict from its .pt file (weights_only: records hold only tensors and plain data)."""
    loader = _capture_loader()
    if loader is not None and hasattr(loader, "load_record"):
        return loader.load_record(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def check_record(record, source: str) -> Optional[str]:
    """Why a loaded record cannot be analysed, or None when it follows the format."""
    if not isinstance(record, dict):
        return f"{source}: not a record dict"
    version = record.get("format_version")
    if version not in FORMAT_VERSIONS:
        return (f"{source}: record has format_version {version!r} (this analysis reads "
                f"{', '.join(map(str, FORMAT_VERSIONS))}); skipped")
    if not isinstance(record.get("tensor"), torch.Tensor):
        return f"{source}: record has no tensor; skipped"
    if record["tensor"].dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return f"{source}: unsupported dtype {record['tensor'].dtype}; skipped"
    return None


def finite_or_none(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
