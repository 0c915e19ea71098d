"""The capture format (docs/capture-format.md) in one place: version, file names, record and
manifest schema, the JSON encoding of non-finite floats, and the readers of manifests and run
files. The writer, `load.py`, the analysis and the synthetic test captures all go through here.

Importing this module does not import torch (the drivers' progress polls use it).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from datetime import datetime
from typing import Callable, Iterator, List, Optional, Tuple

FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)

# The quantization scheme (`--quant-scheme`) is stored under the original system's name: the
# `quant_type` key of record metadata and run files, and the `{quant_type}` field of file names.
SCHEME_KEY = "quant_type"

# ---------------------------------------------------------------------------------------------
# File names
# ---------------------------------------------------------------------------------------------

RUN_GLOB = "run-*.json"
MANIFEST_GLOB = "manifest-*.jsonl"
SUMMARY_GLOB = "summary-*.json"
# A file being written is `.{name}.tmp` until it is complete and renamed to `name`.
TEMPORARY_GLOB = ".*.tmp"


def temporary_name(path: str) -> str:
    """`dir/.name.tmp`: the name a capture file has while it is being written."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
_MANIFEST_NAME = re.compile(r"^manifest-(?P<run>.+)-rank(?P<rank>\d+)\.jsonl$")
_EXPERT = re.compile(r"(?:^|\.)experts\.local_experts\.(\d+)\.([^.]+)$")
_SHARED = re.compile(r"(?:^|\.)shared_experts\.([^.]+)$")


def run_file(directory: str, run_id: str) -> str:
    return os.path.join(directory, f"run-{run_id}.json")


def manifest_file(directory: str, run_id: str, rank: int) -> str:
    return os.path.join(directory, f"manifest-{run_id}-rank{rank:05d}.jsonl")


def summary_file(directory: str, run_id: str, rank: int) -> str:
    return os.path.join(directory, f"summary-{run_id}-rank{rank:05d}.json")


def manifest_run_id(path: str) -> Optional[str]:
    """The run id in a manifest's file name, or None if it is not a manifest name."""
    match = _MANIFEST_NAME.match(os.path.basename(path))
    return match.group("run") if match else None


def summary_for_manifest(path: str) -> Optional[str]:
    """The summary file the run writes beside a manifest when it ends (same run and rank)."""
    match = _MANIFEST_NAME.match(os.path.basename(path))
    if match is None:
        return None
    return summary_file(os.path.dirname(path), match.group("run"), int(match.group("rank")))


def short_module_name(module_path: str, expert_offset: int = 0) -> str:
    """The module field of file names: the last element of the module path.

    Attention sites (`...core_attention.qk` / `.pv`) are named after the attention module;
    routed experts carry their global index (`expert3_linear_fc1`), shared experts a prefix.
    """
    path = module_path
    if path.endswith(".qk") or path.endswith(".pv"):
        path = path[:-3]
    match = _EXPERT.search(path)
    if match:
        return f"expert{int(match.group(1)) + expert_offset}_{match.group(2)}"
    match = _SHARED.search(path)
    if match:
        return f"shared_experts_{match.group(1)}"
    return path.rsplit(".", 1)[-1]


def record_name(layer_type: str, layer: int, operation: str, phase: str, component_tag: str,
                tensor_name: str, module: str) -> str:
    """The name --tensor-save-filter matches: the file name without run, counter, scheme,
    iteration, micro-batch and ranks, e.g. `linear_L2_forward_pre_linear_input_linear_fc1`."""
    return f"{layer_type}_L{layer}_{operation}_{phase}_{component_tag}_{tensor_name}_{module}"


def rank_suffix(world_size: int, tp: int, pp: int, dp: int) -> str:
    return f"_tp{tp}_pp{pp}_dp{dp}" if world_size > 1 else ""


