#!/usr/bin/env python
"""Benchmark: analysing a capture vs just reading its files.

    python benchmarks/analysis.py --size-gb 1.0

Generates a synthetic full-mode capture of about --size-gb (four schemes, bf16 records,
format-exact manifests; in a temporary directory unless --dir is given), then times, once
with a warm page cache and once with the capture's files evicted from it:

    read      torch.load of every record listed in the manifests (nothing else)
    analyse   the per-record summaries of megatron.analysis (what scales with capture size)
              with 1 and 2 worker processes
    report    the whole visualiser (summaries + statistics + figures + report.html)

and prints wall and CPU seconds side by side with their ratios to the read time (CPU seconds
stay meaningful on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

from megatron.analysis import synthetic  # noqa: E402
from megatron.analysis.loading import Problems, discover, read_capture  # noqa: E402
from megatron.analysis.workers import run_batches  # noqa: E402

QUANT_SCHEMES = ("bf16", "FA_linear_mxfp8", "linear_mxfp4", "FA_linear_hifp8")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--size-gb", type=float, default=1.0,
                        help="Approximate size of the generated capture (default: %(default)s).")
    parser.add_argument("--dir", default=None,
                        help="Generate into (or reuse) this directory instead of a temporary "
                             "one.")
    parser.add_argument("--keep", action="store_true",
                        help="Keep the generated capture (only with a temporary directory).")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="Worker counts to time the analysis with (default: 1 2).")
    parser.add_argument("--repeat", type=int, default=1,
                        help="Repeat each timing and keep the fastest (default: %(default)s).")
    parser.add_argument("--skip-report", action="store_true",
                        help="Do not time the full visualiser run.")
    return parser


def _dims():
    # One iteration of one scheme is ~110 MB of bf16 records at these sizes.
    return dict(layers=2, seq=256, batch=4, hidden=1024, ffn=2816, heads=8, groups=4)


def generate(root: str, size_gb: float) -> None:
    dims = _dims()
    probe = os.path.join(root, "_probe")
    synthetic.write_capture(probe, quant_schemes=("FA_linear_mxfp8",), iterations=(1,), **dims,
                            reuse_tensors=True)
    per_iter = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(probe)
                   for f in fs)
    shutil.rmtree(probe)
    iters = max(1, round(size_gb * 1e9 / (per_iter * len(QUANT_SCHEMES))))
    print(f"generating {len(QUANT_SCHEMES)} schemes x {iters} iterations "
          f"(~{per_iter / 1e6:.0f} MB each) into {root}", flush=True)
    t0 = time.perf_counter()
    synthetic.write_capture(root, quant_schemes=QUANT_SCHEMES, iterations=range(1, iters + 1),
                            **dims, reuse_tensors=True)
    print(f"generated in {time.perf_counter() - t0:.1f} s", flush=True)


def entries_of(root: str):
    if not os.path.isdir(root):
        return []
    problems = Problems()
    entries = []
    for directory in discover([root], problems):
        entries.extend(read_capture(directory, problems).entries)
    return entries


def _load_all(paths):
    n = 0
    for path in paths:
        record = torch.load(path, map_location="cpu", weights_only=True)
        n += record["tensor"].numel()
    return n


def evict(paths) -> None:
    """Drop the capture's pages from the page cache (only these files) for a cold read."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (worker pools are joined)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
    """(wall seconds, CPU seconds) of fn()."""
    w0, c0 = time.perf_counter(), _cpu()
    fn()
    return time.perf_counter() - w0, _cpu() - c0


def read_all(paths, workers: int) -> None:
    if workers == 1:
        _load_all(paths)
    else:
        chunks = [paths[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_load_all, chunks))


def analyse(entries, workers: int) -> None:
    run_batches(entries, workers=workers, progress=False)


def report(root: str, workers: int) -> None:
    from megatron.analysis.pipeline import Options, analyze

    out = tempfile.mkdtemp(prefix="analysis_bench_out_")
    try:
        analyze(Options(tensor_dirs=[root], output_dir=out, workers=workers, progress=False))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def best(fn, prepare, repeat: int):
    """The fastest (by wall time) of `repeat` timings, each after prepare()."""
    runs = []
    for _ in range(max(1, repeat)):
        prepare()
        runs.append(timed(fn))
    return min(runs)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    root = args.dir or tempfile.mkdtemp(prefix="analysis_bench_")
    try:
        if not entries_of(root):
            generate(root, args.size_gb)
        entries = entries_of(root)
        paths = [e.path for e in entries if e.path]
        total = sum(e.bytes for e in entries)
        print(f"capture: {len(entries)} records, {total / 1e9:.2f} GB, {os.cpu_count()} cores")
        rows = []
        for cache in ("warm", "cold"):
            def prepare():
                if cache == "warm":
                    read_all(paths, 1)
                else:
                    evict(paths)
            steps = [("read (torch.load only), 1 process", lambda: read_all(paths, 1))]
            if max(args.workers) > 1:
                w = max(args.workers)
                steps.append((f"read (torch.load only), {w} processes",
                              lambda w=w: read_all(paths, w)))
            for w in args.workers:
                steps.append((f"analyse (per-record summaries), {w} worker(s)",
                              lambda w=w: analyse(entries, w)))
            if not args.skip_report:
                w = max(args.workers)
                steps.append((f"full visualiser (+statistics, figures, report), {w} worker(s)",
                              lambda w=w: report(root, w)))
            base = None
            for name, fn in steps:
                wall, cpu = best(fn, prepare, args.repeat)
                base = base or (wall, cpu)
                rows.append((cache, name, wall, cpu, base))
        print(f"\n{'cache':<5} {'step':<60} {'wall s':>7} {'cpu s':>7} {'GB/s':>6} "
              f"{'x read':>7} {'x read cpu':>10}")
        for cache, name, wall, cpu, (read_wall, read_cpu) in rows:
            print(f"{cache:<5} {name:<60} {wall:7.2f} {cpu:7.2f} {total / 1e9 / wall:6.2f} "
                  f"{wall / read_wall:7.2f} {cpu / read_cpu:10.2f}")
        print("x read: wall (cpu) seconds over those of 'read, 1 process' in the same page-cache "
              "state; cold = the capture's files evicted with posix_fadvise before each timing. "
              f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              "(other processes inflate wall times).")
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif args.dir is None:
            print(f"capture kept in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
