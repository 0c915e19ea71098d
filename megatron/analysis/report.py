"""report.html: one self-contained page (PNGs embedded as base64) with tables and captions."""

from __future__ import annotations

import base64
import html
import math
import os
from typing import List, Sequence

from megatron.analysis.statistics import OUTPUT_SCHEME_KEY, OUTPUT_SCHEMES_KEY

_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; color: #212529; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #dee2e6; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: .88em; }
th, td { border: 1px solid #dee2e6; padding: .25em .6em; text-align: right; }
th { background: #f1f3f5; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1.2em 0 2em; } figure img { max-width: 100%; border: 1px solid #e9ecef; }
figcaption { font-size: .9em; color: #495057; margin-top: .4em; }
.problems li { color: #9c2f00; } .muted { color: #6c757d; font-size: .9em; }
nav a { margin-right: 1em; }
"""


def _fmt(value, kind: str = "g") -> str:
    if value is None:
        return "&ndash;"
    if isinstance(value, str):
        return html.escape(value)
    if isinstance(value, float) and math.isinf(value):
        return "&infin;" if value > 0 else "&minus;&infin;"
    if kind == "pct":
        return f"{100.0 * value:.3g}%"
    if kind == "db":
        return f"{value:.2f}"
    if kind == "int":
        return f"{int(value):,}"
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def _table(headers: Sequence[str], rows: List[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(outdir: str, fig: dict) -> str:
    path = os.path.join(outdir, "figures", fig["file"])
    try:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
    except OSError:
        return f"<p class='problems'>figure {html.escape(fig['file'])} is missing</p>"
    anchor = html.escape(os.path.splitext(fig["file"])[0])
    return (f"<figure id='{anchor}'><h3>{html.escape(fig['title'])}</h3>"
            f"<img alt='{html.escape(fig['title'])}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(fig['caption'])}</figcaption></figure>")


def render(doc: dict, outdir: str) -> str:
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
             f"<title>Tensor analysis report</title><style>{_CSS}</style></head><body>",
             "<h1>Low-precision tensor analysis</h1>",
             f"<p class='muted'>Generated {html.escape(doc['generated_at'])}; statistics schema "
             f"{doc['schema_version']}. Machine-readable numbers: statistics.json; "
             f"plain text: statistics.txt; one row per record: records.csv.</p>"]
    inputs = doc.get("inputs") or {}
    if inputs.get("tensor_dirs"):
        parts.append("<p>Captures: " + ", ".join(
            f"<code>{html.escape(d)}</code>" for d in inputs["tensor_dirs"]) + "</p>")
    parts.append("<nav>" + "".join(
        f"<a href='#{html.escape(os.path.splitext(f['file'])[0])}'>{html.escape(f['title'])}</a>"
        for f in doc.get("figures") or []) + "</nav>")
    problems = doc.get("problems") or []
    if problems:
        parts.append(f"<h2>Problems with the input ({len(problems)})</h2><ul class='problems'>"
                     + "".join(f"<li>{html.escape(p['message'])}</li>" for p in problems[:50])
                     + ("<li>... see statistics.json</li>" if len(problems) > 50 else "")
                     + "</ul>")
    schemes = doc.get(OUTPUT_SCHEMES_KEY) or {}
    if schemes:
        rows = []
        for scheme, sec in schemes.items():
            cap, overall = sec["capture"], sec["overall"] or {}
            quant = (sec.get("quantized") or {}).get("quantization") or {}
            rows.append([html.escape(scheme), _fmt(cap["manifest_records"], "int"),
                         _fmt(overall.get("records_with_tensors"), "int"),
                         _fmt(overall.get("elements"), "int"), _fmt(overall.get("absmax")),
                         _fmt(quant.get("sqnr_db"), "db"),
                         _fmt(quant.get("saturated_fraction"), "pct"),
                         _fmt(quant.get("flushed_fraction"), "pct")])
        parts += ["<h2>Captures</h2>",
                  _table(["quant type", "records", "with tensors", "elements", "max |x|",
                          "SQNR dB (quantized)", "saturated", "flushed"], rows)]
    comp = doc.get("format_comparison") or []
    if comp:
        rows = [[html.escape(r[OUTPUT_SCHEME_KEY]), html.escape(r["format"]),
                 html.escape(r["operation"]), _fmt(r["records"], "int"),
                 _fmt(r["sqnr_db"], "db"), _fmt(r["mse"]), _fmt(r["relative_error"]),
                 _fmt(r["saturated_fraction"], "pct"), _fmt(r["flushed_fraction"], "pct"),
                 _fmt(r["nonfinite_fraction"], "pct")] for r in comp]
        parts += ["<h2>Quantization error by format</h2>",
                  _table(["quant type", "format", "operation", "records", "SQNR dB", "MSE",
                          "rel. error", "saturated", "flushed", "non-finite"], rows)]
    losses = doc.get("losses") or {}
    if losses.get("table"):
        rows = [[html.escape(r["run"]), _fmt(r["final_iteration"], "int"),
                 _fmt(r["final_loss"]), _fmt(r["last_window_mean_loss"]),
                 _fmt(r["compared_at_iteration"], "int"), _fmt(r["gap_to_baseline"]),
                 _fmt(r["relative_gap_to_baseline"], "pct"), _fmt(r["final_validation_loss"]),
                 _fmt(r["validation_gap_to_baseline"])] for r in losses["table"]]
        base = losses.get("baseline") or "(baseline not found)"
        parts += [f"<h2>Final loss and gap to {html.escape(base)}</h2>",
                  _table(["run", "last iteration", "final loss", "mean of last 10%",
                          "compared at", "gap", "relative gap", "validation loss",
                          "validation gap"], rows)]
    region_rows = []
    for scheme, sec in schemes.items():
        for cls, m in (sec.get("by_tensor_class") or {}).items():
            regions = m.get("hifp8_regions")
            if regions:
                region_rows.append([html.escape(scheme), html.escape(cls)] + [
                    _fmt(regions[k], "pct") for k in ("underflow", "denormal", "mant1",
                                                      "mant2", "mant3", "overflow")])
    if region_rows:
        parts += ["<h2>HiF8 precision regions</h2>",
                  "<p class='muted'>Share of finite nonzero values per region of HiF8's tapered "
                  "format, as captured (no scaling).</p>",
                  _table(["quant type", "tensors", "underflow", "denormal", "1-bit mantissa",
                          "2-bit mantissa", "3-bit mantissa", "overflow"], region_rows)]
    figures = doc.get("figures") or []
    if figures:
        parts.append("<h2>Figures</h2>")
        parts += [_figure(outdir, fig) for fig in figures]
    cons = doc.get("consistency") or {}
    if cons.get("records_checked"):
        parts.append(f"<p class='muted'>Self-check: the error metrics of "
                     f"{cons['records_checked']} records were recomputed from the tensors and "
                     f"compared with those the capture wrote; "
                     f"{cons['records_mismatched']} disagreed.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(doc: dict, outdir: str) -> str:
    path = os.path.join(outdir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(doc, outdir))
    return path
