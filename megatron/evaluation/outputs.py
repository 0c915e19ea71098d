"""evaluation.json, evaluation.md (the tables) and the figures of tools/evaluate.py."""

from __future__ import annotations

import json
import math
import os
from typing import List

import numpy as np

SCHEMA_VERSION = 1


def _f(value, digits: int = 6) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def _interval(ci) -> str:
    return f"[{_f(ci[0])}, {_f(ci[1])}]"


def _operands(arm: dict) -> str:
    stats = arm.get("forward_operands") or {}
    cells = []
    for metric in ("saturated_pct", "flushed_pct"):
        m = stats.get(metric)
        cells.append("—" if m is None else f"{m['worst']:.3g} ({m['median']:.3g})")
    return " | ".join(cells)


def arms_table(doc: dict) -> List[str]:
    lines = [f"Direct cast: {doc['tokens']:,} tokens in {doc['sequences']} sequences, same "
             f"weights (iteration {doc['iteration']}) and batches for every arm; "
             f"{doc['precision']}; delta = loss - {doc['baseline']} (nats/token), 95% "
             "intervals over sequences (t and bootstrap). Saturated / flushed: share of the "
             "quantized forward operands' elements, worst operand and median over operands, "
             "on the first micro-batch.", "",
             "| scheme | loss | perplexity | delta | 95% CI (t) | 95% CI (bootstrap) | "
             "token delta p1 / p50 / p99 | saturated % worst (median) | "
             "flushed % worst (median) |",
             "|---|---:|---:|---:|---|---|---|---:|---:|"]
    for spec, arm in doc["schemes"].items():
        d = arm.get("delta_vs_baseline")
        if d is None:
            lines.append(f"| {spec} (baseline) | {_f(arm['loss'])} | {arm['perplexity']:.3f} "
                         f"| — | — | — | — | {_operands(arm)} |")
            continue
        q = arm["token_delta_quantiles"]
        lines.append(f"| {spec} | {_f(arm['loss'])} | {arm['perplexity']:.3f} | "
                     f"{d['mean']:+.6f} | {_interval(d['ci95'])} | "
                     f"{_interval(d['ci95_bootstrap'])} | {q['q0.01']:+.4f} / "
                     f"{q['q0.5']:+.4f} / {q['q0.99']:+.4f} | {_operands(arm)} |")
    return lines


def sweep_table(sweep: dict) -> List[str]:
    design = ("one layer at a time (all its sites), one site kind in every layer, the output "
              "layer" if sweep.get("design") == "layers" else "one site at a time")
    lines = ["", f"Per-site sweep: {design} in `{sweep['scheme']}`, delta vs "
             f"{sweep['reference']} (loss {_f(sweep['reference_loss'])}), largest first.", "",
             "| rank | layer | site | delta | 95% CI (t) |", "|---:|---:|---|---:|---|"]
    by_key = {r["key"]: r for r in sweep["sites"]}
    for rank, key in enumerate(sweep["ranking"], 1):
        r = by_key[key]
        layer = r["layer"] if r["layer"] is not None else \
            "—" if r["site"] == "output" else "all"
        lines.append(f"| {rank} | {layer} | {r['site']} | {r['delta']['mean']:+.6f} | "
                     f"{_interval(r['delta']['ci95'])} |")
    return lines


def gradients_table(g: dict) -> List[str]:
    lines = ["", f"Gradient fidelity on {g['tokens']:,} tokens ({g['micro_batches']} "
             "micro-batches), all parameters; reference: fp32 unquantized model.", "",
             "| scheme | cosine vs fp32 | rel L2 vs fp32 | rel L2 vs baseline | "
             "mean of K draws: rel L2 vs fp32 (K) | log-log slope |",
             "|---|---:|---:|---:|---|---:|"]
    for spec, e in g["schemes"].items():
        vb = e.get("vs_baseline", {}).get("rel_l2")
        draws = e.get("draws")
        curve = ", ".join(f"{v:.4g} ({k})" for k, v in zip(draws["K"], draws["rel_l2"])) \
            if draws else "— (deterministic)"
        slope = f"{draws['log_log_slope']:.2f}" if draws else "—"
        lines.append(f"| {spec} | {e['vs_fp32']['cosine']:.6f} | {e['vs_fp32']['rel_l2']:.4g} "
                     f"| {'—' if vb is None else f'{vb:.4g}'} | {curve} | {slope} |")
    return lines


