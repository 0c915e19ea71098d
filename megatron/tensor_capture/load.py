"""Reading captures safely: records with weights_only=True, manifests line by line.

    from megatron.tensor_capture.load import read_manifest, load_record
    for entry in read_manifest("enhanced_tensor_logs/FA_linear_mxfp8"):
        record = load_record(entry["path"])   # full mode only (entry["file"] is None in stats mode)

A manifest line that does not parse (a run killed while appending it) is skipped with a
warning; every line that parses refers to a complete file.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import warnings
from typing import Iterator, List, Optional, Tuple

import torch

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_MANIFEST = re.compile(r"^manifest-(?P<run>.+)-rank(?P<rank>\d+)\.jsonl$")


def load_record(path: str, map_location="cpu") -> dict:
    """A record file as its dict (format_version, tensor, tensor_info, metadata, ...),
    loaded with weights_only=True: no code is unpickled."""
    return torch.load(path, map_location=map_location, weights_only=True)


def _decode(value):
    """Undo the manifest's encoding of non-finite floats as strings."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def manifest_files(directory: str, run_id: Optional[str] = None) -> List[str]:
    """Manifest paths in a capture directory (one per rank and run), sorted."""
    paths = []
    for path in sorted(glob.glob(os.path.join(directory, "manifest-*.jsonl"))):
        match = _MANIFEST.match(os.path.basename(path))
        if match and (run_id is None or match.group("run") == run_id):
            paths.append(path)
    return paths


def _parse_lines(path: str) -> Iterator[Tuple[int, dict]]:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # A complete file ends with a newline, which leaves an empty last element.
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            truncated = number == len(lines)
            warnings.warn(f"{path}:{number}: skipping "
                          f"{'truncated last' if truncated else 'unparsable'} manifest line")
            continue
        if isinstance(entry, dict):
            yield number, entry


def read_manifest(path: str, run_id: Optional[str] = None) -> List[dict]:
    """Entries of one manifest file, or of every manifest in a directory (optionally of one
    run). Each entry gains `path`: the record file's path (None in stats mode)."""
    paths = manifest_files(path, run_id) if os.path.isdir(path) else [path]
    entries = []
    for manifest in paths:
        base = os.path.dirname(os.path.abspath(manifest))
        for _, entry in _parse_lines(manifest):
            for key in ("tensor_info", "quant_error"):
                if entry.get(key) is not None:
                    entry[key] = _decode(entry[key])
            file_name = entry.get("file")
            entry["path"] = os.path.join(base, file_name) if file_name else None
            entries.append(entry)
    return entries


def read_json(path: str) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        return _decode(json.load(f))


def read_runs(directory: str) -> List[dict]:
    """The run-{run_id}.json files of a capture directory, oldest first."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "run-*.json"))):
        try:
            runs.append(read_json(path))
        except (OSError, json.JSONDecodeError) as exc:
            warnings.warn(f"{path}: unreadable run file ({exc})")
    return runs


def read_summaries(directory: str, run_id: Optional[str] = None) -> List[dict]:
    """The per-rank summary files (present once a run has ended)."""
    pattern = f"summary-{run_id or '*'}-rank*.json"
    return [read_json(p) for p in sorted(glob.glob(os.path.join(directory, pattern)))]
