"""Cost of tensor capture: step time off / stats / full, and writer throughput.

    python benchmarks/capture.py [--iters 6] [--global-batch-size 8] [--micro-batches 1]
                                 [--scheme FA_linear_mxfp8] [--rounds 2] [--json out.json]

1. Step time. The same llama-tiny run (mock data, same seed; by default 8 micro-batches of one
   sequence per iteration) in this process with capture off, with --tensor-save-mode stats
   and with --tensor-save-mode full, both with --control-iter 0 (every iteration) and
   --collect-micro-batches M, interleaved over --rounds rounds. The first iterations of each
   run are warm-up; the median of the others is reported as wall time and as CPU time of the
   training thread (less sensitive to other processes on a shared machine), with ratios to
   the run without capture. Full mode includes back-pressure from the writer (stall).
2. Writer throughput. The records of the last full run are loaded back and pushed through a
   fresh CaptureWriter (statistics already computed, as the training step does in full
   mode), timed from the first submit to the drained queue; the baseline writes the same
   bytes (the serialized record files) sequentially with plain open/write, one file per
   record, in the same file system.

Targets: stats mode <= 1.15x the step time without capture; writer >= 50% of plain writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.tensor_capture.load import load_record, read_manifest  # noqa: E402
from megatron.tensor_capture.records import CaptureItem  # noqa: E402
from megatron.tensor_capture.writer import CaptureWriter  # noqa: E402
from megatron.training.training import TrainingCallback, pretrain  # noqa: E402

MODEL_ARGS = [
    "--model-preset", "llama-tiny", "--micro-batch-size", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "2048",
    "--lr", "3e-4", "--log-interval", "1000", "--eval-interval", "100000", "--eval-iters", "0",
    "--num-workers", "0",
]


class StepTimer(TrainingCallback):
    """Wall time and training-thread CPU time of each iteration.

    The CPU time of the training thread (time.thread_time) is what the step costs when the
    machine is shared: other processes inflate wall time, not it. It leaves out the writer
    thread, whose work runs beside the step (its busy time is in the run summary).
    """

    def __init__(self):
        self.wall, self.cpu = {}, {}
        self._start = None

    def on_iteration_start(self, iteration):
        self._start = (time.perf_counter(), time.thread_time())

    def on_iteration_end(self, iteration):
        self.wall[iteration] = time.perf_counter() - self._start[0]
        self.cpu[iteration] = time.thread_time() - self._start[1]


def timed_run(argv, warmup):
    """(wall seconds per timed iteration, training-thread CPU seconds per timed iteration)."""
    timer = StepTimer()
    result = pretrain(pretrain_gpt.forward_step, argv, callbacks=[timer])
    assert result.exit_code == 0, result.exit_reason
    keep = [it for it in sorted(timer.wall) if it > warmup]
    return [timer.wall[it] for it in keep], [timer.cpu[it] for it in keep]


def writer_throughput(capture_dir, out_dir):
    """(writer MiB/s, plain MiB/s, records, bytes) on the records of a full-mode run."""
    entries = [e for e in read_manifest(capture_dir) if e["path"]]
    records = [load_record(e["path"]) for e in entries]
    blobs = []
    for e in entries:
        with open(e["path"], "rb") as f:
            blobs.append(f.read())
    total = sum(len(b) for b in blobs)
    items = []
    for e, rec in zip(entries, records):
        items.append(CaptureItem(metadata=dict(rec["metadata"]), file_name=e["file"],
                                 tensor=rec["tensor"], quantized=rec.get("quantized"),
                                 tensor_info=rec["tensor_info"],
                                 quant_error=rec.get("quant_error")))
    writer_dir = os.path.join(out_dir, "writer")
    plain_dir = os.path.join(out_dir, "plain")
    os.makedirs(writer_dir)
    os.makedirs(plain_dir)

    start = time.perf_counter()
    writer = CaptureWriter(writer_dir, os.path.join(writer_dir, "manifest.jsonl"),
                           max_records=256, max_bytes=1 << 30)
    for item in items:
        writer.submit(item)
    writer.close()
    writer_s = time.perf_counter() - start
    assert writer.error is None, writer.error

    start = time.perf_counter()
    for e, blob in zip(entries, blobs):
        with open(os.path.join(plain_dir, e["file"]), "wb") as f:
            f.write(blob)
    plain_s = time.perf_counter() - start
    mib = total / 2 ** 20
    return mib / writer_s, mib / plain_s, len(items), total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=6, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="iterations not timed")
    parser.add_argument("--scheme", default="FA_linear_mxfp8", help="--quant-scheme")
    parser.add_argument("--global-batch-size", type=int, default=8,
                        help="global batch = micro-batches per iteration (micro-batch size 1)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="--collect-micro-batches (1 is the default of the flag; pass the "
                             "global batch size to capture every micro-batch)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per mode, interleaved (off, stats, full, off, ...)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    opts = parser.parse_args()

    work = tempfile.mkdtemp(prefix="capture-bench-")
    base = MODEL_ARGS + ["--train-iters", str(opts.iters), "--quant-scheme", opts.scheme,
                         "--global-batch-size", str(opts.global_batch_size)]
    capture = ["--save-tensors", "--control-iter", "0",
               "--collect-micro-batches", str(opts.micro_batches)]
    modes = {"off": [], "stats": ["--tensor-save-mode", "stats"],
             "full": ["--tensor-save-mode", "full"]}
    wall = {mode: [] for mode in modes}
    cpu = {mode: [] for mode in modes}
    try:
        for r in range(opts.rounds):
            for mode, flags in modes.items():
                argv = base if mode == "off" else base + capture + flags + [
                    "--tensor-save-dir", os.path.join(work, f"{mode}{r}")]
                w, c = timed_run(argv, opts.warmup)
                wall[mode] += w
                cpu[mode] += c
        writer_mibs, plain_mibs, n, total = writer_throughput(
            os.path.join(work, f"full{opts.rounds - 1}", opts.scheme), os.path.join(work, "w"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: {m: statistics.median(v[m]) for m in modes} for k, v in (("wall", wall),
                                                                          ("cpu", cpu))}
    # The fastest iteration of each mode: the one least disturbed by other processes.
    best = {m: min(wall[m]) for m in modes}
    figures = {
        "scheme": opts.scheme, "iterations": opts.iters, "warmup": opts.warmup,
        "rounds": opts.rounds, "micro_batches_per_iteration": opts.global_batch_size,
        "collect_micro_batches": opts.micro_batches,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "step_wall_s": med["wall"], "step_cpu_s": med["cpu"], "step_wall_min_s": best,
        "step_wall_all_s": wall,
        "ratio_wall": {m: med["wall"][m] / med["wall"]["off"] for m in modes},
        "ratio_cpu": {m: med["cpu"][m] / med["cpu"]["off"] for m in modes},
        "writer_mib_s": writer_mibs, "plain_mib_s": plain_mibs,
        "writer_vs_plain": writer_mibs / plain_mibs, "records": n, "bytes": total,
    }
    for kind in ("wall", "cpu"):
        m = med[kind]
        print(f"step {kind} time (median, {opts.scheme}, {opts.micro_batches} of "
              f"{opts.global_batch_size} micro-batches captured): off {m['off'] * 1000:.0f} ms "
              f"| stats {m['stats'] * 1000:.0f} ms ({m['stats'] / m['off']:.2f}x, target "
              f"<= 1.15x) | full {m['full'] * 1000:.0f} ms ({m['full'] / m['off']:.2f}x)")
    print(f"step wall time (fastest iteration): off {best['off'] * 1000:.0f} ms | stats "
          f"{best['stats'] * 1000:.0f} ms ({best['stats'] / best['off']:.2f}x) | full "
          f"{best['full'] * 1000:.0f} ms ({best['full'] / best['off']:.2f}x)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    figures["load_average_1min"] = load
    print(f"machine load average (1 min) at the end: {load:.1f}")
    print(f"writer: {writer_mibs:.0f} MiB/s vs plain sequential write {plain_mibs:.0f} MiB/s "
          f"({100 * writer_mibs / plain_mibs:.0f}%, target >= 50%) over {n} records, "
          f"{total / 2 ** 20:.1f} MiB")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
