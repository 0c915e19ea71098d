"""Command line of the tensor visualiser (tools/visualization/tensor_visualizer.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from megatron.analysis.intlists import parse_int_list
from megatron.analysis.pipeline import Options, analyze
from megatron.analysis.study import load_study


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensor_visualizer.py",
        description="Analyse tensor captures, loss logs and quantization telemetry of "
                    "low-precision training runs: "
                    "writes statistics.json, statistics.txt, records.csv, figures/*.png and a "
                    "self-contained report.html.",
        allow_abbrev=False)
    parser.add_argument("--tensor-dir", nargs="+", default=[], metavar="DIR",
                        help="Capture directories: a --tensor-save-dir (one sub-directory per "
                             "scheme) or a single scheme directory; several allowed.")
    parser.add_argument("--output-dir", default="reports/analysis", metavar="OUT",
                        help="Where to write the report, statistics and figures "
                             "(default: %(default)s).")
    # --quant-types is the original system's spelling, kept as an alias.
    parser.add_argument("--quant-schemes", "--quant-types", dest="quant_schemes", nargs="+",
                        default=None, metavar="SCHEME",
                        help="Quantization schemes (e.g. bf16 FA_linear_mxfp8) to analyse; "
                             "default: all found. --quant-types is an alias (the original "
                             "name).")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="Worker processes that read and summarise records in parallel "
                             "(default: %(default)s; 1 = in this process).")
    parser.add_argument("--layers", default=None, metavar="LIST",
                        help="Only these layers, e.g. '1,2,5-8' (0 = output layer).")
    parser.add_argument("--iterations", default=None, metavar="LIST",
                        help="Only these captured iterations, e.g. '1-3'.")
    parser.add_argument("--operations", nargs="+", choices=("forward", "backward"),
                        default=None, help="Only forward or backward records.")
    parser.add_argument("--max-records", type=int, default=None, metavar="N",
                        help="At most N records per scheme, evenly spread (a quick look at "
                             "a large capture).")
    parser.add_argument("--manifest-only", action="store_true",
                        help="Use only the statistics in the manifests (no record files read): "
                             "fast, but without value histograms.")
    parser.add_argument("--loss-logs", nargs="+", default=[], metavar="NAME=PATH",
                        help="Loss sources, one per run: NAME=PATH where PATH is a training log, "
                             "a TensorBoard event file or a directory holding either (a bare "
                             "PATH is named after its file).")
    parser.add_argument("--loss-dir", nargs="+", default=[], metavar="DIR",
                        help="Directories whose log files / sub-directories are named by scheme "
                             "(bf16.log, FA_linear_mxfp8/, ...), one run each; a training log "
                             "that records its run's label (its argument block's quant_config) "
                             "is named by that label.")
    parser.add_argument("--loss-baseline", default="bf16", metavar="NAME",
                        help="Run the final-loss gaps are measured against (default: "
                             "%(default)s).")
    parser.add_argument("--tensorboard-dir", nargs="+", default=[], metavar="DIR",
                        help="TensorBoard directories holding the quantization telemetry "
                             "training writes with --quant-stats-interval (quant/... scalars): "
                             "a --tensorboard-dir of one run, or a parent with one "
                             "sub-directory per scheme (the demo's tensorboard/). A run is "
                             "named by the label of the training log that wrote it (given as "
                             "a loss source), else by its directory; NAME=DIR names the run "
                             "in DIR.")
    parser.add_argument("--study", default=None, metavar="STUDY_JSON",
                        help="A tools/study.py study.json: its table (final losses over seeds, "
                             "paired gaps with 95%% intervals, verdicts) and loss-curve figure "
                             "become a section of the report.")
    parser.add_argument("--no-figures", action="store_true",
                        help="Skip the PNG figures (statistics and report tables only).")
    parser.add_argument("--no-progress", action="store_true",
                        help="Do not draw a progress bar.")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="Logging verbosity (default: %(default)s).")
    return parser


def options_from_args(args) -> Options:
    return Options(
        tensor_dirs=list(args.tensor_dir), output_dir=args.output_dir,
        quant_schemes=args.quant_schemes, workers=max(1, args.workers),
        progress=not args.no_progress, layers=parse_int_list(args.layers),
        iterations=parse_int_list(args.iterations), operations=args.operations,
        max_records=args.max_records, manifest_only=args.manifest_only,
        loss_logs=list(args.loss_logs), loss_dirs=list(args.loss_dir),
        loss_baseline=args.loss_baseline, tensorboard_dirs=list(args.tensorboard_dir),
        study=args.study, figures=not args.no_figures)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.tensor_dir or args.loss_logs or args.loss_dir or args.tensorboard_dir
            or args.study):
        parser.error("give --tensor-dir, --loss-logs / --loss-dir, --tensorboard-dir and/or "
                     "--study")
    if args.study:
        try:
            load_study(args.study)       # a bad file is one line before any work
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        result = analyze(options_from_args(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not result.produced:
        print(f"error: nothing could be analysed: {result.error}", file=sys.stderr)
        return 1
    print(f"report: {os.path.join(result.output_dir, 'report.html')}"
          f"{f' ({len(result.problems)} problems, see the report)' if result.problems else ''}")
    return 0
