"""The per-layer picture at the top of the report: where each format hurts.

One small heat map, quantized schemes (rows) x layers (columns), each cell the SQNR of the
layer's worst quantized operand and which operand that is, on one colour scale for every
scheme. It is drawn from statistics.json (`quant_types.<scheme>.quantized_layers` from the
captures; without captures, the telemetry's `layers_at_last_step`), sized to fit the report's
column (1150 px) and a few hundred pixels high, so that together with the summary table it
fits one screen of a 1400 px window. The full per-operand heat maps come further down.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron.analysis.naming import layer_order
from megatron.analysis.plots import (COLUMN_IN, SMALL_PT, ink, plt, save_figure, short_module,
                                     style)
from megatron.analysis.statistics import OUTPUT_SCHEMES_KEY

FILE = "layer_overview.png"
_LABEL_IN = 2.2         # room for the scheme names and the colour bar
_CELL_IN = 1.35         # a cell wide enough for "proj: input_wgrad" at 9 pt
_NUMBER_IN = 0.42       # the narrowest cell that still holds "-12 dB" at 9 pt
_ROW_IN = 0.55          # three lines of 9 pt: the SQNR, the module, the tensor
_MIN_SPAN_DB = 12.0     # the colour scale spans at least two bits: 1 dB must not look alarming


def layer_rows(doc: dict) -> Tuple[str, Dict[str, List[dict]]]:
    """('captures' | 'telemetry', {scheme: [{layer, label, worst: {module, tensor_name,
    sqnr_db}}]}) for the schemes with quantized operands."""
    rows = {scheme: sec.get("quantized_layers") or []
            for scheme, sec in (doc.get(OUTPUT_SCHEMES_KEY) or {}).items()}
    rows = {scheme: layers for scheme, layers in rows.items() if layers}
    if rows:
        return "captures", rows
    telemetry = (doc.get("telemetry") or {}).get("schemes") or {}
    rows = {scheme: s.get("layers_at_last_step") or [] for scheme, s in telemetry.items()}
    return "telemetry", {scheme: layers for scheme, layers in rows.items() if layers}


def _grid(rows: Dict[str, List[dict]]):
    """(schemes, layers, SQNR per cell (NaN where none), operand name per cell)."""
    schemes = sorted(rows)
    layers = sorted({r["layer"] for rs in rows.values() for r in rs}, key=layer_order)
    data = np.full((len(schemes), len(layers)), np.nan)
    names = [[""] * len(layers) for _ in schemes]
    for i, scheme in enumerate(schemes):
        for r in rows[scheme]:
            j = layers.index(r["layer"])
            value = r["worst"]["sqnr_db"]
            if value is not None and math.isfinite(value):
                data[i, j] = value
            names[i][j] = (f"{short_module(r['worst'].get('module') or '')}\n"
                           f"{r['worst'].get('tensor_name') or ''}")
    return schemes, layers, data, names


def _colour_limits(data: np.ndarray) -> Tuple[float, float]:
    """The SQNR range of the cells, widened to _MIN_SPAN_DB around its middle."""
    finite = data[np.isfinite(data)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if high - low < _MIN_SPAN_DB:
        middle = (high + low) / 2
        low, high = middle - _MIN_SPAN_DB / 2, middle + _MIN_SPAN_DB / 2
    return low, high


def _annotate(ax, im, data: np.ndarray, names, cell: float) -> None:
    """The SQNR in each cell, and the operand's name where the cell is wide enough."""
    if cell < _NUMBER_IN:
        return
    for (i, j), value in np.ndenumerate(data):
        if not np.isfinite(value):
            continue
        text = f"{value:.0f} dB" + (f"\n{names[i][j]}" if cell >= _CELL_IN else "")
        ax.text(j, i, text, ha="center", va="center", fontsize=SMALL_PT,
                color=ink(im.cmap(im.norm(value))))


def draw(doc: dict, figure_dir: str) -> Optional[dict]:
    """The picture as a figure entry (with `glance`: shown at the top, not among the
    figures), or None without quantized operands."""
    source, rows = layer_rows(doc)
    if not rows:
        return None
    schemes, layers, data, names = _grid(rows)
    labels = {r["layer"]: r["label"] for rs in rows.values() for r in rs}
    # Cells shrink to fit the column; below full width they show the SQNR only.
    cell = min(_CELL_IN, (COLUMN_IN - _LABEL_IN) / len(layers))
    with style():
        fig, ax = plt.subplots(figsize=(min(COLUMN_IN, _LABEL_IN + cell * len(layers)),
                                        0.75 + _ROW_IN * len(schemes)), layout="constrained")
        low, high = _colour_limits(data)
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=low, vmax=high,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, label="SQNR [dB]", pad=0.01, fraction=0.05)
        ax.set_yticks(range(len(schemes)), schemes)
        ax.set_xticks(range(len(layers)), [labels[n] for n in layers])
        ax.tick_params(axis="x", labelsize=SMALL_PT if len(layers) > 16 else None)
        _annotate(ax, im, data, names, cell)
        path = save_figure(fig, figure_dir, FILE)
    when = ("over every captured iteration and micro-batch" if source == "captures"
            else "at the last logged iteration (telemetry)")
    caption = (f"Where each format hurts: per scheme and layer ('output': the output layer), the "
               f"SQNR of the layer's worst quantized operand {when} and which it is (module, "
               "tensor; _wgrad / _dgrad: the copies a backward GEMM quantizes again); lower and "
               f"darker is more error, one colour scale of at least {_MIN_SPAN_DB:g} dB, 6 dB "
               "about one bit. Every operand: the heat maps below.")
    if cell < _CELL_IN:
        caption += " With this many layers the cells show the SQNR only."
    return {"file": path, "title": "Where each format hurts, per layer", "caption": caption,
            "glance": True}
