"""report.html: one self-contained page (PNGs embedded as base64) with the report's tables
(megatron.analysis.tables), captions and the input problems. The summary table (one row per
scheme, `<table id='summary'>`) comes right after the header.

Figures are shown at their own pixel size (scrolling sideways when wider than the column), so
the font sizes the figures are drawn with (megatron.analysis.plots) are the ones read."""

from __future__ import annotations

import base64
import html
import os
from typing import List, Sequence

from megatron.analysis.loading import INCOMPLETE_RUN
from megatron.analysis.statistics import OUTPUT_SCHEMES_KEY
from megatron.analysis.tables import SUMMARY_KEY, Table, all_tables

_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; color: #212529; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #dee2e6; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: .88em; }
th, td { border: 1px solid #dee2e6; padding: .25em .6em; text-align: right; }
th { background: #f1f3f5; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1.2em 0 2em; } .scroll { overflow-x: auto; }
figure img { max-width: none; display: block; border: 1px solid #e9ecef; }
table.summary { font-size: .95em; }
table.summary :is(td, th):is(:nth-child(2), :last-child) { text-align: left; }
figcaption { font-size: .9em; color: #495057; margin-top: .4em; }
.problems li { color: #9c2f00; } .muted { color: #6c757d; font-size: .9em; }
nav a { margin-right: 1em; }
table.run th { text-align: left; } table.run td { text-align: left; }
"""


def _table(headers: Sequence[str], rows: List[Sequence[str]], attributes: str = "") -> str:
    """Cells are already escaped HTML; `attributes` go into the <table> tag."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table{attributes}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary(item: Table) -> str:
    """The one-glance table under the header: the table first, its notes after it."""
    notes = "".join(f"<p class='muted'>{html.escape(note)}</p>" for note in item.notes)
    rows = [[html.escape(cell) for cell in row] for row in item.cells()]
    return (f"<h2 id='{SUMMARY_KEY}-title'>{html.escape(item.title)}</h2>"
            + _table(item.headers, rows, f" id='{SUMMARY_KEY}' class='summary'") + notes)


def _section(item: Table) -> str:
    notes = "".join(f"<p class='muted'>{html.escape(note)}</p>" for note in item.notes)
    if item.key == "run":
        rows = "".join(f"<tr><th>{html.escape(str(row[0][0]))}</th>"
                       f"<td>{html.escape(str(row[1][0]))}</td></tr>" for row in item.rows)
        return f"<h2 id='{item.key}'>{html.escape(item.title)}</h2>" \
               f"<table class='run'>{rows}</table>{notes}"
    rows = [[html.escape(cell) for cell in row] for row in item.cells()]
    return (f"<h2 id='{html.escape(item.key)}'>{html.escape(item.title)}</h2>{notes}"
            + _table(item.headers, rows))


def _figure(outdir: str, fig: dict) -> str:
    path = os.path.join(outdir, "figures", fig["file"])
    try:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
    except OSError:
        return f"<p class='problems'>figure {html.escape(fig['file'])} is missing</p>"
    anchor = html.escape(os.path.splitext(fig["file"])[0])
    return (f"<figure id='{anchor}'><h3>{html.escape(fig['title'])}</h3>"
            f"<div class='scroll'><img alt='{html.escape(fig['title'])}' "
            f"src='data:image/png;base64,{data}'></div>"
            f"<figcaption>{html.escape(fig['caption'])}</figcaption></figure>")


def render(doc: dict, outdir: str) -> str:
    outputs = doc.get("outputs") or []
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
             f"<title>Tensor analysis report</title><style>{_CSS}</style></head><body>",
             "<h1>Low-precision tensor analysis</h1>",
             f"<p class='muted'>Generated {html.escape(doc['generated_at'])}; statistics schema "
             f"{doc['schema_version']}. Machine-readable numbers: statistics.json; "
             f"plain text: statistics.txt"
             f"{'; one row per record: records.csv' if 'records.csv' in outputs else ''}.</p>"]
    inputs = doc.get("inputs") or {}
    if inputs.get("tensor_dirs"):
        parts.append("<p>Captures: " + ", ".join(
            f"<code>{html.escape(d)}</code>" for d in inputs["tensor_dirs"]) + "</p>")
    tables = all_tables(doc)
    parts += [_summary(item) for item in tables if item.key == SUMMARY_KEY]
    parts.append("<nav>" + "".join(
        f"<a href='#{html.escape(os.path.splitext(f['file'])[0])}'>{html.escape(f['title'])}</a>"
        for f in doc.get("figures") or []) + "</nav>")
    problems = doc.get("problems") or []
    if problems:
        parts.append(f"<h2>Problems with the input ({len(problems)})</h2><ul class='problems'>"
                     + "".join(f"<li>{html.escape(p['message'])}</li>" for p in problems[:50])
                     + ("<li>... see statistics.json</li>" if len(problems) > 50 else "")
                     + "</ul>")
    incomplete = [scheme for scheme, sec in (doc.get(OUTPUT_SCHEMES_KEY) or {}).items()
                  if sec["capture"].get("status", "complete") != "complete"]
    if incomplete:
        parts.append(f"<p class='problems'><b>{html.escape(INCOMPLETE_RUN)}</b>: the capture of "
                     f"{html.escape(', '.join(incomplete))} did not finish; see the problems "
                     f"above.</p>")
    parts += [_section(item) for item in tables if item.key != SUMMARY_KEY]
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
