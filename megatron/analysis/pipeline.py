"""The analysis run: captures, loss logs and telemetry -> statistics.json/.txt, records.csv,
PNGs and report.html.

`analyze(options)` never raises for bad input: problems (missing or empty directories,
truncated or malformed manifest lines, unknown format versions, unreadable records, requested
schemes without data, unreadable loss logs, TensorBoard directories without telemetry) are
logged, listed in statistics.json and the report, and
whatever is valid is analysed. `AnalysisResult.produced` says whether anything was written.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import List, Optional

from megatron.analysis import losses as loss_mod
from megatron.analysis import study as study_mod
from megatron.analysis import (explain, glance, naming, plots, provenance, report, statistics,
                               tables, telemetry, telemetry_plots, textreport)
from megatron.analysis.comparison import common_tensors
from megatron.analysis.loading import Problems, read_captures
from megatron.analysis.ranges import format_ranges
from megatron.analysis.workers import BatchResult, run_batches

log = logging.getLogger("megatron.analysis")


@dataclass
class Options:
    """What to analyse and where to write it (mirrors the CLI flags)."""

    tensor_dirs: List[str] = field(default_factory=list)
    output_dir: str = "reports/analysis"
    quant_schemes: Optional[List[str]] = None
    workers: int = 1
    progress: bool = True
    layers: Optional[List[int]] = None
    iterations: Optional[List[int]] = None
    operations: Optional[List[str]] = None
    max_records: Optional[int] = None
    manifest_only: bool = False
    loss_logs: List[str] = field(default_factory=list)
    loss_dirs: List[str] = field(default_factory=list)
    loss_baseline: str = "bf16"
    tensorboard_dirs: List[str] = field(default_factory=list)
    study: Optional[str] = None          # a tools/study.py study.json
    figures: bool = True


@dataclass
class AnalysisResult:
    produced: bool
    error: Optional[str]
    statistics: Optional[dict]
    output_dir: str
    problems: Problems


def _telemetry(directories: List[str], quant_schemes: Optional[List[str]], problems: Problems,
               names: Optional[dict] = None):
    """The quantization telemetry of the --tensorboard-dir directories (None without any);
    `names` {run directory: label} names runs by their training logs' labels."""
    if not directories:
        return None
    present = []
    for spec in directories:
        directory = naming.split_named(spec)[1]
        if not os.path.exists(directory):
            problems.add("missing_telemetry_source", f"TensorBoard directory {directory} does "
                                                     "not exist")
        else:
            present.append(spec)
    if not present:
        return None
    frame = telemetry.load_stats_frame(present, schemes=quant_schemes, names=names)
    if frame.empty:
        problems.add("empty_telemetry_source",
                     f"no quantization telemetry (quant/... scalars) in {', '.join(present)}; "
                     "training writes it with --quant-stats-interval N")
    if frame.attrs.get("unparsed_tags"):
        tags = frame.attrs["unparsed_tags"]
        problems.add("bad_telemetry_tag", f"{len(tags)} quant/ tag(s) do not follow "
                                          f"quant/<site>/<gemm>.<operand>/<metric> and are left "
                                          f"out, e.g. {tags[0]!r}")
    return frame


def _unmatched_names(captures, curves, frame, problems: Problems) -> None:
    """One problem line per telemetry or loss run whose name matches no capture while a
    capture has no such run: one run under two names (naming.py)."""
    captured = {c.quant_scheme for c in captures if c.entries}
    if frame is not None and not frame.empty:
        for line in naming.unmatched("telemetry", frame.attrs["runs"],
                                     captured | {c.name for c in curves}, "--tensorboard-dir"):
            problems.add(naming.UNMATCHED, line)
    if captured:
        runs = [(c.name, c.source) for c in curves if not c.explicit]
        for line in naming.unmatched("loss", runs, captured, "--loss-logs"):
            problems.add(naming.UNMATCHED, line)


def _wanted(label: str, wanted: List[str]) -> bool:
    return label in wanted or label.split("@")[0] in wanted


