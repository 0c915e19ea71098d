"""report.html: one self-contained page (PNGs embedded as base64) with the report's tables
(megatron.analysis.tables), captions and the input problems.

The page opens with one screen that answers "where does this format hurt" (`<section
id='glance'>`, sized for a 1400 px window): the run in one line, the summary table (one row per
scheme, `<table id='summary'>`), the per-layer picture (megatron.analysis.glance) and what its
alarming numbers mean (megatron.analysis.explain); the definitions are one click away. Then
the problems, the other tables (each with the explanations of the alarming numbers it shows)
and the figures.

Figures are shown at their own pixel size (scrolling sideways when wider than the column), so
the font sizes the figures are drawn with (megatron.analysis.plots) are the ones read; wide
tables scroll inside their own box, so the page itself never does."""

from __future__ import annotations

import base64
import html
import os
from typing import List, Optional, Sequence

from megatron.analysis.loading import INCOMPLETE_RUN
from megatron.analysis.statistics import OUTPUT_SCHEMES_KEY
from megatron.analysis.tables import SUMMARY_KEY, Table, all_tables

_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 1.2em auto;
       max-width: 1200px; color: #212529; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.5em; margin: 0 0 .2em; } h2 { border-bottom: 1px solid #dee2e6;
     padding-bottom: .2em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: .88em; }
