"""Reading captures safely: records with weights_only=True, manifests line by line.

    from megatron.tensor_capture.load import read_manifest, load_record
    for entry in read_manifest("enhanced_tensor_logs/FA_linear_mxfp8"):
        record = load_record(entry["path"])   # full mode only (entry["file"] is None in stats mode)

A manifest line that does not parse (a run killed while appending it) is skipped with a
warning; every line that parses refers to a complete file. The format itself (names, schema,
encoding) is format.py's.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import List, Optional

import torch

from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.format import manifest_files, read_json  # noqa: F401 (API)


class RecordError(ValueError):
    """A record file that cannot be read as a capture record (damaged, or not a record)."""


class RecordRefused(RecordError):
    """A file that holds objects other than tensors and plain data: it was not unpickled."""


def load_record(path: str, map_location="cpu") -> dict:
    """A record file as its dict (format_version, tensor, tensor_info, metadata, ...),
    loaded with weights_only=True: no code is unpickled. A file that is missing raises
    OSError; one that is damaged or holds anything but tensors and plain data, RecordError."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # Not torch's advice to retry with weights_only=False: that would run the file's code.
        raise RecordRefused(f"{path}: not a valid capture record (refused to unpickle: it "
                            "holds objects other than tensors and plain data)") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecordError(f"{path}: unreadable record ({reason}); the file is truncated or "
                          "damaged") from None


def read_manifest(path: str, run_id: Optional[str] = None) -> List[dict]:
    """Entries of one manifest file, or of every manifest in a directory (optionally of one
    run). Each entry gains `path`: the record file's path (None in stats mode)."""
    paths = manifest_files(path, run_id) if os.path.isdir(path) else [path]
    entries = []
    for manifest in paths:
        base = os.path.dirname(os.path.abspath(manifest))
        for _, entry, problem in capture_format.parse_manifest(manifest):
            if problem is not None:
                warnings.warn(problem[1])
                continue
            file_name = entry.get("file")
            try:
                entry["path"] = capture_format.record_path(base, file_name) if file_name else None
            except ValueError as exc:
                warnings.warn(f"{manifest}: {exc}; entry skipped")
                continue
            entries.append(entry)
    return entries


def read_runs(directory: str) -> List[dict]:
    """The run-{run_id}.json files of a capture directory, oldest first."""
    runs = []
    for path in capture_format.capture_files(directory, capture_format.RUN_GLOB):
        try:
            runs.append(read_json(path))
        except (OSError, json.JSONDecodeError) as exc:
            warnings.warn(f"{path}: unreadable run file ({exc})")
    return runs


def read_summaries(directory: str, run_id: Optional[str] = None) -> List[dict]:
    """The per-rank summary files (present once a run has ended)."""
    return [read_json(p) for p in capture_format.summary_files(directory, run_id)]
