"""Aggregation of per-group `Stats` into the statistics.json document; writers of
statistics.json and records.csv.

The schema is documented in docs/analysis.md; `SCHEMA_VERSION` changes whenever a field
changes meaning or disappears. Non-finite floats are written as the strings "inf", "-inf" and
"nan" (as in capture manifests) so the file is strict JSON.
"""

from __future__ import annotations

import csv
import json
import math
from collections import OrderedDict
from datetime import datetime
from typing import Callable, Dict, List, Optional

import numpy as np

from megatron.analysis import naming
from megatron.analysis.accumulators import Stats, sqnr_db
from megatron.analysis.binning import E_MAX, E_MIN, NBINS, SUB, bin_edges_log2
from megatron.analysis.comparison import common_tensors, comparison_section
from megatron.analysis.hifp8 import scheme_scalings
from megatron.analysis.loading import INCOMPLETE_RUN
from megatron.analysis.ranges import describe, format_ranges, scale_description
from megatron.analysis.workers import KEY_FIELDS, GroupKey

SCHEMA_VERSION = 2
OPERATIONS = ("forward", "backward")
GEMMS = ("fprop", "dgrad", "wgrad")

# Inside the analysis the quantization scheme (`--quant-scheme`) is `quant_scheme`. The outputs
# (statistics.json, records.csv, and statistics.txt and report.html, rendered from
# statistics.json) keep the original system's name for it, `quant_type`, which users and
# scripts already read (table headings, captions and messages say "quant type"). These are the
# output names; the internal name is mapped to them only where a document or file is written.
OUTPUT_SCHEME_KEY = "quant_type"          # groups, format_comparison, histograms, records.csv
OUTPUT_SCHEMES_KEY = "quant_types"        # the per-scheme sections
OUTPUT_REQUESTED_KEY = "quant_types_requested"     # inputs: the schemes asked for
SCHEME_WITHOUT_DATA = "quant_type_without_data"    # problem kind: a requested scheme has none


def output_field(name: str) -> str:
    """The output name of a group field or records.csv column."""
    return OUTPUT_SCHEME_KEY if name == "quant_scheme" else name


OUTPUT_KEY_FIELDS = tuple(output_field(name) for name in KEY_FIELDS)


def merge_by(groups: Dict[GroupKey, Stats], project: Callable[[GroupKey], object],
             where: Callable[[GroupKey], bool] = lambda k: True) -> "OrderedDict[object, Stats]":
    """Merged Stats per value of `project(key)` over the groups selected by `where`."""
    out: Dict[object, Stats] = {}
    for key, stats in groups.items():
        if not where(key):
            continue
        label = project(key)
        if label not in out:
            out[label] = Stats()
        out[label].merge(stats)
    return OrderedDict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(label):
    if isinstance(label, tuple):
        return tuple(_sort_key(x) for x in label)
    return (0, label, "") if isinstance(label, (int, float)) else (1, 0, str(label))


def tensor_class(tensor_name: str) -> str:
    """activation | weight | gradient, from the capture tensor name."""
    if tensor_name.startswith("grad"):
        return "gradient"
    if tensor_name.startswith("weight"):
        return "weight"
    return "activation"


def quant_schemes_of(groups: Dict[GroupKey, Stats]) -> List[str]:
    return sorted({k.quant_scheme for k in groups})


def _metrics_map(merged) -> Dict[str, dict]:
    return {str(label): stats.metrics() for label, stats in merged.items()}


def _is_quantized(key: GroupKey) -> bool:
    return key.format != "none"