def markdown(doc: dict) -> str:
    lines = [f"# Evaluation of {doc['checkpoint']}", ""] + arms_table(doc)
    if "sweep" in doc:
        lines += sweep_table(doc["sweep"])
    if "gradients" in doc:
        lines += gradients_table(doc["gradients"])
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def arms_figure(doc: dict, path: str) -> bool:
    rows = [(s, a["delta_vs_baseline"]) for s, a in doc["schemes"].items()
            if "delta_vs_baseline" in a]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6), dpi=120)
    y = np.arange(len(rows))
    means = [d["mean"] for _, d in rows]
    lo = [d["mean"] - d["ci95"][0] for _, d in rows]
    hi = [d["ci95"][1] - d["mean"] for _, d in rows]
    ax.errorbar(means, y, xerr=[lo, hi], fmt="o", capsize=4, color="#1f5f9f")
    ax.axvline(0, color="#666", lw=0.8)
    ax.set_yticks(y, [s for s, _ in rows], fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel(f"loss - {doc['baseline']} (nats/token), 95% CI over sequences", fontsize=10)
    ax.set_title(f"Direct cast, {doc['tokens']:,} tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def sweep_figure(sweep: dict, path: str) -> bool:
    if not sweep["sites"]:
        return False
    if sweep.get("design") == "layers":
        return _layers_figure(sweep, path)
    plt = _plt()
    layers = sorted({r["layer"] for r in sweep["sites"] if r["layer"] is not None})
    labels = list(dict.fromkeys(r["site"] for r in sweep["sites"] if r["layer"] is not None))
    grid = np.full((len(layers), len(labels)), np.nan)
    resolved = np.zeros(grid.shape, dtype=bool)
    for r in sweep["sites"]:
        if r["layer"] is not None:
            at = layers.index(r["layer"]), labels.index(r["site"])
            grid[at] = r["delta"]["mean"] * 1e3
            lo, hi = r["delta"]["ci95"]
            resolved[at] = lo > 0 or hi < 0
    output = [r for r in sweep["sites"] if r["layer"] is None and r["site"] == "output"]
    fig, ax = plt.subplots(figsize=(1.1 * len(labels) + 2.8, 0.55 * len(layers) + 2.0), dpi=120)
    bound = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            color = "white" if abs(v) > 0.6 * bound else "black" if resolved[i, j] else "#777777"
            ax.text(j, i, f"{v:+.2f}", ha="center", va="center", fontsize=9, color=color,
                    fontweight="bold" if resolved[i, j] else "normal")
    ax.set_xticks(range(len(labels)), labels, fontsize=10)
    ax.set_yticks(range(len(layers)), [f"layer {n}" for n in layers], fontsize=10)
    title = (f"Loss increase (1e-3 nats/token), one site at a time in\n{sweep['scheme']}; "
             "grey: 95% CI includes 0")
    if output:
        title += f"\noutput layer: {output[0]['delta']['mean'] * 1e3:+.2f}"
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="loss increase (1e-3 nats/token)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _layers_figure(sweep: dict, path: str) -> bool:
    """--sweep layers: the loss increase of each layer (all its sites) and of each site kind
    (in every layer) with 95% intervals; filled markers where the interval excludes 0."""
    plt = _plt()
    panels = [[r for r in sweep["sites"] if r["layer"] is not None],
              [r for r in sweep["sites"] if r["layer"] is None]]
    heights = [max(len(rows), 1) for rows in panels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.22 * max(heights) + 2.2), dpi=120)
    for ax, rows, title in zip(axes, panels, ("one layer at a time (all its sites)",
                                              "one site kind in every layer; output layer")):
        y = np.arange(len(rows))
        means = np.array([r["delta"]["mean"] for r in rows]) * 1e3
        lo = means - np.array([r["delta"]["ci95"][0] for r in rows]) * 1e3
        hi = np.array([r["delta"]["ci95"][1] for r in rows]) * 1e3 - means
        resolved = [r["delta"]["ci95"][0] > 0 or r["delta"]["ci95"][1] < 0 for r in rows]
        for i in range(len(rows)):
            ax.errorbar(means[i], y[i], xerr=[[lo[i]], [hi[i]]], fmt="o", capsize=2,
                        color="#1f5f9f", mfc="#1f5f9f" if resolved[i] else "white")
        labels = [f"layer {r['layer']}" if r["layer"] is not None else
                  "output layer" if r["site"] == "output" else f"{r['site']} (all layers)"
                  for r in rows]
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="#666", lw=0.8)
        ax.set_xlabel("loss increase (1e-3 nats/token), 95% CI", fontsize=9)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"Sweep in {sweep['scheme']} (open markers: CI includes 0)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _without_stochastic_rounding(spec: str) -> str:
    """The round-to-nearest twin of an arm: its spec without the stochastic-rounding flag."""
    name, _, flags = spec.partition("@")
    kept = [f for f in flags.split(",") if f and not f.startswith("quant-stochastic-rounding")]
    return name + ("@" + ",".join(kept) if kept else "")