def record_file_name(run_id: str, counter: int, metadata: dict, module: str) -> str:
    """`{run_id}_{counter:06d}_{layer_type}_L{layer}_..._it{i}_mb{m}[_tp_pp_dp].pt`."""
    m = metadata
    return (f"{run_id}_{counter:06d}_{m['layer_type']}_L{m['layer_idx']}_{m['operation']}_"
            f"{m['phase']}_{m['component']}_{m[SCHEME_KEY]}_{m['tensor_name']}_{module}_"
            f"it{m['iteration']}_mb{m['micro_batch']}"
            f"{rank_suffix(m['world_size'], m['tp_rank'], m['pp_rank'], m['dp_rank'])}.pt")


def record_path(directory: str, file_name: str) -> str:
    """The path of a manifest's `file`; only a plain file name inside `directory` is valid
    (a manifest must never make a reader open a file elsewhere)."""
    if (not isinstance(file_name, str) or not file_name or os.path.basename(file_name) != file_name
            or file_name in (".", "..") or "/" in file_name or "\\" in file_name):
        raise ValueError(f"record file {file_name!r} is not a file name inside the capture "
                         "directory")
    return os.path.join(directory, file_name)


def base_run_id(now: Optional[datetime] = None) -> str:
    return (now or datetime.now()).strftime("%Y%m%d_%H%M%S")


def claim_run_id(directory: str, base: str,
                 payload: Callable[[str], bytes] = lambda run_id: b"{}\n") -> str:
    """Reserve a run id unique in `directory`: `base`, else `base-2`, `base-3`, ...

    The reservation is the exclusive creation of `run-{id}.json`, so two runs starting in the
    same second never share an id. `payload(run_id)` is written into the claimed file.
    """
    os.makedirs(directory, exist_ok=True)
    suffix = 1
    while True:
        run_id = base if suffix == 1 else f"{base}-{suffix}"
        try:
            fd = os.open(run_file(directory, run_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            suffix += 1
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(payload(run_id))
        return run_id


# ---------------------------------------------------------------------------------------------
# Records and manifest lines
# ---------------------------------------------------------------------------------------------

# Manifest fields holding statistics, whose non-finite floats are written as strings.
STATS_FIELDS = ("tensor_info", "quant_error")
# Statistics a capture rule can choose (`stats:` of --tensor-save-config); the others of
# tensor_info describe the tensor and are always written.
TENSOR_METRICS = ("min", "max", "mean", "std", "absmax", "zero_fraction", "nan_count",
                  "inf_count")
ERROR_METRICS = ("mse", "sqnr_db", "relative_error", "flushed_fraction", "saturated_fraction",
                 "nonfinite_fraction", "scale_exponent_hist", "nan_blocks", "hifp8_regions",
                 "tensor_scale", "blocks", "block_scale_min", "block_scale_max",
                 "block_scale_hist", "block_scale_zero_fraction",
                 "block_scale_subnormal_fraction")
METRICS = TENSOR_METRICS + ERROR_METRICS
# Metadata floats that may be non-finite (an operand holding NaN / Inf): written as strings
# like the statistics, decoded by parse_manifest.
METADATA_FLOATS = ("tensor_amax",)


def record_dict(tensor, tensor_info: dict, metadata: dict, quantized=None,
                quant_error: Optional[dict] = None, scales=None) -> dict:
    """The dict saved in a record file (loaded with torch.load(..., weights_only=True)).
    `scales`: the float32 scales of an NVFP4 / FP8 operand (its E4M3 block scales, its
    per-tensor or per-tile FP8 scales)."""
    record = {"format_version": FORMAT_VERSION, "tensor": tensor, "tensor_info": tensor_info,
              "metadata": metadata}
    if quantized is not None:
        record["quantized"] = quantized
        record["quant_error"] = quant_error
        if scales is not None:
            record["scales"] = scales
    return record


def manifest_entry(file_name: Optional[str], nbytes: int, metadata: dict, tensor_info: dict,
                   quant_error: Optional[dict]) -> dict:
    """One manifest line: the record's file (None in stats mode) and everything but tensors."""
    return {"format_version": FORMAT_VERSION, "file": file_name, "bytes": nbytes,
            "metadata": metadata, "tensor_info": tensor_info, "quant_error": quant_error}


def keep_metrics(entry: dict, metrics) -> dict:
    """`entry` with only the chosen METRICS (and the always-written tensor description)."""
    keep = set(metrics)
    for key in STATS_FIELDS:
        stats = entry.get(key)
        if stats is not None:
            entry[key] = {k: v for k, v in stats.items() if k not in METRICS or k in keep}
    return entry


# ---------------------------------------------------------------------------------------------
# JSON: no NaN/Infinity tokens; non-finite floats are the strings "nan", "inf", "-inf"
# ---------------------------------------------------------------------------------------------

NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def encode_nonfinite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_nonfinite(v) for v in value]
    return value


def decode_nonfinite(value):
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: decode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_nonfinite(v) for v in value]
    return value