def quant_scheme_section(groups: Dict[GroupKey, Stats], quant_scheme: str) -> dict:
    """Aggregates of one scheme at the levels researchers compare."""
    mine = {k: v for k, v in groups.items() if k.quant_scheme == quant_scheme}
    overall = merge_by(mine, lambda k: "all")
    section = {
        "overall": overall["all"].metrics() if overall else None,
        "quantized": None,
        "by_format": _metrics_map(merge_by(mine, lambda k: k.format)),
        "by_operation": _metrics_map(merge_by(mine, lambda k: k.operation)),
        "by_tensor_class": _metrics_map(merge_by(mine, lambda k: tensor_class(k.tensor_name))),
        "by_tensor": _metrics_map(merge_by(mine, lambda k: k.tensor_name)),
        "by_layer": _metrics_map(merge_by(mine, lambda k: k.layer)),
        "quantized_by_gemm": _metrics_map(merge_by(mine, lambda k: k.gemm, _is_quantized)),
        "quantized_by_operation": _metrics_map(merge_by(mine, lambda k: k.operation,
                                                         _is_quantized)),
    }
    q_all = merge_by(mine, lambda k: "all", _is_quantized)
    if q_all:
        section["quantized"] = q_all["all"].metrics()
    section["quantized_sites"] = quantized_sites(mine)
    section["quantized_layers"] = quantized_layers(mine)
    return section


def site_label(layer: int, module: str, tensor_name: str) -> str:
    """A quantized operand's site as the report names it: `L2.linear_fc1 grad_output`
    (`output_layer input` for the output layer, whose layer number 0 must not read as the
    first transformer layer)."""
    if layer == naming.OUTPUT_LAYER:
        return f"{module} {tensor_name}"
    return f"{naming.layer_label(layer)}.{module} {tensor_name}"


def _site(key: GroupKey) -> tuple:
    return key.layer, key.module, key.tensor_name


def _site_rows(groups: Dict[GroupKey, Stats]) -> List[dict]:
    """The quantized operands of `groups` per site (layer, module, tensor name; every captured
    iteration, micro-batch and rank together) with their formats, SQNR and shares."""
    merged = merge_by(groups, _site, _is_quantized)
    formats: Dict[tuple, set] = {}
    for key in filter(_is_quantized, groups):
        formats.setdefault(_site(key), set()).add(key.format)
    rows = []
    for (layer, module, name), stats in merged.items():
        value = sqnr_db(stats.x2, stats.e2) if stats.quantized else None
        if value is None or math.isnan(value):
            continue
        quant = stats.metrics()["quantization"] or {}
        rows.append({"site": site_label(layer, module, name), "layer": layer, "module": module,
                     "tensor_name": name,
                     "format": ", ".join(sorted(formats[(layer, module, name)])),
                     "sqnr_db": value,
                     "relative_error": math.sqrt(stats.e2 / stats.x2) if stats.x2 > 0 else None,
                     "saturated_fraction": quant.get("saturated_fraction"),
                     "flushed_fraction": quant.get("flushed_fraction")})
    return rows


def _largest(rows: List[dict], key: str) -> Optional[dict]:
    """The row with the largest nonzero `key` (None when no row has one)."""
    found = [r for r in rows if r.get(key)]
    return dict(max(found, key=lambda r: r[key])) if found else None


def quantized_sites(groups: Dict[GroupKey, Stats]) -> Optional[dict]:
    """The quantized operands of `groups` per site: how many have an SQNR, its median over
    them, the worst site (the lowest SQNR, i.e. the highest relative error sqrt(e2 / x2)) and
    the sites with the largest saturated and flushed shares (null when none has any)."""
    sites = _site_rows(groups)
    if not sites:
        return None
    return {"sites": len(sites),
            "median_sqnr_db": float(np.median([s["sqnr_db"] for s in sites])),
            "worst": dict(min(sites, key=lambda site: site["sqnr_db"])),
            "most_saturated": _largest(sites, "saturated_fraction"),
            "most_flushed": _largest(sites, "flushed_fraction")}


def quantized_layers(groups: Dict[GroupKey, Stats]) -> List[dict]:
    """Per layer (transformer layers in order, the output layer last), the SQNR pooled over
    its quantized operands and its worst operand: the per-layer picture of one scheme."""
    by_layer: Dict[int, List[dict]] = {}
    for site in _site_rows(groups):
        by_layer.setdefault(site["layer"], []).append(site)
    pooled = merge_by(groups, lambda k: k.layer, _is_quantized)
    rows = []
    for layer in sorted(by_layer, key=naming.layer_order):
        stats = pooled[layer]
        rows.append({"layer": layer, "label": naming.layer_label(layer),
                     "sqnr_db": sqnr_db(stats.x2, stats.e2) if stats.quantized else None,
                     "worst": min(by_layer[layer], key=lambda site: site["sqnr_db"])})
    return rows


