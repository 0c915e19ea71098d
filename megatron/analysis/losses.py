"""Loss curves of several training runs: parsing, final-loss gaps to a baseline, and a plot.

Sources, per run name:
- a training log: lines ` [date] iteration   N/  M | ... | lm loss: 7.008086E+00 | ...` and
  ` validation loss at iteration N | lm loss value: 6.790351E+00 | ...`;
- TensorBoard event files (scalar tags "lm loss" and "lm loss validation", as written by the
  training loop's SummaryWriter), given as a file or a directory searched recursively.
When a log is appended to by a resumed run, the last value logged for an iteration wins.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

log = logging.getLogger("megatron.analysis")

TRAIN_TAG = "lm loss"
VALID_TAG = "lm loss validation"
_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf|-inf))"
_TRAIN_RE = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?\blm loss:\s*" + _NUMBER)
_VALID_RE = re.compile(r"validation loss at iteration\s+(\d+)\s*\|\s*lm loss value:\s*" + _NUMBER)
LOG_SUFFIXES = (".log", ".txt", ".out")


@dataclass
class LossCurve:
    """Training and validation loss per iteration of one run."""

    name: str
    source: str
    train: Dict[int, float] = field(default_factory=dict)
    valid: Dict[int, float] = field(default_factory=dict)

    def series(self, which: str = "train") -> Tuple[List[int], List[float]]:
        data = self.train if which == "train" else self.valid
        its = sorted(data)
        return its, [data[i] for i in its]


def parse_log_text(text: str, name: str = "run", source: str = "") -> LossCurve:
    """Training/validation losses from the text of a training log."""
    curve = LossCurve(name, source)
    for line in text.splitlines():
        match = _VALID_RE.search(line)
        if match:
            curve.valid[int(match.group(1))] = float(match.group(2))
            continue
        match = _TRAIN_RE.search(line)
        if match:
            curve.train[int(match.group(1))] = float(match.group(2))
    return curve


def _event_files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path] if "tfevents" in os.path.basename(path) else []
    return sorted(glob.glob(os.path.join(glob.escape(path), "**", "*tfevents*"), recursive=True))


def read_tensorboard(path: str, name: str) -> LossCurve:
    """Losses from TensorBoard event files (several files: by wall time, last value wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curve = LossCurve(name, path)
    points: Dict[str, Dict[int, Tuple[float, float]]] = {TRAIN_TAG: {}, VALID_TAG: {}}
    for file in _event_files(path):
        acc = EventAccumulator(file, size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        for tag in (TRAIN_TAG, VALID_TAG):
            if tag not in tags:
                continue
            for event in acc.Scalars(tag):
                old = points[tag].get(event.step)
                if old is None or event.wall_time >= old[0]:
                    points[tag][event.step] = (event.wall_time, float(event.value))
    curve.train = {step: v for step, (_, v) in points[TRAIN_TAG].items()}
    curve.valid = {step: v for step, (_, v) in points[VALID_TAG].items()}
    return curve


def read_source(name: str, path: str) -> LossCurve:
    """A run's losses from a log file, an event file, or a directory holding either."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"loss source {path} does not exist")
    if _event_files(path):
        return read_tensorboard(path, name)
    files = [path] if os.path.isfile(path) else sorted(
        f for f in glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
        if os.path.isfile(f) and f.endswith(LOG_SUFFIXES))
    curve = LossCurve(name, path)
    for file in files:
        with open(file, "r", encoding="utf-8", errors="replace") as f:
            part = parse_log_text(f.read(), name, file)
        curve.train.update(part.train)
        curve.valid.update(part.valid)
    return curve


def sources_from_dir(directory: str) -> List[Tuple[str, str]]:
    """(run name, path) for each log file or sub-directory of a directory named by scheme."""
    out = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            out.append((entry, path))
        elif entry.endswith(LOG_SUFFIXES) or "tfevents" in entry:
            out.append((os.path.splitext(entry)[0] if "tfevents" not in entry else entry, path))
    return out


def parse_spec(spec: str) -> Tuple[str, str]:
    """`name=path` (or a bare path, named after its file or directory)."""
    if "=" in spec and not os.path.exists(spec):
        name, path = spec.split("=", 1)
        return name.strip(), path.strip()
    base = os.path.basename(spec.rstrip("/"))
    return os.path.splitext(base)[0] if os.path.isfile(spec) else base, spec


def load_curves(specs: List[str], directories: List[str], problems) -> List[LossCurve]:
    """Every readable loss curve; unreadable or empty sources are reported, not fatal."""
    pairs = [parse_spec(s) for s in specs]
    for directory in directories:
        if not os.path.isdir(directory):
            problems.add("missing_loss_source", f"loss directory {directory} does not exist")
            continue
        found = sources_from_dir(directory)
        if not found:
            problems.add("missing_loss_source", f"no loss logs or event files in {directory}")
        pairs.extend(found)
    curves = []
    for name, path in pairs:
        try:
            curve = read_source(name, path)
        except Exception as exc:
            problems.add("missing_loss_source", f"cannot read losses of {name} from {path}: "
                                                f"{exc}")
            continue
        if not curve.train and not curve.valid:
            problems.add("empty_loss_source", f"no 'lm loss' values found for {name} in {path}")
            continue
        log.info("loss curve %s: %d training and %d validation points from %s", name,
                 len(curve.train), len(curve.valid), path)
        curves.append(curve)
    return curves


def _gap(curve: Dict[int, float], base: Dict[int, float]):
    """(iteration compared at, value, baseline value): the last iteration both runs logged."""
    common = sorted(set(curve) & set(base))
    if common:
        it = common[-1]
        return it, curve[it], base[it]
    return None, None, None


def loss_table(curves: List[LossCurve], baseline: str) -> dict:
    """Final losses and their gap to the baseline run (statistics.json `losses`)."""
    base = next((c for c in curves if c.name == baseline), None)
    rows = []
    for c in curves:
        its, vals = c.series("train")
        v_its, v_vals = c.series("valid")
        window = vals[-max(1, len(vals) // 10):] if vals else []
        row = {"run": c.name, "source": c.source, "train_points": len(its),
               "validation_points": len(v_its),
               "final_iteration": its[-1] if its else None,
               "final_loss": vals[-1] if vals else None,
               "last_window_mean_loss": sum(window) / len(window) if window else None,
               "final_validation_iteration": v_its[-1] if v_its else None,
               "final_validation_loss": v_vals[-1] if v_vals else None,
               "compared_at_iteration": None, "gap_to_baseline": None,
               "relative_gap_to_baseline": None, "validation_gap_to_baseline": None}
        if base is not None:
            it, v, b = _gap(c.train, base.train)
            if it is not None:
                row.update(compared_at_iteration=it, gap_to_baseline=v - b,
                           relative_gap_to_baseline=(v - b) / b if b else None)
            it, v, b = _gap(c.valid, base.valid)
            if it is not None:
                row["validation_gap_to_baseline"] = v - b
        rows.append(row)
    return {"baseline": baseline if base is not None else None,
            "baseline_found": base is not None,
            "runs": {c.name: {"source": c.source,
                              "train": [[i, v] for i, v in zip(*c.series("train"))],
                              "validation": [[i, v] for i, v in zip(*c.series("valid"))]}
                     for c in curves},
            "table": rows}


def plot_losses(curves: List[LossCurve], baseline: str, outdir: str,
                colors: Optional[Dict[str, tuple]] = None) -> Optional[dict]:
    """Loss vs iteration per run, and the relative difference to the baseline."""
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((c for c in curves if c.name == baseline), None)
    rows = 2 if base is not None and len(curves) > 1 else 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 4 + 2.6 * (rows - 1)), squeeze=False,
                             sharex=True, layout="constrained")
    cmap = plt.get_cmap("tab10")
    ax = axes[0, 0]
    for i, c in enumerate(sorted(curves, key=lambda c: c.name)):
        color = (colors or {}).get(c.name, cmap(i % 10))
        its, vals = c.series("train")
        if its:
            ax.plot(its, vals, color=color, lw=1.4, label=f"{c.name} (train)",
                    marker="." if len(its) < 40 else None)
        v_its, v_vals = c.series("valid")
        if v_its:
            ax.plot(v_its, v_vals, color=color, ls="none", marker="D", ms=5,
                    markeredgecolor="black", label=f"{c.name} (validation)")
        if rows == 2 and c is not base:
            common = sorted(set(c.train) & set(base.train))
            rel = [100.0 * (c.train[t] - base.train[t]) / base.train[t] for t in common
                   if base.train[t]]
            if common:
                axes[1, 0].plot(common[:len(rel)], rel, color=color, lw=1.2, label=c.name)
    ax.set_ylabel("lm loss")
    ax.set_title("Training loss per quantization scheme")
    ax.grid(alpha=0.3, lw=0.5)
    ax.legend(fontsize=8, ncol=2)
    if rows == 2:
        axes[1, 0].axhline(0, color="black", lw=0.8)
        axes[1, 0].set_ylabel(f"relative to {baseline} [%]")
        axes[1, 0].set_title(f"Relative loss difference to {baseline}")
        axes[1, 0].grid(alpha=0.3, lw=0.5)
        axes[1, 0].legend(fontsize=8, ncol=3)
    axes[-1, 0].set_xlabel("iteration")
    path = os.path.join(outdir, "loss_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    caption = "Training loss (lines) and validation loss (diamonds) against iteration"
    if rows == 2:
        caption += (f"; below, (loss - {baseline} loss) / {baseline} loss in percent at the "
                    f"iterations both runs logged")
    return {"file": "loss_curves.png", "title": "Loss curves", "caption": caption + "."}
