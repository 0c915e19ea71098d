"""statistics.txt: the headline numbers of statistics.json as aligned plain-text tables."""

from __future__ import annotations

import math
from typing import List, Sequence

from megatron.analysis.statistics import OUTPUT_SCHEME_KEY, OUTPUT_SCHEMES_KEY


def _fmt(value, kind: str = "g") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if kind == "pct":
        return f"{100.0 * value:.4g}%"
    if kind == "db":
        return f"{value:.2f}"
    if kind == "int":
        return f"{int(value):,}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(headers: Sequence[str], rows: List[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, with a rule under the header."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] +
                     [line(r) for r in rows])


def render(doc: dict) -> str:
    out = [f"Tensor analysis (statistics schema {doc['schema_version']}), generated "
           f"{doc['generated_at']}"]
    inputs = doc.get("inputs") or {}
    if inputs.get("tensor_dirs"):
        out.append("Captures: " + ", ".join(inputs["tensor_dirs"]))
    out.append("")
    schemes = doc.get(OUTPUT_SCHEMES_KEY) or {}
    if schemes:
        rows = []
        for scheme, sec in schemes.items():
            cap, overall = sec["capture"], sec["overall"] or {}
            rows.append([scheme, _fmt(cap["manifest_records"], "int"),
                         _fmt(overall.get("records_with_tensors"), "int"),
                         _fmt(overall.get("elements"), "int"), _fmt(overall.get("absmax")),
                         _fmt(overall.get("kurtosis")),
                         _fmt((sec.get("quantized") or {}).get("records"), "int")])
        out += ["== Captures ==", table(["quant type", "records", "with tensors", "elements",
                                         "absmax", "kurtosis", "quantized records"], rows), ""]
    comp = doc.get("format_comparison") or []
    if comp:
        rows = [[r[OUTPUT_SCHEME_KEY], r["format"], r["operation"], _fmt(r["records"], "int"),
                 _fmt(r["sqnr_db"], "db"), _fmt(r["mse"]), _fmt(r["relative_error"]),
                 _fmt(r["saturated_fraction"], "pct"), _fmt(r["flushed_fraction"], "pct"),
                 _fmt(r["nonfinite_fraction"], "pct")] for r in comp]
        out += ["== Quantization error by format (quantized operands) ==",
                table(["quant type", "format", "operation", "records", "SQNR dB", "MSE",
                       "rel. error", "saturated", "flushed", "non-finite"], rows), ""]
    for scheme, sec in schemes.items():
        rows = []
        for name, m in (sec.get("by_tensor") or {}).items():
            q = m.get("quantization") or {}
            scale = (q.get("scale_exponent") or {})
            rows.append([name, _fmt(m["records"], "int"), _fmt(m["absmax"]), _fmt(m["std"]),
                         _fmt(m["dynamic_range_binades"]), _fmt(q.get("sqnr_db"), "db"),
                         _fmt(q.get("saturated_fraction"), "pct"),
                         _fmt(q.get("flushed_fraction"), "pct"),
                         f"{scale['min']}..{scale['max']}" if scale else "-"])
        if rows:
            out += [f"== {scheme}: per tensor ==",
                    table(["tensor", "records", "absmax", "std", "range (binades)", "SQNR dB",
                           "saturated", "flushed", "E8M0 exps"], rows), ""]
    region_rows = []
    for scheme, sec in schemes.items():
        for cls, m in (sec.get("by_tensor_class") or {}).items():
            regions = m.get("hifp8_regions")
            if regions:
                region_rows.append([scheme, cls] + [_fmt(regions[k], "pct") for k in
                                                ("underflow", "denormal", "mant1", "mant2",
                                                 "mant3", "overflow")])
    if region_rows:
        out += ["== HiF8 precision regions (share of finite nonzero values, unscaled) ==",
                table(["quant type", "tensors", "underflow", "denormal", "1-bit mant",
                       "2-bit mant", "3-bit mant", "overflow"], region_rows), ""]
    losses = doc.get("losses") or {}
    if losses.get("table"):
        rows = [[r["run"], _fmt(r["final_iteration"], "int"), _fmt(r["final_loss"]),
                 _fmt(r["gap_to_baseline"]), _fmt(r["relative_gap_to_baseline"], "pct"),
                 _fmt(r["final_validation_loss"]), _fmt(r["validation_gap_to_baseline"])]
                for r in losses["table"]]
        out += [f"== Final loss (baseline {losses.get('baseline')}) ==",
                table(["run", "iteration", "final loss", "gap", "rel. gap", "val loss",
                       "val gap"], rows), ""]
    cons = doc.get("consistency") or {}
    if cons:
        out += ["== Capture self-consistency ==",
                f"records whose recomputed error metrics were compared with the writer's: "
                f"{cons.get('records_checked', 0)}, disagreeing: "
                f"{cons.get('records_mismatched', 0)}", ""]
    problems = doc.get("problems") or []
    out.append(f"== Problems ({len(problems)}) ==")
    out += [f"- [{p['kind']}] {p['message']}" for p in problems] or ["none"]
    return "\n".join(out) + "\n"