th, td { border: 1px solid #dee2e6; padding: .25em .6em; text-align: right; }
th { background: #f1f3f5; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1.2em 0 2em; } .scroll { overflow-x: auto; max-width: 100%; }
figure img { max-width: none; display: block; border: 1px solid #e9ecef; }
table.summary { font-size: .92em; margin: .3em 0 .5em; }
table.summary :is(td, th):is(:nth-child(2), :last-child) { text-align: left; }
figcaption { font-size: .9em; color: #495057; margin-top: .4em; }
.problems li { color: #9c2f00; } .muted { color: #6c757d; font-size: .9em; }
p.problems { color: #9c2f00; margin: .3em 0; }
nav a { margin-right: 1em; }
table.run th { text-align: left; } table.run td { text-align: left; }
#glance { border-bottom: 2px solid #adb5bd; padding-bottom: .4em; margin-bottom: .8em; }
#glance h2 { font-size: 1.15em; margin: .5em 0 .1em; border: none; }
#glance figure { margin: .4em 0 .3em; } #glance figcaption { font-size: .82em; }
.lede { margin: 0 0 .3em; color: #343a40; }
ul.explain { font-size: .84em; margin: .3em 0 .6em; padding-left: 1.3em; color: #5c3d00; }
ul.explain li { margin: .12em 0; } p.explain-title { font-size: .84em; margin: .4em 0 0;
                                                      font-weight: 600; color: #5c3d00; }
details.definitions { font-size: .84em; color: #495057; margin: .2em 0; }
details.definitions p { margin: .3em 0; }
"""


def _table(headers: Sequence[str], rows: List[Sequence[str]], attributes: str = "") -> str:
    """Cells are already escaped HTML; `attributes` go into the <table> tag. A table wider
    than the column scrolls in its own box."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<div class='scroll'><table{attributes}><thead><tr>{head}</tr></thead><tbody>"
            f"{body}</tbody></table></div>")


def _explanations(texts: Sequence[str]) -> str:
    """What the alarming numbers above mean, one item each."""
    if not texts:
        return ""
    return ("<p class='explain-title'>What the alarming numbers mean</p><ul class='explain'>"
            + "".join(f"<li>{html.escape(t)}</li>" for t in texts) + "</ul>")


def _section(item: Table) -> str:
    notes = "".join(f"<p class='muted'>{html.escape(note)}</p>" for note in item.notes)
    if item.key == "run":
        rows = "".join(f"<tr><th>{html.escape(str(row[0][0]))}</th>"
                       f"<td>{html.escape(str(row[1][0]))}</td></tr>" for row in item.rows)
        return f"<h2 id='{item.key}'>{html.escape(item.title)}</h2>" \
               f"<div class='scroll'><table class='run'>{rows}</table></div>{notes}" \
               + _explanations(item.explanations)
    rows = [[html.escape(cell) for cell in row] for row in item.cells()]
    return (f"<h2 id='{html.escape(item.key)}'>{html.escape(item.title)}</h2>{notes}"
            + _table(item.headers, rows) + _explanations(item.explanations))


def _image(outdir: str, fig: dict) -> Optional[str]:
    path = os.path.join(outdir, "figures", fig["file"])
    try:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
    except OSError:
        return None
    return (f"<div class='scroll'><img alt='{html.escape(fig['title'])}' "
            f"src='data:image/png;base64,{data}'></div>")


def _figure(outdir: str, fig: dict, explained: Sequence[str] = (),
            heading: bool = True) -> str:
    """A figure with its caption (under its title with `heading`) and the explanations of
    the alarming numbers it shows."""
    image = _image(outdir, fig)
    if image is None:
        return f"<p class='problems'>figure {html.escape(fig['file'])} is missing</p>"
    anchor = html.escape(os.path.splitext(fig["file"])[0])
    title = f"<h3>{html.escape(fig['title'])}</h3>" if heading else ""
    return (f"<figure id='{anchor}'>{title}{image}"
            f"<figcaption>{html.escape(fig['caption'])}</figcaption>"
            f"{_explanations(explained)}</figure>")


def _lede(doc: dict) -> str:
    """The run in one line: model, captured iterations, precision, MX scale rule."""
    provenance = doc.get("provenance") or {}
    fields = provenance.get("fields") or {}
    parts = []
    for key, prefix in (("model", ""), ("precision", ""), ("scale_mode", "MX scale rule ")):
        value = (fields.get(key) or {}).get("value")
        if value:
            parts.append(prefix + value)
    captured = set((provenance.get("captured_iterations") or {}).values())
    if len(captured) == 1:
        parts.insert(1, f"captured iteration(s) {captured.pop()}")
    schemes = provenance.get("schemes") or []
    if schemes:
        parts.append(f"{len(schemes)} scheme{'s' if len(schemes) != 1 else ''}")
    return " \u00b7 ".join(html.escape(p) for p in parts)


def _glance(doc: dict, tables: List[Table], outdir: str, problems: list,
            incomplete: List[str]) -> str:
    """The first screen: the run in one line, the summary, the per-layer picture and what
    the alarming numbers mean."""
    parts = ["<section id='glance'>", "<h1>Low-precision tensor analysis</h1>"]
    lede = _lede(doc)
    if lede:
        parts.append(f"<p class='lede'>{lede} (details: <a href='#run'>Run</a>)</p>")
    if problems:
        parts.append(f"<p class='problems'>{len(problems)} problem"
                     f"{'s' if len(problems) != 1 else ''} with the input, listed "
                     "<a href='#problems'>below</a>: what they concern is left out of the "
                     "numbers.</p>")
    if incomplete:
        parts.append(f"<p class='problems'><b>{html.escape(INCOMPLETE_RUN)}</b>: the capture "
                     f"of {html.escape(', '.join(incomplete))} did not finish; see the "
                     f"problems below.</p>")
    summary = next((t for t in tables if t.key == SUMMARY_KEY), None)
    if summary is not None:
        rows = [[html.escape(cell) for cell in row] for row in summary.cells()]
        parts.append(f"<h2 id='{SUMMARY_KEY}-title'>{html.escape(summary.title)}</h2>"
                     + _table(summary.headers, rows, f" id='{SUMMARY_KEY}' class='summary'"))
    picture = next((f for f in doc.get("figures") or [] if f.get("glance")), None)
    if picture is not None:     # the summary says what it is: no title of its own
        parts.append(_figure(outdir, picture, heading=False))
    if summary is not None:
        parts.append(_explanations(summary.explanations))
        parts.append("<details class='definitions'><summary>How these numbers are defined"
                     "</summary>" + "".join(f"<p>{html.escape(note)}</p>"
                                            for note in summary.notes) + "</details>")
    parts.append("</section>")
    return "\n".join(parts)


def render(doc: dict, outdir: str) -> str:
    outputs = doc.get("outputs") or []
    problems = doc.get("problems") or []
    incomplete = [scheme for scheme, sec in (doc.get(OUTPUT_SCHEMES_KEY) or {}).items()
                  if sec["capture"].get("status", "complete") != "complete"]
    tables = all_tables(doc)
    figures = [f for f in doc.get("figures") or [] if not f.get("glance")]
    explained = doc.get("explanations") or {}
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
             f"<title>Tensor analysis report</title><style>{_CSS}</style></head><body>",
             _glance(doc, tables, outdir, problems, incomplete)]
    inputs = doc.get("inputs") or {}
    sources = "".join(f"; {what}: " + ", ".join(f"<code>{html.escape(d)}</code>"
                                                for d in inputs[key])
                      for key, what in (("tensor_dirs", "captures"),
                                        ("tensorboard_dirs", "TensorBoard"))
                      if inputs.get(key))
    parts.append(f"<p class='muted'>Generated {html.escape(doc['generated_at'])}; statistics "
                 f"schema {doc['schema_version']}. Machine-readable numbers: statistics.json; "
                 f"plain text: statistics.txt"
                 f"{'; one row per record: records.csv' if 'records.csv' in outputs else ''}"
                 f"{sources}.</p>")
    parts.append("<nav>" + "".join(
        f"<a href='#{html.escape(os.path.splitext(f['file'])[0])}'>{html.escape(f['title'])}</a>"
        for f in figures) + "</nav>")
    if problems:
        parts.append(f"<h2 id='problems'>Problems with the input ({len(problems)})</h2>"
                     "<ul class='problems'>"
                     + "".join(f"<li>{html.escape(p['message'])}</li>" for p in problems[:50])
                     + ("<li>... see statistics.json</li>" if len(problems) > 50 else "")
                     + "</ul>")
    parts += [_section(item) for item in tables if item.key != SUMMARY_KEY]
    if figures:
        parts.append("<h2>Figures</h2>")
        parts += [_figure(outdir, fig, explained.get(f"figure:{fig['file']}", ()))
                  for fig in figures]
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
