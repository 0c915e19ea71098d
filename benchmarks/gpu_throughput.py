"""Training step time of the simulated schemes against bf16 at the depth users train: ms per
step, the ratio to bf16, peak memory and where the device time goes, one process per run.

Defaults: llama32-1b at its full depth (16 layers), seq 8192, micro-batch 1, mock data, bf16
training, `--quant-kernels auto`; `--num-layers N` makes it shallower, `--tiny` (the default
without CUDA) takes llama-tiny at seq 256, which runs on any machine. Schemes and targets (step
time x bf16):

    bf16                  the baseline
    linear_mxfp8          --quant-scheme linear_mxfp8                          <= 1.10x
    recipe_nvfp4          --quant-recipe nvfp4                                 <= 1.25x
    fp8_tensorwise        --fp8-format hybrid --fp8-recipe tensorwise          <= 1.10x
                          (FP8 current scaling, one scale per tensor)
    FA_linear_mxfp8       --quant-scheme FA_linear_mxfp8 --attn-pv-quant mxfp8  <= 2.0x
    recipe_mxfp4_rht_sr   --quant-recipe mxfp4_rht_sr

Modes (--quant-kernels; default auto only): eager (plain PyTorch quantization, the chunked
attention path); auto (on CUDA with triton, the fused Triton kernels; eager elsewhere);
compile (fake quantization through torch.compile). bf16 runs once, in the first mode.

Each (scheme, mode) trains in its own child process (this script with --one), so the peak
memory and the allocator state of one run never reach the next. A run trains --warmup +
--iters + 1 steps from the same initialisation: ms/step is the median of the --iters steps
after the warm-up; the last step runs under torch.profiler and is split into GEMM, attention,
quantization and other time. On CUDA that is the device time of the kernels, classified by
kernel name (`kernel_class`); on a CPU it is the CPU self time of the aten ops, classified the
same way (there the eager QDQ's elementwise ops count as other). Peak memory is
torch.cuda.max_memory_allocated of the run (0 on a CPU). A run that fails or runs past its
time limit is a row with its error; the others still run. Prints a markdown table; --json
writes every row (after each run, so an interrupted call keeps the rows it has).

    python benchmarks/gpu_throughput.py                    # GPU: llama32-1b, 16 layers
    python benchmarks/gpu_throughput.py --num-layers 2 --modes eager auto compile
    python benchmarks/gpu_throughput.py --tiny             # any machine: llama-tiny, seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (REPO_ROOT, BENCH_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpu_check import child_env, run_limited, tail  # noqa: E402

# In the order they run: the schemes with a target first, so that a call out of time loses
# the one without.
SCHEMES = {
    "bf16": [],
    "linear_mxfp8": ["--quant-scheme", "linear_mxfp8"],
    "recipe_nvfp4": ["--quant-recipe", "nvfp4"],
    "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "FA_linear_mxfp8": ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"],
    "recipe_mxfp4_rht_sr": ["--quant-recipe", "mxfp4_rht_sr"],
}
TARGETS = {"linear_mxfp8": 1.10, "recipe_nvfp4": 1.25, "fp8_tensorwise": 1.10,
           "FA_linear_mxfp8": 2.0}
MODES = ("eager", "auto", "compile")
GPU_MODEL = ["--model-preset", "llama32-1b", "--seq-length", "8192", "--micro-batch-size", "1",
             "--global-batch-size", "1"]
TINY_MODEL = ["--model-preset", "llama-tiny", "--seq-length", "256", "--micro-batch-size", "4",
              "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "8191"]
CLASSES = ("gemm", "attention", "quantization", "other")
# Kernel (CUDA) or op (CPU) names, lower case, by class; the first class that matches wins.
_ATTENTION = re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention|"
                        r"^_(forward|backward_key|backward_query)_kernel$")
_QUANTIZATION = re.compile(r"qdq|amax|^fp8_(tensor|block)_kernel$")
_GEMM = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|matmul|^aten::(mm|addmm|bmm|baddbmm|"
                   r"_scaled_mm|linear)$")


def kernel_class(name: str) -> str:
    """'gemm', 'attention', 'quantization' or 'other' for a CUDA kernel's or an aten op's
    name (cuDNN's SDPA kernels are attention even where their names hold a GEMM's words)."""
    name = name.strip().lower()
    for label, pattern in (("attention", _ATTENTION), ("quantization", _QUANTIZATION),
                           ("gemm", _GEMM)):
        if pattern.search(name):
            return label
    return "other"


# ---------------------------------------------------------------------------------------------
# One run (the child process)
# ---------------------------------------------------------------------------------------------

def breakdown(events, on_cuda: bool) -> dict:
    """{class: ms} of the profiled step: kernels' device time on CUDA, ops' CPU self time on a
    CPU; user annotations are left out (their time is their children's)."""
    from torch.autograd import DeviceType

    totals = dict.fromkeys(CLASSES, 0.0)
    for evt in events:
        if getattr(evt, "is_user_annotation", False) or evt.name.startswith("ProfilerStep"):
            continue
        if on_cuda and evt.device_type != DeviceType.CPU:    # a kernel, a copy or a memset
            totals[kernel_class(evt.name)] += evt.time_range.elapsed_us() / 1e3
        elif not on_cuda and evt.device_type == DeviceType.CPU:
            totals[kernel_class(evt.name)] += evt.self_cpu_time_total / 1e3
    return totals


def _callbacks(profile_at: int, on_cuda: bool):
    """(a step timer that waits for the device, a callback profiling step `profile_at`)."""
    import torch
    from megatron.training.training import TrainingCallback
    from step_timer import StepTimer

    sync = torch.cuda.synchronize if on_cuda else (lambda: None)

    class SyncedTimer(StepTimer):
        def on_iteration_start(self, iteration):
            sync()
            super().on_iteration_start(iteration)

        def on_iteration_end(self, iteration):
            sync()
            return super().on_iteration_end(iteration)

    class Profiled(TrainingCallback):
        """events: the profiled step's events; None when the profiler could not run (the
        run's timings are still worth their row)."""

        def __init__(self):
            self.profile = self.events = None

        def on_iteration_start(self, iteration):
            if iteration != profile_at:
                return
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
            try:
                self.profile = torch.profiler.profile(activities=activities)
                self.profile.start()
            except Exception as exc:
                print(f"[bench] no profile: {type(exc).__name__}: {exc}", flush=True)
                self.profile = None

        def on_iteration_end(self, iteration):
            if iteration == profile_at and self.profile is not None:
                sync()
                self.profile.stop()
                self.events = self.profile.events()
            return None

    return SyncedTimer(), Profiled()


def run_one(scheme: str, mode: str, args) -> dict:
    """Trains one (scheme, mode) in this process; its row."""
    import torch

    import pretrain_gpt
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import pretrain_with_args

    on_cuda = torch.cuda.is_available()
    tiny = args.tiny or not on_cuda
    model = list(TINY_MODEL if tiny else GPU_MODEL)
    if args.num_layers:
        model += ["--num-layers", str(args.num_layers)]
    steps = args.warmup + args.iters + 1
    argv = [*model, *SCHEMES[scheme], "--mock-data", "--bf16", "--lr", "1e-4",
            "--train-iters", str(steps), "--log-interval", "1000", "--eval-iters", "0",
            "--num-workers", "0", "--quant-kernels", mode]
    margs = validate_args(parse_args(argv))
    timer, profiled = _callbacks(steps, on_cuda)
    pretrain_with_args(pretrain_gpt.forward_step, margs, [timer, profiled])
    times = timer.after(args.warmup)[:-1]           # the profiled step is not timed
    seconds = statistics.median(times)
    tokens = margs.global_batch_size * margs.seq_length
    return dict(scheme=scheme, mode=mode, ms=seconds * 1e3, step_ms=[t * 1e3 for t in times],
                tokens_per_s=tokens / seconds,
                peak_gib=(torch.cuda.max_memory_allocated() if on_cuda else 0) / 2 ** 30,
                breakdown=None if profiled.events is None else breakdown(profiled.events, on_cuda),
                breakdown_of="device time of kernels" if on_cuda else "CPU self time of ops",
                model=f"{margs.model_preset}, {margs.num_layers} layers, seq {margs.seq_length}, "
                      f"{tokens} tokens/step",
                device=torch.cuda.get_device_name() if on_cuda else "CPU",
                pid=os.getpid(), error=None)


# ---------------------------------------------------------------------------------------------
# The parent: one child per run, the table
# ---------------------------------------------------------------------------------------------

def _child_command(scheme: str, mode: str, json_path: str, args) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", scheme, mode, "--json", json_path,
           "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.tiny:
        cmd.append("--tiny")
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    return cmd


def _error(outcome, limit_s: float, log: str) -> str:
    """The reason a child gave no row: how it ended and its log's last line."""
    how = (f"timed out after {limit_s:.0f} s" if outcome.timed_out
           else f"exit {outcome.returncode}")
    last = [line for line in tail(log, 10).splitlines() if line.strip()]
    return f"{how}: {last[-1].strip()}" if last else how


def run_child(scheme: str, mode: str, args, limit_s: float) -> dict:
    """One run in its own process; its row, or a row with its error."""
    stem = os.path.join(args.log_dir, f"{scheme}-{mode}")
    json_path, log = f"{stem}.json", f"{stem}.log"
    if os.path.exists(json_path):
        os.remove(json_path)
    outcome = run_limited(_child_command(scheme, mode, json_path, args), limit_s, log,
                          child_env())
    if outcome.returncode == 0 and os.path.exists(json_path):
        with open(json_path) as fh:
            row = json.load(fh)
    else:
        row = dict(scheme=scheme, mode=mode, error=_error(outcome, limit_s, log))
    row.update(seconds=outcome.seconds, log=log)
    return row


def with_ratios(rows: list) -> list:
    """The rows with their ratio to the bf16 row's step time and their target's verdict."""
    base = next((r for r in rows if r["scheme"] == "bf16" and not r.get("error")), None)
    for row in rows:
        target = TARGETS.get(row["scheme"])
        ratio = row["ms"] / base["ms"] if base and not row.get("error") else None
        row.update(ratio=ratio, target=target,
                   met=None if ratio is None or target is None else ratio <= target)
    return rows


def _verdict(row: dict) -> str:
    if row.get("error"):
        return "error: " + row["error"].replace("|", "\\|")
    if row["target"] is None:
        return ""
    met = "-" if row["met"] is None else ("met" if row["met"] else "NOT met")
    return f"<= {row['target']:.2f}x: {met}"


def markdown(rows: list) -> str:
    """The rows as a markdown table (ms of the profiled step by class; '-' for an error)."""
    lines = ["| scheme | mode | ms/step | x bf16 | tokens/s | peak GiB | GEMM ms | attention ms "
             "| quant ms | other ms | target |", "|---|---|" + "---:|" * 8 + "---|"]
    for row in rows:
        if row.get("error"):
            cells = ["-"] * 8
        else:
            ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.2f}"
            parts = row.get("breakdown") or {}
            cells = [f"{row['ms']:.1f}", ratio, f"{row['tokens_per_s']:.0f}",
                     f"{row['peak_gib']:.2f}",
                     *(f"{parts[c]:.1f}" if c in parts else "-" for c in CLASSES)]
        lines.append(f"| {row['scheme']} | {row['mode']} | {' | '.join(cells)} | "
                     f"{_verdict(row)} |")
    return "\n".join(lines)