def json_line(obj) -> str:
    """One compact JSON line (with its newline), as manifests and run files are written."""
    return json.dumps(encode_nonfinite(obj), allow_nan=False, separators=(",", ":")) + "\n"


def json_text(obj) -> str:
    """Indented JSON (with its newline), as summary files are written."""
    return json.dumps(encode_nonfinite(obj), indent=1, allow_nan=False) + "\n"


def read_json(path: str) -> dict:
    """A run or summary file, non-finite strings decoded. Raises OSError / ValueError."""
    with open(path, "r", encoding="utf-8") as f:
        return decode_nonfinite(json.load(f))


# ---------------------------------------------------------------------------------------------
# Reading manifests
# ---------------------------------------------------------------------------------------------


def capture_files(directory: str, pattern: str) -> List[str]:
    """Sorted paths matching one of the *_GLOB patterns in a capture directory."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), pattern)))


def summary_files(directory: str, run_id: Optional[str] = None) -> List[str]:
    """Summary paths in a capture directory (of one run, or of every run), sorted."""
    run = glob.escape(run_id) if run_id is not None else "*"
    return capture_files(directory, f"summary-{run}-rank*.json")


def manifest_files(directory: str, run_id: Optional[str] = None) -> List[str]:
    """Manifest paths in a capture directory (one per rank and run), sorted."""
    return [path for path in capture_files(directory, MANIFEST_GLOB)
            if manifest_run_id(path) is not None and run_id in (None, manifest_run_id(path))]


def parse_manifest(path: str) -> Iterator[Tuple[int, Optional[dict], Optional[Tuple[str, str]]]]:
    """(line number, entry, problem) for each non-empty line of a manifest.

    An entry is the line's JSON object with its statistics decoded; a line that does not
    parse (the last line of a killed run) or is not an object gives entry None and a problem
    (kind, message) instead. Every entry that parses names a complete record.
    """
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # A complete file ends with a newline, which leaves an empty last element.
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError):   # damaged, or nested too deep
            where = "truncated last" if number == len(lines) else "unparsable"
            yield number, None, ("truncated_manifest_line",
                                 f"{path}:{number}: skipping {where} manifest line")
            continue
        if not isinstance(entry, dict):
            yield number, None, ("bad_manifest_line",
                                 f"{path}:{number}: not a JSON object, skipped")
            continue
        for key in STATS_FIELDS:
            if entry.get(key) is not None:
                entry[key] = decode_nonfinite(entry[key])
        metadata = entry.get("metadata")
        if isinstance(metadata, dict):
            for key in METADATA_FLOATS:
                if isinstance(metadata.get(key), str):
                    metadata[key] = decode_nonfinite(metadata[key])
        yield number, entry, None


def count_complete(path: str) -> Tuple[int, int]:
    """(records, bytes) of the manifest lines that parse (a line being written does not)."""
    records = nbytes = 0
    for _, entry, _ in parse_manifest(path):
        if entry is None:
            continue
        records += 1
        value = entry.get("bytes")
        nbytes += value if isinstance(value, int) and not isinstance(value, bool) else 0
    return records, nbytes
