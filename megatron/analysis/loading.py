"""Finding capture directories and reading their manifests, run files and records.

A capture is read through its manifests only (docs/capture-format.md): every manifest line that
parses names one complete record, so no directory listing or unpickling is needed to know what
a capture holds. Accepted inputs: a `--tensor-save-dir` (one sub-directory per scheme), a
single scheme directory, or several of either. File names, the manifest schema and its
encoding are megatron.tensor_capture.format's; records load through
megatron.tensor_capture.load (weights_only=True).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture import load as capture_load
from megatron.tensor_capture.format import MANIFEST_GLOB

log = logging.getLogger("megatron.analysis")

FORMAT_VERSIONS = capture_format.READABLE_VERSIONS


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

    quant_scheme: str
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
    """One scheme directory: its runs, per-rank summaries and manifest entries."""

    directory: str
    quant_scheme: str
    runs: List[dict] = field(default_factory=list)
    summaries: List[dict] = field(default_factory=list)
    entries: List[Entry] = field(default_factory=list)


def _is_capture_dir(path: str) -> bool:
    return bool(capture_format.capture_files(path, MANIFEST_GLOB))


def discover(paths: List[str], problems: Problems) -> List[str]:
    """Scheme directories (those holding manifests) found under the given paths."""
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
        subdirs = sorted(d for d in capture_format.capture_files(path, "*")
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


def read_manifest_file(path: str, problems: Problems) -> List[dict]:
    """Parsed lines of one manifest; lines that do not parse (a killed run) are reported and
    skipped, and the rest of the manifest is used."""
    items = []
    for number, item, problem in capture_format.parse_manifest(path):
        if problem is not None:
            kind, message = problem
            problems.add(kind, f"{message} (the rest of the manifest is used)")
            continue
        item["_source"] = f"{os.path.basename(path)}:{number}"
        items.append(item)
    return items


def _read_json(path: str, problems: Problems, kind: str) -> Optional[dict]:
    try:
        return capture_format.read_json(path)
    except (OSError, json.JSONDecodeError) as exc:
        problems.add(kind, f"cannot read {path}: {exc}")
        return None


def read_capture(directory: str, problems: Problems) -> Capture:
    """Run files, summaries and manifest entries of one scheme directory."""
    capture = Capture(directory=directory, quant_scheme=os.path.basename(directory.rstrip("/")))
    for path in capture_format.capture_files(directory, capture_format.RUN_GLOB):
        run = _read_json(path, problems, "bad_run_file")
        if run is not None:
            capture.runs.append(run)
            capture.quant_scheme = run.get(capture_format.SCHEME_KEY) or capture.quant_scheme
    for path in capture_format.capture_files(directory, capture_format.SUMMARY_GLOB):
        summary = _read_json(path, problems, "bad_summary_file")
        if summary is not None:
            summary["_file"] = os.path.basename(path)
            capture.summaries.append(summary)
            if summary.get("error"):
                problems.add("run_error", f"{path}: the capture reported an error: "
                                          f"{summary['error']}")
    for path in capture_format.manifest_files(directory):
        if not os.path.exists(capture_format.summary_for_manifest(path)):
            problems.add("unfinished_run", f"{path}: the run has no summary file, so it did not "
                                           "end (killed, or still running); the records its "
                                           "manifest lists are complete, later ones are missing")
        for item in read_manifest_file(path, problems):
            entry = _entry(item, directory, capture.quant_scheme, problems)
            if entry is not None:
                capture.entries.append(entry)
    return capture


def _entry(item: dict, directory: str, default_scheme: str, problems: Problems) -> Optional[Entry]:
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
    nbytes = item.get("bytes") or 0
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        problems.add("bad_manifest_line", f"{source}: bytes {nbytes!r} is not a byte count; "
                                          "skipped")
        return None
    file_name = item.get("file")
    if file_name:
        try:
            capture_format.record_path(directory, file_name)
        except ValueError as exc:
            problems.add("bad_manifest_line", f"{source}: {exc}; skipped")
            return None
    tensor_info = item.get("tensor_info")
    quant_error = item.get("quant_error")
    return Entry(
        quant_scheme=str(metadata.get(capture_format.SCHEME_KEY) or default_scheme),
        directory=directory, file=file_name, bytes=nbytes, metadata=metadata,
        tensor_info=tensor_info if isinstance(tensor_info, dict) else {},
        quant_error=quant_error if isinstance(quant_error, dict) else None,
        source=source)


def load_record(path: str) -> dict:
    """A record dict from its .pt file (weights_only: records hold only tensors and plain data)."""
    return capture_load.load_record(path)


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