def header(rows: list) -> str:
    """What the rows measured: the model, the device and the breakdown's basis."""
    measured = next((r for r in rows if not r.get("error")), None)
    if measured is None:
        return "no run finished"
    return (f"{measured['model']}, bf16 training, {measured['device']}; ms by class: "
            f"{measured['breakdown_of']} in one profiled step after the timed ones")


def _runs(args) -> list:
    """(scheme, mode) pairs in run order: bf16 once, in the first mode."""
    return [(s, m) for s in SCHEMES if s in args.schemes for m in args.modes
            if s != "bf16" or m == args.modes[0]]


def _write(path, rows) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


def run_all(args) -> list:
    """Every run in its own process within --budget-s; the rows with their ratios."""
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    rows = []
    for scheme, mode in _runs(args):
        limit = args.run_timeout_s
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
        if limit < 1:
            row = dict(scheme=scheme, mode=mode, error="not run: --budget-s spent")
        else:
            row = run_child(scheme, mode, args, limit)
        rows.append(row)
        with_ratios(rows)
        _write(args.json, rows)
        status = row.get("error") or f"{row['ms']:.1f} ms/step, peak {row['peak_gib']:.2f} GiB"
        print(f"[bench] {scheme} {mode}: {status}", flush=True)
    return rows


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="llama-tiny at seq 256 (the default on a machine without CUDA).")
    p.add_argument("--num-layers", type=int, default=None,
                   help="Layers of the model (default: the preset's, 16 for llama32-1b).")
    p.add_argument("--iters", type=int, default=10,
                   help="Timed steps per run, median reported (default 10).")
    p.add_argument("--warmup", type=int, default=3,
                   help="Untimed first steps, where compilation and autotuning happen "
                        "(default 3).")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES),
                   help="Schemes to time (default: all).")
    p.add_argument("--modes", nargs="+", default=["auto"], choices=MODES,
                   help="Quantization modes (--quant-kernels) to time each scheme in "
                        "(default: auto).")
    p.add_argument("--json", metavar="PATH", help="Write every row to PATH as JSON.")
    p.add_argument("--run-timeout-s", type=float, default=900,
                   help="Time limit of one run's process, start-up included (default 900).")
    p.add_argument("--budget-s", type=float, default=0,
                   help="Time limit of all runs together; the runs it leaves no time for are "
                        "rows saying so (default 0: none).")
    p.add_argument("--log-dir", default=None,
                   help="Folder of each run's log and row (default: a temporary folder).")
    # Internal: the child process of one run, writing its row to --json.
    p.add_argument("--one", nargs=2, metavar=("SCHEME", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one and (args.one[0] not in SCHEMES or args.one[1] not in MODES):
        p.error(f"--one {' '.join(args.one)}: unknown scheme or mode")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.one:
        _write_row(run_one(*args.one, args), args.json)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        args.log_dir = args.log_dir or scratch
        os.makedirs(args.log_dir, exist_ok=True)
        rows = run_all(args)
        print(f"\n{header(rows)}\n\n{markdown(rows)}")
    return 1 if any(r.get("error") for r in rows) else 0


def _write_row(row: dict, path) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(row, fh)


if __name__ == "__main__":
    sys.exit(main())