def histogram_entries(groups: Dict[GroupKey, Stats]) -> List[dict]:
    """Compact |x|, |q| and MX-scaled histograms per (scheme, format, operation)."""
    edges = bin_edges_log2()
    out = []
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.format, k.operation))
    for (scheme, fmt, op), stats in merged.items():
        for kind, hist in (("abs", stats.hist), ("quantized_abs", stats.q_hist),
                           ("mx_scaled_abs", stats.scaled_hist)):
            if hist is None or not hist.any():
                continue
            nz = np.flatnonzero(hist)
            lo, hi = int(nz[0]), int(nz[-1]) + 1
            out.append({OUTPUT_SCHEME_KEY: scheme, "format": fmt, "operation": op, "kind": kind,
                        "first_bin": lo, "first_edge_log2": float(edges[lo]),
                        "counts": [int(c) for c in hist[lo:hi]]})
    return out


def consistency_section(rows: List[dict]) -> dict:
    # Quantized records summarised from their tensors, whose manifest carried quant_error.
    checked = [r for r in rows if r.get("from_tensors") and r.get("mse") is not None]
    bad = [r for r in rows if r.get("writer_mismatch")]
    return {
        "records_checked": len(checked),
        "records_mismatched": len(bad),
        "examples": [{"file": r.get("file"), "fields": r["writer_mismatch"]} for r in bad[:10]],
    }


def build(result, captures, problems, inputs: dict, losses: Optional[dict] = None,
          figures: Optional[List[dict]] = None, timing: Optional[dict] = None,
          provenance: Optional[dict] = None, telemetry: Optional[dict] = None,
          outputs: Optional[List[str]] = None, common=None) -> dict:
    """The statistics.json document (see docs/analysis.md)."""
    groups = result.groups
    schemes = quant_schemes_of(groups)
    formats = sorted({k.format for k in groups})
    common = common or common_tensors(groups)
    doc = OrderedDict()
    doc["schema_version"] = SCHEMA_VERSION
    doc["generated_at"] = datetime.now().isoformat(timespec="seconds")
    doc["inputs"] = inputs
    doc["provenance"] = provenance
    doc["outputs"] = outputs or []
    doc["histogram_layout"] = {
        "bins_per_binade": SUB, "e_min": E_MIN, "e_max": E_MAX, "bins": NBINS,
        "bin": "bin i = (E - e_min) * 4 + k holds |x| in [2^E (1 + k/4), 2^E (1 + (k+1)/4))",
    }
    doc["formats"] = {f: _format_dict(f) for f in formats}
    doc["hifp8_scaling"] = scheme_scalings(groups)
    doc[OUTPUT_SCHEMES_KEY] = OrderedDict()
    for scheme in schemes:
        section = OrderedDict()
        section["capture"] = _capture_summary(scheme, captures, result)
        section.update(quant_scheme_section(groups, scheme))
        doc[OUTPUT_SCHEMES_KEY][scheme] = section
    doc["comparison"] = comparison_section(groups, common)
    shared = common.all_schemes(groups)
    doc["comparison"]["by_tensor_class"] = {
        scheme: _metrics_map(merge_by(shared, lambda k: tensor_class(k.tensor_name),
                                      lambda k, s=scheme: k.quant_scheme == s))
        for scheme in common.schemes}
    doc["format_comparison"] = format_comparison(common.quantized_operands(groups))
    doc["format_comparison_all"] = format_comparison(groups)
    doc["scales"] = scale_section(groups)
    doc["groups"] = [dict(zip(OUTPUT_KEY_FIELDS, key), metrics=stats.metrics())
                     for key, stats in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))]
    doc["histograms"] = histogram_entries(groups)
    doc["losses"] = losses
    doc["telemetry"] = telemetry
    doc["consistency"] = consistency_section(result.rows)
    doc["problems"] = list(problems.items)
    doc["figures"] = figures or []
    doc["timing"] = timing or {}
    return doc


