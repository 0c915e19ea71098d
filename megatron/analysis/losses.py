"""Loss curves of several training runs: parsing, final-loss gaps to a baseline, and a plot.

Sources, per run name:
- a training log: lines ` [date] iteration   N/  M | ... | lm loss: 7.008086E+00 | ...` and
  ` validation loss at iteration N | lm loss value: 6.790351E+00 | ...`;
- TensorBoard event files (scalar tags "lm loss" and "lm loss validation", as written by the
  training loop's SummaryWriter), given as a file or a directory searched recursively.
When a log is appended to by a resumed run, the last value logged for an iteration wins.

A gap to the baseline is never the difference at one iteration (a single batch's loss is
noisy): it is the difference of the mean losses over the last 10% of the iterations both runs
logged (at least 3), shown with the spread of the curves over that window. That spread is the
batch-to-batch wiggle (and the still-falling trend) of one run each, not seed-to-seed noise,
which one run per scheme cannot know: a note says so, and points to a multi-seed study.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.analysis import naming
from megatron.analysis.events import event_files, is_event_file, read_scalars
from megatron.analysis.intervals import mean_std

log = logging.getLogger("megatron.analysis")

TRAIN_TAG = "lm loss"
VALID_TAG = "lm loss validation"
_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf|-inf))"
_TRAIN_RE = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?\blm loss:\s*" + _NUMBER)
_VALID_RE = re.compile(r"validation loss at iteration\s+(\d+)\s*\|\s*lm loss value:\s*" + _NUMBER)
# The argument block training prints at start-up: `  lr ............ 0.003`.
_ARG_RE = re.compile(r"^\s{1,4}([a-z][a-z0-9_]*) \.{2,} (.*)$")
LOG_SUFFIXES = (".log", ".txt", ".out")
CAPTURE_LOG_SUFFIX = "-capture"
WINDOW_FRACTION = 0.1        # the gap is measured over the last 10% of common iterations,
MIN_WINDOW = 3               # and never over fewer than 3 points


@dataclass
class LossCurve:
    """Training and validation loss per iteration of one run."""

    name: str
    source: str
    train: Dict[int, float] = field(default_factory=dict)
    valid: Dict[int, float] = field(default_factory=dict)
    args: Dict[str, str] = field(default_factory=dict)    # the log's argument block
    explicit: bool = False       # named by the user (--loss-logs NAME=PATH), never renamed

    @property
    def label(self) -> Optional[str]:
        """The run's label as its log recorded it (`quant_config` of the argument block:
        the scheme, `recipe_<name>`, ...), None when the log has none."""
        value = (self.args.get("quant_config") or "").strip()
        return value if value and " " not in value and value != "None" else None

    @property
    def tensorboard_dir(self) -> Optional[str]:
        """The TensorBoard directory the run wrote (its argument block), None without."""
        value = (self.args.get("tensorboard_dir") or "").strip()
        return value if value and value != "None" else None

    def series(self, which: str = "train") -> Tuple[List[int], List[float]]:
        data = self.train if which == "train" else self.valid
        its = sorted(data)
        return its, [data[i] for i in its]


def parse_log_text(text: str, name: str = "run", source: str = "") -> LossCurve:
    """Training/validation losses (and the printed arguments) from a training log's text."""
    curve = LossCurve(name, source)
    for line in text.splitlines():
        match = _ARG_RE.match(line)
        if match:
            curve.args[match.group(1)] = match.group(2).strip()
            continue
        match = _VALID_RE.search(line)
        if match:
            curve.valid[int(match.group(1))] = float(match.group(2))
            continue
        match = _TRAIN_RE.search(line)
        if match:
            curve.train[int(match.group(1))] = float(match.group(2))
    return curve


def read_tensorboard(path: str, name: str) -> LossCurve:
    """Losses from TensorBoard event files (several files: by wall time, last value wins)."""
    scalars = read_scalars(event_files(path), lambda tag: tag in (TRAIN_TAG, VALID_TAG))
    return LossCurve(name, path, train=scalars.get(TRAIN_TAG, {}),
                     valid=scalars.get(VALID_TAG, {}))


