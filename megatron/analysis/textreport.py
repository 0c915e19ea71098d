"""statistics.txt: the report's tables (megatron.analysis.tables) as aligned plain text."""

from __future__ import annotations

import textwrap
from typing import List, Sequence

from megatron.analysis.tables import all_tables


def table(headers: Sequence[str], rows: List[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, with a rule under the header."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] +
                     [line(r) for r in rows])


def render(doc: dict) -> str:
    out = [f"Tensor analysis (statistics schema {doc['schema_version']}), generated "
           f"{doc['generated_at']}"]
    inputs = doc.get("inputs") or {}
    if inputs.get("tensor_dirs"):
        out.append("Captures: " + ", ".join(inputs["tensor_dirs"]))
    if inputs.get("tensorboard_dirs"):
        out.append("TensorBoard: " + ", ".join(inputs["tensorboard_dirs"]))
    out.append("")
    for item in all_tables(doc):
        out.append(f"== {item.title} ==")
        out += [textwrap.fill(note, 100) for note in item.notes]
        if item.key == "run":        # label: value lines read better than a table here
            width = max(len(row[0][0]) for row in item.rows)
            out += [f"{row[0][0].ljust(width)}  {row[1][0]}" for row in item.rows]
        else:
            out.append(table(item.headers, item.cells()))
        out.append("")
        if item.explanations:        # what the alarming numbers above mean
            out.append("What the alarming numbers mean:")
            out += [textwrap.fill(text, 100, initial_indent="- ", subsequent_indent="  ")
                    for text in item.explanations]
            out.append("")
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