def format_comparison(groups: Dict[GroupKey, Stats]) -> List[dict]:
    """One row per (scheme, format, operation) of the quantized operands among `groups`."""
    rows = []
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.format, k.operation),
                      lambda k: k.format != "none")
    for (scheme, fmt, op), stats in merged.items():
        m = stats.metrics()
        q = m["quantization"] or {}
        rows.append({OUTPUT_SCHEME_KEY: scheme, "format": fmt, "operation": op,
                     "records": m["records"], "elements": m["elements"],
                     "sqnr_db": q.get("sqnr_db"), "mse": q.get("mse"),
                     "relative_error": q.get("relative_error"),
                     "saturated_fraction": q.get("saturated_fraction"),
                     "flushed_fraction": q.get("flushed_fraction"),
                     "nonfinite_fraction": q.get("nonfinite_fraction")})
    return rows


def _format_dict(name: str) -> dict:
    r = format_ranges(name)
    return {"kind": r.kind, "block_size": r.block_size, "emax_elem": r.emax_elem,
            "max_normal": r.max_normal, "min_normal": r.min_normal,
            "min_subnormal": r.min_subnormal, "mantissa_bits": r.mantissa_bits,
            "scale": scale_description(name), "description": describe(name)}


def scale_section(groups: Dict[GroupKey, Stats]) -> List[dict]:
    """One row per (scheme, format, tensor class, operation) of the NVFP4 and FP8 operands:
    their scales (docs/analysis.md, "scales")."""
    rows = []
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.format, tensor_class(k.tensor_name),
                                         k.operation),
                      lambda k: format_ranges(k.format).kind in ("nvfp4", "fp8"))
    for (scheme, fmt, cls, op), stats in merged.items():
        q = stats.metrics()["quantization"] or {}
        if not q.get("scales"):
            continue
        rows.append({OUTPUT_SCHEME_KEY: scheme, "format": fmt, "tensor_class": cls,
                     "operation": op, "records": q["records"],
                     "saturated_fraction": q.get("saturated_fraction"), **q["scales"],
                     "nvfp4_block_scales": q.get("nvfp4_block_scales")})
    return rows


def _capture_summary(quant_scheme: str, captures, result) -> dict:
    mine = [c for c in captures if c.quant_scheme == quant_scheme]
    runs = []
    for capture in mine:
        for run in capture.runs:
            runs.append({k: run.get(k) for k in ("run_id", "mode", "control_iter",
                                                  "collect_micro_batches", "world_size",
                                                  "start_time", "quant_config")})
    summaries = [s for c in mine for s in c.summaries]
    reasons = [reason for c in mine for reason in c.incomplete]
    return {
        "directories": [c.directory for c in mine],
        "status": INCOMPLETE_RUN if reasons else "complete",
        "incomplete_reasons": reasons,
        "runs": runs,
        "manifest_records": sum(len(c.entries) for c in mine),
        "analysed_records": sum(1 for r in result.rows if r["quant_scheme"] == quant_scheme),
        "writer_summaries": {
            "ranks": len(summaries),
            "records": sum(int(s.get("records") or 0) for s in summaries),
            "bytes": sum(int(s.get("bytes") or 0) for s in summaries),
            "dropped": sum(int(s.get("dropped") or 0) for s in summaries),
            "stall_seconds": sum(float(s.get("stall_seconds") or 0.0) for s in summaries),
            "errors": [s["error"] for s in summaries if s.get("error")],
        },
    }


# -- serialisation ----------------------------------------------------------------------------

def json_safe(value):
    """Non-finite floats as strings, numpy scalars as Python numbers, tuples as lists."""
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=1, allow_nan=False)
        f.write("\n")


def write_records_csv(path: str, rows: List[dict]) -> None:
    """records.csv: one line per record row (workers' `_row`), columns in the rows' key order
    under their output names."""
    if not rows:
        return
    fields = list(rows[0].keys())
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([output_field(name) for name in fields])
        for row in sorted(rows, key=lambda r: (r["quant_scheme"], r.get("file") or "")):
            writer.writerow([row.get(name) for name in fields])


def load_json(path: str) -> dict:
    """statistics.json with the non-finite strings turned back into floats."""
    with open(path, "r", encoding="utf-8") as f:
        doc = json.load(f)
    return _restore(doc)


def _restore(value):
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {k: _restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return value
