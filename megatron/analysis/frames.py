"""Captures as a pandas DataFrame for notebooks: one row per manifest record.

    from megatron.analysis import load_frame, load_tensors
    frame = load_frame("enhanced_tensor_logs", schemes=["FA_linear_mxfp8"])
    worst = frame[frame.format != "none"].nsmallest(5, "sqnr_db")
    for record in load_tensors(worst):
        hp, q = record["hp"], record["quantized"]

Rows come from the manifests alone (no record file is opened), through the same reader and
checks as the report: malformed lines are skipped and listed in `frame.attrs["problems"]`.
The error statistics are those the capture wrote (`quant_error`); `load_tensors` reads the
record files of chosen rows with torch.load(weights_only=True) and `requantize` rebuilds a
row's quantized tensor from its high-precision one (megatron.tensor_capture.replay).
"""

from __future__ import annotations

import os
from typing import Iterable, List, Optional

from megatron.analysis.loading import Entry, Problems, UnreadableRecord, check_record, \
    load_record, read_captures
from megatron.analysis.workers import short_module

FRAME_COLUMNS = (
    "scheme", "iteration", "micro_batch", "layer", "module", "module_path", "tensor_name",
    "operation", "phase", "component", "gemm", "operand", "format", "scale_mode", "axis",
    "hifp8_scaling", "hifp8_scale_exponent", "stochastic_seed", "tensor_amax", "fp8_scaling",
    "block_2d", "rht_block", "tensor_shape", "tensor_dtype", "numel", "absmax",
    "tensor_std", "mse", "sqnr_db", "relative_error", "flushed_fraction", "saturated_fraction",
    "nonfinite_fraction", "tensor_scale", "block_scale_zero_fraction",
    "block_scale_subnormal_fraction", "global_rank", "bytes", "path",
)
# (shape, dtype, std and rank would shadow DataFrame / Series attributes: `row.shape` must not
# silently be the row's own shape.)
_ERRORS = ("mse", "sqnr_db", "relative_error", "flushed_fraction", "saturated_fraction",
           "nonfinite_fraction")


def _row(entry: Entry) -> tuple:
    m, info, err = entry.metadata, entry.tensor_info, entry.quant_error or {}
    quantized = m["format"] != "none"
    scaling = m.get("hifp8_scaling", "none") if m["format"] == "hifp8" else None
    values = {
        "scheme": entry.quant_scheme, "iteration": m["iteration"],
        "micro_batch": m["micro_batch"], "layer": m["layer_idx"],
        "module": short_module(m["module"]), "module_path": m["module"],
        "tensor_name": m["tensor_name"], "operation": m["operation"], "phase": m["phase"],
        "component": m["component"], "gemm": m["gemm"], "operand": m["operand"],
        "format": m["format"], "scale_mode": m.get("scale_mode") if quantized else None,
        "axis": m.get("axis"), "hifp8_scaling": scaling,
        "hifp8_scale_exponent": m.get("hifp8_scale_exponent") if scaling == "tensor" else None,
        "stochastic_seed": m.get("stochastic_seed"), "tensor_amax": m.get("tensor_amax"),
        "fp8_scaling": m.get("fp8_scaling"),
        "block_2d": bool(m.get("block_2d", False)) if quantized else None,
        "rht_block": m.get("rht_block"),
        "tensor_scale": err.get("tensor_scale") if quantized else None,
        "block_scale_zero_fraction": err.get("block_scale_zero_fraction") if quantized else None,
        "block_scale_subnormal_fraction":
            err.get("block_scale_subnormal_fraction") if quantized else None,
        "tensor_shape": tuple(info["shape"]), "tensor_dtype": info["dtype"],
        "numel": info["numel"], "absmax": info.get("absmax"), "tensor_std": info.get("std"),
        "global_rank": m.get("rank", 0),
        "bytes": entry.bytes, "path": entry.path,
    }
    values.update({name: err.get(name) if quantized else None for name in _ERRORS})
    return tuple(values[column] for column in FRAME_COLUMNS)


def load_frame(tensor_dir, schemes: Optional[Iterable[str]] = None,
               iterations: Optional[Iterable[int]] = None,
               layers: Optional[Iterable[int]] = None):
    """One row per manifest record of the captures under `tensor_dir` (a --tensor-save-dir,
    a scheme directory, or a list of either); optionally only these schemes, captured
    iterations and layers (0 = output layer). Columns: FRAME_COLUMNS; `path` is None for
    records captured in stats mode. Problems met while reading are in
    `frame.attrs["problems"]` (dicts with `kind` and `message`)."""
    import pandas as pd

    dirs = [os.fspath(tensor_dir)] if isinstance(tensor_dir, (str, os.PathLike)) else \
        [os.fspath(d) for d in tensor_dir]
    wanted = {name: None if values is None else set(values)
              for name, values in (("scheme", schemes), ("iteration", iterations),
                                   ("layer", layers))}
    problems = Problems()
    rows = []
    for capture in read_captures(dirs, problems):
        for entry in capture.entries:
            row = _row(entry)
            keep = all(allowed is None or row[FRAME_COLUMNS.index(name)] in allowed or
                       (name == "scheme" and entry.quant_scheme.split("@")[0] in allowed)
                       for name, allowed in wanted.items())
            if keep:
                rows.append(row)
    frame = pd.DataFrame.from_records(rows, columns=list(FRAME_COLUMNS))
    for column in ("axis", "hifp8_scale_exponent", "stochastic_seed", "rht_block"):
        # From the Python ints themselves: a 63-bit seed does not survive a float64 column.
        index = FRAME_COLUMNS.index(column)
        frame[column] = pd.array([row[index] for row in rows], dtype="Int64")
    for column in ("absmax", "tensor_std", "tensor_amax", "tensor_scale",
                   "block_scale_zero_fraction", "block_scale_subnormal_fraction") + _ERRORS:
        frame[column] = frame[column].astype("float64")
    frame.attrs["problems"] = list(problems.items)
    return frame


def _rows(rows) -> List[dict]:
    """Rows of a DataFrame, a single row (Series) or an iterable of mappings, as dicts."""
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
        return rows.to_dict("records")
    if hasattr(rows, "to_dict"):
        return [rows.to_dict()]
    return [dict(row) for row in rows]


def load_tensors(rows) -> List[dict]:
    """The tensors of chosen `load_frame` rows (a DataFrame, one row, or a list of rows):
    per row a dict with `hp` (the high-precision tensor), `quantized` (its quantized copy, or
    None for an unquantized record), `metadata` and `path`. Files load with
    weights_only=True; a row without a file (stats mode) or a file that is not a valid record
    raises ValueError naming it."""
    out = []
    for row in _rows(rows):
        path = row.get("path")
        if not isinstance(path, str):
            raise ValueError(f"row of {row.get('scheme')} {row.get('tensor_name')} (iteration "
                             f"{row.get('iteration')}) has no record file: the capture was "
                             "written in stats mode")
        record = load_record(path, os.path.dirname(path))
        metadata = record.get("metadata") if isinstance(record, dict) else None
        why = check_record(record, path, {"format": row.get("format", "none")})
        if why is not None:
            raise UnreadableRecord(why)
        out.append({"hp": record["tensor"], "quantized": record.get("quantized"),
                    "metadata": metadata if isinstance(metadata, dict) else {},
                    "path": path})
    return out