def read_source(name: str, path: str) -> LossCurve:
    """A run's losses from a log file, an event file, or a directory holding either."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"loss source {path} does not exist")
    if event_files(path):
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
        curve.args.update(part.args)
    return curve


def sources_from_dir(directory: str) -> List[Tuple[str, str]]:
    """(run name, path) for each training log or run sub-directory of a directory named by
    scheme.

    Only run logs count: `{scheme}-capture.log` (the log of a capture run, as the demo writes
    beside the training log `{scheme}.log`) and text files without a training line (a
    collection's report.txt) are left out, and so are sub-directories that hold no log or
    event file themselves (a collection's tensorboard/, whose per-scheme directories are the
    same runs as its logs)."""
    out = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            if _holds_a_run(path):
                out.append((entry, path))
        elif is_event_file(entry):
            out.append((entry, path))
        elif _is_training_log(path):
            out.append((os.path.splitext(entry)[0], path))
    return out


def _is_training_log(path: str) -> bool:
    name = os.path.basename(path)
    if not name.endswith(LOG_SUFFIXES) or _is_capture_log(name):
        return False
    try:
        with open(path, errors="replace") as f:
            return any("lm loss" in line for line in f)
    except OSError:
        return False


def _holds_a_run(directory: str) -> bool:
    try:
        entries = os.listdir(directory)
    except OSError:
        return False
    return any(is_event_file(e) or _is_training_log(os.path.join(directory, e))
               for e in entries if os.path.isfile(os.path.join(directory, e)))


def _is_capture_log(file_name: str) -> bool:
    return os.path.splitext(file_name)[0].endswith(CAPTURE_LOG_SUFFIX)


def parse_spec(spec: str) -> Tuple[str, str, bool]:
    """(name, path, whether the user named it): `name=path`, or a bare path named after its
    file or directory."""
    name, path = naming.split_named(spec)
    if name is not None:
        return name, path, True
    base = os.path.basename(spec.rstrip("/"))
    return os.path.splitext(base)[0] if os.path.isfile(spec) else base, spec, False


def name_by_label(curves: List[LossCurve]) -> None:
    """Runs named after their files or directories take the label their log recorded (a
    log `nvfp4.log` of a `--quant-recipe nvfp4` run is `recipe_nvfp4`, as its capture is),
    unless two runs would then share a name: two runs recording one label (kept apart by
    their file names), or a label that is the name of a run that keeps its name. Runs the
    user named (NAME=PATH) keep their names."""
    wanted = Counter(c.label for c in curves if not c.explicit and c.label)
    renamed = {i for i, c in enumerate(curves) if not c.explicit and c.label
               and c.label != c.name and wanted[c.label] == 1}
    while True:     # a run that keeps its name can block another's rename, and so on
        kept = {c.name for i, c in enumerate(curves) if i not in renamed}
        blocked = {i for i in renamed if curves[i].label in kept}
        if not blocked:
            break
        renamed -= blocked
    for i in sorted(renamed):
        log.info("loss curve %s: named %s, the label its log recorded", curves[i].name,
                 curves[i].label)
        curves[i].name = curves[i].label


def load_curves(specs: List[str], directories: List[str], problems) -> List[LossCurve]:
    """Every readable loss curve; unreadable or empty sources are reported, not fatal.
    Curves are named by the label their logs recorded where the user gave no name."""
    sources = [parse_spec(s) for s in specs]
    for directory in directories:
        if not os.path.isdir(directory):
            problems.add("missing_loss_source", f"loss directory {directory} does not exist")
            continue
        found = sources_from_dir(directory)
        if not found:
            problems.add("missing_loss_source", f"no loss logs or event files in {directory}")
        sources.extend((name, path, False) for name, path in found)
    curves = []
    for name, path, explicit in sources:
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
        curve.explicit = explicit
        curves.append(curve)
    name_by_label(curves)
    return curves


def last_window(iterations: List[int]) -> List[int]:
    """The last 10% of `iterations` (sorted), at least MIN_WINDOW of them; [] if too few."""
    if len(iterations) < MIN_WINDOW:
        return []
    size = max(MIN_WINDOW, math.ceil(WINDOW_FRACTION * len(iterations)))
    return iterations[-size:]


def _mean_std(values: List[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (ddof 1: the spread of the curve in the window)."""
    stats = mean_std(values)
    return stats["mean"], stats["std"]


def gap(curve: Dict[int, float], base: Dict[int, float]) -> dict:
    """The gap of `curve` to `base` over the last window of the iterations both logged."""
    window = last_window(sorted(set(curve) & set(base)))
    if not window:
        common = len(set(curve) & set(base))
        return {"gap_to_baseline": None, "gap_window": None,
                "gap_note": f"{common} common iteration(s): too few for a gap (needs "
                            f"{MIN_WINDOW})"}
    mean, std = _mean_std([curve[i] for i in window])
    base_mean, base_std = _mean_std([base[i] for i in window])
    value = mean - base_mean
    spread = math.hypot(std, base_std)
    within = abs(value) <= spread
    return {"gap_window": [window[0], window[-1]], "gap_window_points": len(window),
            "gap_to_baseline": value, "gap_spread": spread,
            "relative_gap_to_baseline": value / base_mean if base_mean else None,
            "gap_within_noise": within,
            "gap_note": (("within" if within else "larger than") + " the curves' spread over "
                         "the window (one run each: seed-to-seed noise unknown; a study with "
                         "several seeds measures it)")}


def loss_table(curves: List[LossCurve], baseline: str) -> dict:
    """Final losses and their gap to the baseline run (statistics.json `losses`)."""
    base = next((c for c in curves if c.name == baseline), None)
    rows = []
    for c in curves:
        its, vals = c.series("train")
        v_its, v_vals = c.series("valid")
        window = last_window(its)
        mean, std = _mean_std([c.train[i] for i in window]) if window else (None, None)
        row = {"run": c.name, "source": c.source, "train_points": len(its),
               "validation_points": len(v_its),
               "final_iteration": its[-1] if its else None,
               "final_loss": vals[-1] if vals else None,
               "window": [window[0], window[-1]] if window else None,
               "window_mean_loss": mean, "window_std_loss": std,
               "final_validation_iteration": v_its[-1] if v_its else None,
               "final_validation_loss": v_vals[-1] if v_vals else None,
               "gap_to_baseline": None, "gap_spread": None, "relative_gap_to_baseline": None,
               "gap_within_noise": None, "gap_window": None, "gap_note": None,
               "validation_difference_to_baseline": None,
               "validation_compared_at_iteration": None}
        if base is not None and c is not base:
            row.update(gap(c.train, base.train))
            common = sorted(set(c.valid) & set(base.valid))
            if common:
                # One evaluation: a difference at that iteration, not a gap.
                row["validation_compared_at_iteration"] = common[-1]
                row["validation_difference_to_baseline"] = (c.valid[common[-1]]
                                                            - base.valid[common[-1]])
        rows.append(row)
    return {"baseline": baseline if base is not None else None,
            "baseline_found": base is not None,
            "window_fraction": WINDOW_FRACTION, "min_window": MIN_WINDOW,
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
    from megatron.analysis.plots import style      # matplotlib only when drawing

    with style():
        return _plot_losses(curves, baseline, outdir, colors)


def _plot_losses(curves: List[LossCurve], baseline: str, outdir: str,
                 colors: Optional[Dict[str, tuple]]) -> dict:
    import matplotlib.pyplot as plt

    base = next((c for c in curves if c.name == baseline), None)
    rows = 2 if base is not None and len(curves) > 1 else 1
    fig, axes = plt.subplots(rows, 1, figsize=(10.4, 4.4 + 2.8 * (rows - 1)), squeeze=False,
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
    ax.legend(ncol=2)
    if rows == 2:
        window = last_window(sorted(base.train))
        if window:
            for axis in axes[:, 0]:
                axis.axvspan(window[0], window[-1], color="#adb5bd", alpha=0.25, lw=0,
                             label="gap window" if axis is axes[1, 0] else None)
        axes[1, 0].axhline(0, color="black", lw=0.8)
        axes[1, 0].set_ylabel(f"relative to {baseline} [%]")
        axes[1, 0].set_title(f"Relative loss difference to {baseline}")
        axes[1, 0].grid(alpha=0.3, lw=0.5)
        axes[1, 0].legend(ncol=3)
    axes[-1, 0].set_xlabel("iteration")
    path = os.path.join(outdir, "loss_curves.png")
    try:
        from megatron.analysis.plots import escape_figure_text
        escape_figure_text(fig)      # run names are user input: a `$` must stay a `$`
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    caption = "Training loss (lines) and validation loss (diamonds) against iteration"
    if rows == 2:
        caption += (f"; below, (loss - {baseline} loss) / {baseline} loss in percent at the "
                    f"iterations both runs logged. Grey: the window of the last "
                    f"{WINDOW_FRACTION:.0%} of iterations (at least {MIN_WINDOW}) over which "
                    f"gaps are averaged")
    return {"file": "loss_curves.png", "title": "Loss curves", "caption": caption + "."}