def gradients_figure(g: dict, path: str) -> bool:
    plt = _plt()
    specs = list(g["schemes"])
    drawn = [(s, g["schemes"][s]["draws"]) for s in specs if "draws" in g["schemes"][s]]
    width = min(16.0, 5.0 + 0.075 * max(len(s) for s in specs))
    rows = 2 if drawn else 1
    fig, axes = plt.subplots(rows, 1, figsize=(width, 0.32 * len(specs) + 1.6 + 4.2 * (rows - 1)),
                             dpi=120, squeeze=False,
                             gridspec_kw={"height_ratios": [0.32 * len(specs) + 1, 4.0][:rows]})
    a = axes[0][0]
    errs = [g["schemes"][s]["vs_fp32"]["rel_l2"] for s in specs]
    a.barh(range(len(specs)), errs, color="#1f5f9f")
    for i, e in enumerate(errs):
        a.text(e, i, f" {e:.3g}", va="center", fontsize=9)
    a.set_yticks(range(len(specs)), specs, fontsize=9)
    a.invert_yaxis()
    a.set_xscale("log")
    a.set_xlim(right=max(errs) * 3)      # room for the value labels
    a.set_xlabel("relative L2 error of the gradient vs the fp32 unquantized model "
                 f"({g['micro_batches']} micro-batches)", fontsize=10)
    if drawn:
        b = axes[1][0]
        for n, (spec, d) in enumerate(drawn):
            color = f"C{n}"
            b.loglog(d["K"], d["rel_l2"], "o-", color=color, label=f"{spec}: mean of K draws")
            k0, e0 = d["K"][0], d["rel_l2"][0]
            b.loglog(d["K"], [e0 * (k0 / k) ** 0.5 for k in d["K"]], ":", color="#888")
            twin = _without_stochastic_rounding(spec)
            if twin != spec and twin in g["schemes"]:
                b.axhline(g["schemes"][twin]["vs_fp32"]["rel_l2"], ls="--", color=color,
                          label=f"{twin}: round to nearest (every draw the same)")
        if "bf16" in g["schemes"]:
            b.axhline(g["schemes"]["bf16"]["vs_fp32"]["rel_l2"], ls="-", lw=0.8, color="#444",
                      label="bf16 (the floor)")
        b.set_xlabel("K (stochastic-rounding draws averaged)", fontsize=10)
        b.set_ylabel("rel L2 of the mean vs fp32", fontsize=10)
        b.set_title("Stochastic rounding: error of the mean of K draws (dotted: 1/sqrt(K))",
                    fontsize=10)
        b.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write(doc: dict, outdir: str) -> List[str]:
    """Write every output atomically (temporary name, then rename); return their names."""
    doc = dict(doc, schema_version=SCHEMA_VERSION)
    written = []

    def put(name: str, text: str) -> None:
        tmp = os.path.join(outdir, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(outdir, name))
        written.append(name)

    put("evaluation.json", json.dumps(_jsonable(doc), indent=1) + "\n")
    put("evaluation.md", markdown(doc))
    for name, ok in (("evaluation.png", lambda p: arms_figure(doc, p)),
                     ("sweep.png", lambda p: "sweep" in doc and sweep_figure(doc["sweep"], p)),
                     ("gradients.png",
                      lambda p: "gradients" in doc and gradients_figure(doc["gradients"], p))):
        if ok(os.path.join(outdir, name)):
            written.append(name)
    return written


def write_sequences(arms: dict, outdir: str) -> str:
    """sequences.npz: `labels` (the arms, in order; sweep rows as "sweep:LAYER/SITE"),
    `tokens` [m] scored tokens per sequence and `sums` [arms, m] each arm's summed loss per
    sequence: what the intervals are computed from, for a user's own statistics."""
    labels = list(arms)
    first = arms[labels[0]]
    path = os.path.join(outdir, "sequences.npz")
    tmp = os.path.join(outdir, ".sequences.tmp.npz")
    np.savez(tmp, labels=np.array(labels), tokens=first.sequence_tokens,
             sums=np.stack([arms[label].sequence_sums for label in labels]))
    os.replace(tmp, path)
    return "sequences.npz"