def _select(entries, options: Options, problems: Problems):
    """Entries passing the filters; --max-records keeps an even spread per scheme."""
    def keep(e):
        m = e.metadata
        if options.quant_schemes and not _wanted(e.quant_scheme, options.quant_schemes):
            return False
        if options.layers is not None and m.get("layer_idx") not in options.layers:
            return False
        if options.iterations is not None and m.get("iteration") not in options.iterations:
            return False
        if options.operations and m.get("operation") not in options.operations:
            return False
        return True

    chosen = [e for e in entries if keep(e)]
    if options.quant_schemes:
        found = ({e.quant_scheme for e in chosen}
                 | {e.quant_scheme.split("@")[0] for e in chosen})
        for scheme in options.quant_schemes:
            if scheme not in found:
                problems.add(statistics.SCHEME_WITHOUT_DATA,
                             f"quant type {scheme} has no records in the given capture "
                             f"directories (after filters); it is left out")
    if options.max_records:
        by_scheme = {}
        for e in chosen:
            by_scheme.setdefault(e.quant_scheme, []).append(e)
        chosen = []
        for items in by_scheme.values():
            step = max(1, len(items) // options.max_records)
            chosen.extend(items[::step][:options.max_records])
    return chosen


def _study_figure(study_json: str, figure_dir: str) -> Optional[dict]:
    """The study's own figure (study.png beside study.json), copied among the figures."""
    source = os.path.join(os.path.dirname(study_json), "study.png")
    if not os.path.isfile(source):
        return None
    shutil.copyfile(source, os.path.join(figure_dir, "study_curves.png"))
    return {"file": "study_curves.png", "title": "Scheme study: loss curves over seeds",
            "caption": "Mean over seeds per scheme, band from the lowest to the highest seed "
                       "(tools/study.py)."}


def mx_scale_modes(entries) -> dict:
    """{scheme: 'floor' | 'rceil' | 'floor, rceil'}: the MX scale rule of each scheme's MX
    records (the explanation of MX saturation depends on it)."""
    modes: dict = {}
    for entry in entries:
        fmt = entry.metadata.get("format")
        if fmt and fmt != "none" and format_ranges(fmt).kind == "mx":
            modes.setdefault(entry.quant_scheme, set()).add(
                str(entry.metadata.get("scale_mode") or "floor"))
    return {scheme: ", ".join(sorted(found)) for scheme, found in sorted(modes.items())}


def _first_screen(doc: dict, figure_dir: Optional[str], problems: Problems) -> None:
    """What the report opens with, added to `doc`: the per-layer picture (drawn from the
    document, so after it is built; not without figures), the explanations of the alarming
    numbers and the summary table."""
    if figure_dir:
        picture = plots.drawn_or_problem(lambda: glance.draw(doc, figure_dir), "layer_overview")
        if picture and "problem" in picture:
            problems.add("figure_failed", picture["problem"])
            doc["problems"] = list(problems.items)
        elif picture:
            doc["figures"].insert(0, picture)
            doc["outputs"].append(f"figures/{picture['file']}")
    doc["explanations"] = explain.explanations(doc)
    summary = tables.summary_table(doc)
    doc[tables.SUMMARY_KEY] = tables.explained(summary, doc).as_json() if summary else None


def analyze(options: Options) -> AnalysisResult:
    t_start = time.perf_counter()
    problems = Problems()
    outdir = options.output_dir
    captures = read_captures(options.tensor_dirs, problems) if options.tensor_dirs else []
    entries = [entry for capture in captures for entry in capture.entries]
    log.info("%d capture directories, %d manifest records", len(captures), len(entries))
    selected = _select(entries, options, problems)
    t_manifest = time.perf_counter()
    result = (run_batches(selected, options.workers, options.progress,
                          use_tensors=not options.manifest_only)
              if selected else BatchResult())
    # Workers finish in any order; sorted problems keep reports reproducible.
    problems.extend(sorted(result.problems, key=lambda p: p["message"]))
    t_summary = time.perf_counter()

    curves = loss_mod.load_curves(options.loss_logs, options.loss_dirs, problems)
    telemetry_frame = _telemetry(options.tensorboard_dirs, options.quant_schemes, problems,
                                 naming.telemetry_names(curves))
    _unmatched_names(captures, curves, telemetry_frame, problems)
    has_telemetry = telemetry_frame is not None and not telemetry_frame.empty
    study_doc = study_mod.load_study(options.study) if options.study else None
    if not result.groups and not curves and not has_telemetry and not study_doc:
        reason = ("no valid capture records" if options.tensor_dirs else "no capture directory")
        if options.loss_logs or options.loss_dirs:
            reason += " and no readable loss logs"
        if options.tensorboard_dirs:
            reason += " and no quantization telemetry"
        first = problems.items[0]["message"] if problems.items else "nothing to analyse"
        return AnalysisResult(False, f"{reason} ({first})", None, outdir, problems)

    figure_dir = os.path.join(outdir, "figures")
    os.makedirs(figure_dir, exist_ok=True)
    figures = []
    schemes = statistics.quant_schemes_of(result.groups)
    telemetry_schemes = sorted(telemetry_frame["scheme"].unique()) if has_telemetry else []
    color_names = sorted(set(schemes) | {c.name for c in curves} | set(telemetry_schemes))
    colors = plots.scheme_colors(color_names)
    common = common_tensors(result.groups)
    if options.figures and result.groups:
        figures = plots.make_all(result.groups, figure_dir, schemes, workers=options.workers,
                                 color_names=color_names, common=common)
    losses_doc = None
    if curves:
        losses_doc = loss_mod.loss_table(curves, options.loss_baseline)
        if not losses_doc["baseline_found"]:
            problems.add("loss_baseline_missing",
                         f"loss baseline {options.loss_baseline} is not among the runs "
                         f"({', '.join(c.name for c in curves)}); no gaps computed")
        if options.figures:
            fig = plots.drawn_or_problem(lambda: loss_mod.plot_losses(
                curves, options.loss_baseline, figure_dir, colors=colors), "loss_curves")
            if fig:
                figures.insert(0, fig)
    telemetry_doc = None
    if has_telemetry:
        telemetry_doc = telemetry.summary(telemetry_frame, options.tensorboard_dirs)
        if options.figures:
            position = 1 if curves else 0
            figures[position:position] = telemetry_plots.make_all(telemetry_frame, figure_dir,
                                                                  colors)
    if study_doc and options.figures:
        figure = _study_figure(options.study, figure_dir)
        if figure:
            figures.insert(0, figure)
    for failed in [f for f in figures if "problem" in f]:   # drawn_or_problem: that figure only
        problems.add("figure_failed", failed["problem"])
    figures = [f for f in figures if "problem" not in f]
    t_figures = time.perf_counter()
    timing = {"manifests_seconds": round(t_manifest - t_start, 3),
              "summaries_seconds": round(t_summary - t_manifest, 3),
              "record_load_seconds_summed_over_workers": round(result.seconds_load, 3),
              "record_compute_seconds_summed_over_workers": round(result.seconds_compute, 3),
              "figures_seconds": round(t_figures - t_summary, 3),
              "workers": options.workers, "records": result.records,
              "bytes": result.bytes}
    inputs = {"tensor_dirs": list(options.tensor_dirs),
              "capture_dirs": [c.directory for c in captures],
              statistics.OUTPUT_REQUESTED_KEY: options.quant_schemes,
              "filters": {"layers": options.layers, "iterations": options.iterations,
                          "operations": options.operations, "max_records": options.max_records,
                          "manifest_only": options.manifest_only},
              "loss_sources": [c.source for c in curves],
              "loss_baseline": options.loss_baseline,
              "tensorboard_dirs": list(options.tensorboard_dirs)}
    iterations = {}
    for entry in selected:
        iterations.setdefault(entry.quant_scheme, set()).add(entry.metadata["iteration"])
    origin = provenance.build(captures, curves, schemes, iterations, telemetry_schemes)
    outputs = ["statistics.json", "statistics.txt"] + (["records.csv"] if result.rows else []) \
        + ["report.html"] + [f"figures/{f['file']}" for f in figures]
    doc = statistics.build(result, captures, problems, inputs, losses_doc, figures, timing,
                           provenance=origin, telemetry=telemetry_doc, outputs=outputs,
                           common=common)
    if study_doc:
        doc["study"] = study_doc
    doc["mx_scale_modes"] = mx_scale_modes(selected)
    _first_screen(doc, figure_dir if options.figures else None, problems)
    statistics.write_json(os.path.join(outdir, "statistics.json"), doc)
    with open(os.path.join(outdir, "statistics.txt"), "w", encoding="utf-8") as f:
        f.write(textreport.render(doc))
    if result.rows:
        statistics.write_records_csv(os.path.join(outdir, "records.csv"), result.rows)
    report.write(doc, outdir)
    log.info("wrote %s (%s) in %.1f s", outdir, ", ".join(o for o in outputs
                                                         if not o.startswith("figures/"))
             + f", {len(figures)} figures", time.perf_counter() - t_start)
    return AnalysisResult(True, None, doc, outdir, problems)
