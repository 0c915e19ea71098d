"""Multi-seed scheme studies: paired gaps with 95% intervals, verdicts, curves and tables.

A study trains every scheme at every seed; a seed fixes the initialisation and the data
order, so the runs of one seed differ only in the quantization. The gap of a scheme to the
baseline is therefore computed per seed (paired) and its 95% interval comes from the paired
differences with Student's t distribution:

    d_s = 100 * (L_scheme,s - L_base,s) / L_base,s          for each seed s run by both
    gap = mean(d),  ci95 = gap -+ t(0.975, n - 1) * sd(d) / sqrt(n)

The verdict is "within noise" when the interval contains 0, "worse" when it lies above 0 and
"better" below; with fewer than two paired seeds there is no interval and the verdict says
so ("insufficient seeds"). The baseline's own seed-to-seed spread is reported as the noise
floor of the study.
"""

from __future__ import annotations

import html
from typing import Dict, List, Optional

from megatron.analysis.intervals import mean_interval, mean_std

WORSE, BETTER, WITHIN_NOISE, INSUFFICIENT = "worse", "better", "within noise", \
    "insufficient seeds"


def paired_gap(baseline: Dict[int, float], scheme: Dict[int, float]) -> dict:
    """The gap in % of `scheme` to `baseline` (both {seed: final validation loss}), paired by
    seed: {"mean", "ci95", "seeds", "differences", "verdict"}."""
    seeds = sorted(set(baseline) & set(scheme))
    diffs = [100.0 * (scheme[s] - baseline[s]) / baseline[s] for s in seeds]
    result = {"mean": None, "ci95": None, "seeds": seeds, "differences": diffs,
              "verdict": INSUFFICIENT}
    if not diffs:
        return result
    interval = mean_interval(diffs)
    result["mean"] = interval["mean"]
    if len(diffs) < 2:
        return result
    low, high = interval["ci95"]
    result["ci95"] = [low, high]
    result["verdict"] = WORSE if low > 0 else BETTER if high < 0 else WITHIN_NOISE
    return result


def summarize(runs: List[dict], baseline: str) -> Dict[str, dict]:
    """The "schemes" section of study.json from its "runs" (finished runs only)."""
    finals: Dict[str, Dict[int, float]] = {}
    for run in runs:
        if run.get("status") == "done" and run.get("final_val_loss") is not None:
            finals.setdefault(run["scheme"], {})[run["seed"]] = run["final_val_loss"]
    schemes = {}
    for name in dict.fromkeys(r["scheme"] for r in runs):
        per_seed = finals.get(name, {})
        seeds = sorted(per_seed)
        entry = {"seeds": seeds, "final_val_loss": [per_seed[s] for s in seeds],
                 **mean_std([per_seed[s] for s in seeds])}
        if name != baseline:
            gap = paired_gap(finals.get(baseline, {}), per_seed)
            entry["gap_vs_baseline_pct"] = {"mean": gap["mean"], "ci95": gap["ci95"],
                                            "paired_seeds": gap["seeds"],
                                            "differences": gap["differences"]}
            entry["verdict"] = gap["verdict"]
        schemes[name] = entry
    return schemes


def load_study(path: str) -> dict:
    """A study.json, checked enough to render: ValueError with one line otherwise."""
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--study {path}: cannot read it ({exc})") from None
    for key, kind in (("baseline", str), ("budget", dict), ("runs", list), ("schemes", dict)):
        if not isinstance(data, dict) or not isinstance(data.get(key), kind):
            raise ValueError(f"--study {path}: not a study.json (no {key!r} {kind.__name__}; "
                             "tools/study.py writes one)")
    for name, entry in data["schemes"].items():
        if not isinstance(entry, dict) or not {"seeds", "mean", "std"} <= set(entry):
            raise ValueError(f"--study {path}: scheme {name!r} lacks seeds/mean/std")
    return data


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table_rows(study: dict) -> List[List[str]]:
    """[scheme, seeds, final val loss mean +- std, gap % with 95% interval, verdict]."""
    rows = []
    for name, entry in study["schemes"].items():
        loss = f"{_fmt(entry['mean'])} ± {_fmt(entry['std'])}"
        gap = entry.get("gap_vs_baseline_pct")
        if gap is None:
            gap_text, verdict = "(baseline)", "—"
        else:
            ci = gap["ci95"]
            gap_text = (f"{gap['mean']:+.2f}%" if gap["mean"] is not None else "n/a") + (
                f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
            verdict = entry["verdict"]
        rows.append([name, str(len(entry["seeds"])), loss, gap_text, verdict])
    return rows


HEADER = ["scheme", "seeds", "final val loss (mean ± std)", "gap vs baseline (95% CI)", "verdict"]


def markdown_table(study: dict) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(study)]
    return "\n".join(lines)


def describe_budget(study: dict) -> str:
    b = study["budget"]
    per_iteration = b["tokens"] // max(1, b["train_iters"])
    return (f"{b['model']}, {b['train_iters']} iterations x {per_iteration:,}"
            f" tokens = {b['tokens']:,} tokens per run, tokenizer {b['tokenizer']}")


def noise_note(study: dict) -> str:
    """The study's noise in words: the baseline's spread over seeds and that of the paired
    per-seed differences, which bounds what the study can resolve."""
    base = study["schemes"].get(study["baseline"], {})
    if base.get("std") is None or not base.get("mean"):
        return "The baseline has fewer than two finished seeds: no noise floor."
    spreads = [mean_std(e["gap_vs_baseline_pct"]["differences"])["std"]
               for e in study["schemes"].values() if e.get("gap_vs_baseline_pct")]
    spreads = [v for v in spreads if v is not None]
    paired = (f"; the per-seed differences between an arm and the baseline (same "
              f"initialisation and data order) spread by {min(spreads):.2f}% to "
              f"{max(spreads):.2f}% (sd), so gaps smaller than about that cannot be resolved "
              "with these seeds") if spreads else ""
    return (f"Noise floor: the baseline's seed-to-seed spread is {base['std']:.4f} "
            f"({100 * base['std'] / base['mean']:.2f}% of its mean loss){paired}.")


def relative_curves(curves: Dict[str, Dict[int, Dict[int, float]]],
                    baseline: str) -> Dict[str, Dict[int, Dict[int, float]]]:
    """{arm: {seed: {iteration: 100 (L_arm - L_base) / L_base}}} for the seeds and iterations
    the baseline has too: the paired gap as training goes on."""
    base = curves.get(baseline, {})
    out = {}
    for arm, by_seed in curves.items():
        if arm == baseline:
            continue
        out[arm] = {seed: {it: 100.0 * (v - base[seed][it]) / base[seed][it]
                           for it, v in series.items() if it in base.get(seed, {})}
                    for seed, series in by_seed.items() if seed in base}
        out[arm] = {seed: series for seed, series in out[arm].items() if series}
    return out


def html_section(study: dict, figure: Optional[str]) -> str:
    """A self-contained HTML section: budget, noise floor, table and the curves figure."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in table_rows(study))
    img = f'<img src="{html.escape(figure)}" alt="loss curves" style="max-width:100%">' \
        if figure else ""
    return (f"<section id=\"study\"><h2>Scheme study</h2>"
            f"<p>{html.escape(describe_budget(study))}; baseline {html.escape(study['baseline'])}."
            f"</p><p>{html.escape(noise_note(study))}</p>"
            f"<table><tr>{head}</tr>{body}</table>{img}</section>")


def plot_curves(panels: Dict[str, Dict[str, Dict[int, Dict[int, float]]]], out_png: str,
                title: str = "") -> str:
    """One panel per entry of `panels` ({panel title: curves}), each drawing loss against
    iteration per scheme: the mean over seeds with a band from the lowest to the highest
    seed. Curves are {scheme: {seed: {iteration: loss}}}; iterations that not every seed of
    a scheme has are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Panels stacked, as wide as the report's text column (the report shows figures at their
    # own size).
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.4, 4.4 * len(panels)), squeeze=False,
                             sharex=True)
    names = list(dict.fromkeys(name for curves in panels.values() for name in curves))
    for ax, (panel, curves) in zip(axes[:, 0], panels.items()):
        for scheme, by_seed in curves.items():
            common = sorted(set.intersection(*(set(c) for c in by_seed.values()))) \
                if by_seed else []
            if not common:
                continue
            values = [[by_seed[s][it] for s in by_seed] for it in common]
            color = f"C{names.index(scheme) % 10}"      # one color per scheme in every panel
            ax.plot(common, [sum(v) / len(v) for v in values], color=color, linewidth=1.5,
                    label=f"{scheme} ({len(by_seed)} seeds)")
            ax.fill_between(common, [min(v) for v in values], [max(v) for v in values],
                            color=color, alpha=0.18, linewidth=0)
        if "%" in panel:
            ax.axhline(0.0, color="black", linewidth=0.8)
        if ax is axes[-1, 0]:
            ax.set_xlabel("iteration", fontsize=10)
        ax.set_ylabel(panel, fontsize=10)
        ax.set_title(f"{panel}: mean over seeds, band = min..max", fontsize=11)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
