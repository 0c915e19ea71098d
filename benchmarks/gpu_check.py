"""`make gpu-check`: the CUDA tests and the GPU benchmarks in one call of at most --budget-s
seconds (default 480, sized for one H100/H200), ending in one summary of every figure against
its target.

Stages, in this order, each in its own process with its own time limit and log file:

    tests       MEGATRON_LOWP_GPU_TESTS=1 pytest -q tests/gpu        target: 0 failed
    throughput  benchmarks/gpu_throughput.py (llama32-1b at full depth, seq 8192, one process
                per scheme): step time x bf16 against each scheme's target
    qdq         the Triton QDQ kernels of benchmarks/quantize.py on CUDA (8192 x 8192, fp32
                and bf16): their GB/s against a device-to-device copy of the same tensor,
                target >= 70%
    attention   the quantized attention kernels' fwd and bwd against SDPA (flash/cuDNN) at
                llama32-1b's attention shapes (`attention_table`), target fwd + bwd <= 4x
                at seq 8192

A stage's limit is its weight's share of the budget still left (a stage that ends early leaves
its time to the later ones). A stage that fails or runs out of time is reported with the tail
of its log and the next one still runs; its figures read "not measured". Without CUDA every
stage says so and the summary is still written. The summary is printed and written to
OUT_DIR/summary.md (default runs/gpu-check), next to each stage's log and JSON. Exit status 1
when a stage failed, ran out of time or was left without time; 0 otherwise (also when no CUDA
device was found: nothing was run).

The attention table: one layer's attention at micro-batch 1, 32 query heads, 8 KV heads,
causal, bf16, at seq 2048, 8192 and 32768 and head dims 64 and 128: the fused quantized
attention kernels (megatron/quantization/kernels/attention.py, P and dS quantized in the tiles
in MXFP8 E4M3 as FA_linear_mxfp8 with --attn-pv-quant mxfp8 runs them) against
torch.nn.functional.scaled_dot_product_attention on the same shapes (flash, cuDNN or
memory-efficient; never the math kernel). The kernels alone: the whole Q, K, V and dO operands
are quantized outside them by the QDQ kernels (the qdq stage), which is not counted here. An
autotuned kernel's chosen config (its `best_config`) is printed with each shape.

    python benchmarks/gpu_check.py [--budget-s 480] [--stages tests throughput] [--dry-run]
    python benchmarks/gpu_check.py --attention-json PATH     # the attention table alone
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _path in (BENCH_DIR, REPO_ROOT):  # the stages' modules, when imported from elsewhere
    if _path not in sys.path:
        sys.path.insert(0, _path)

from megatron.training.child_env import with_repository_path  # noqa: E402

DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "runs", "gpu-check")
# Kept back from the stages for the probe, the summary and process start-up.
RESERVE_SHARE = 0.04
TAIL_LINES = 25
QDQ_TARGET = 0.70                     # QDQ GB/s as a share of the device copy's
QDQ_FIGURE_FORMATS = ("mxfp8_e4m3", "mxfp4", "hifp8", "nvfp4")
QDQ_DTYPES = ("float32", "bfloat16")
ATTENTION_TARGET_SEQ, ATTENTION_TARGET = 8192, 4.0
ATTENTION_SEQS, ATTENTION_HEAD_DIMS = (2048, 8192, 32768), (64, 128)
ATTENTION_HEADS, ATTENTION_KV_HEADS = 32, 8          # llama32-1b
ATTENTION_FORMAT = "mxfp8_e4m3"
ATTENTION_KERNELS = ("_forward_kernel", "_backward_query_kernel", "_backward_key_kernel")


# ---------------------------------------------------------------------------------------------
# Running a command under a time limit
# ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    returncode: Optional[int]         # None when it was killed at its limit
    timed_out: bool
    seconds: float


def run_limited(cmd: List[str], limit_s: float, log_path: str,
                env: Optional[Dict[str, str]] = None) -> Outcome:
    """Runs `cmd` with its output in `log_path` (written as it goes, so a hang still leaves
    what came before); past `limit_s` its whole process group is killed (torch.compile's
    worker processes too)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
        try:
            returncode, timed_out = proc.wait(timeout=max(limit_s, 0.01)), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode, timed_out = None, True
        except BaseException:
            _kill_group(proc)         # Ctrl-C: the child's own session does not get it
            raise
    return Outcome(returncode, timed_out, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a text file ('' when it does not exist)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:]).rstrip()


def child_env(**extra: str) -> Dict[str, str]:
    """The environment of a stage: the repository in front of the caller's PYTHONPATH."""
    return with_repository_path(REPO_ROOT, **extra)


# ---------------------------------------------------------------------------------------------
# Stages, figures and the runner
# ---------------------------------------------------------------------------------------------

@dataclass
class Figure:
    name: str
    value: Optional[str]              # None: not measured
    target: str
    passed: Optional[bool] = None     # None with a value: no pass/fail (information)

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        return "-" if self.passed is None else ("pass" if self.passed else "FAIL")


@dataclass
class Stage:
    name: str
    what: str
    # (time limit in s, output folder) -> the command line
    command: Callable[[float, str], List[str]]
    weight: float
    needs_cuda: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    limit_s: Optional[float] = None   # a cap below the share of the budget
    outputs: tuple = ()               # its files in the output folder, removed before it runs
    # output folder (None: the stage did not run) -> its figures, value None where not measured
    figures: Callable[[Optional[str]], List[Figure]] = lambda out_dir: []
    # output folder -> a markdown table for the summary ('' when there is none)
    table: Callable[[str], str] = lambda out_dir: ""


@dataclass
class StageResult:
    stage: Stage
    status: str                       # passed, failed (exit N), timed out, skipped, not run
    seconds: float = 0.0
    limit_s: float = 0.0
    log: str = ""

    @property
    def failed(self) -> bool:
        return not (self.status == "passed" or self.status.startswith("skipped"))


def stage_limit(remaining_s: float, stage: Stage, weights_left: float) -> float:
    """A stage's share of the time still left, capped by its own limit."""
    share = remaining_s * stage.weight / weights_left if weights_left > 0 else 0.0
    return min(share, stage.limit_s) if stage.limit_s is not None else share


def run_stages(stages: List[Stage], budget_s: float, out_dir: str,
               cuda: Optional[str], echo=print) -> List[StageResult]:
    """Runs the stages one after another within `budget_s`; `cuda` is the device's name (None
    without CUDA: the stages that need it are skipped)."""
    os.makedirs(out_dir, exist_ok=True)
    deadline = time.monotonic() + budget_s * (1 - RESERVE_SHARE)
    for stage in stages:              # no figures from an earlier check's files
        for name in stage.outputs:
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    runnable = [s for s in stages if cuda or not s.needs_cuda]
    results = []
    for stage in stages:
        if stage not in runnable:
            results.append(StageResult(stage, "skipped: needs CUDA (no CUDA device here)"))
            echo(f"[gpu-check] {stage.name}: skipped, needs CUDA (no CUDA device here)")
            continue
        left = runnable[runnable.index(stage):]
        limit = stage_limit(deadline - time.monotonic(), stage, sum(s.weight for s in left))
        log = os.path.join(out_dir, f"{stage.name}.log")
        if limit < 1:
            results.append(StageResult(stage, "not run: no time left in --budget-s", 0, limit))
            echo(f"[gpu-check] {stage.name}: not run, no time left")
            continue
        echo(f"[gpu-check] {stage.name}: {stage.what} (limit {limit:.0f} s, log {log})",
             flush=True)
        outcome = run_limited(stage.command(limit, out_dir), limit, log,
                              child_env(**stage.env))
        status = ("timed out" if outcome.timed_out else
                  "passed" if outcome.returncode == 0 else f"failed (exit {outcome.returncode})")
        results.append(StageResult(stage, status, outcome.seconds, limit, log))
        echo(f"[gpu-check] {stage.name}: {status} after {outcome.seconds:.0f} s", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary(results: List[StageResult], out_dir: str, device: str, budget_s: float,
            used_s: float) -> str:
    """The markdown summary: every stage's figures against their targets, the stages, the
    tail of each failed stage's log and the stages' tables."""
    lines = ["# GPU check", "", f"Device: {device}. Budget {budget_s:.0f} s, used {used_s:.0f} s.",
             "", "| figure | value | target | verdict |", "|---|---|---|---|"]
    for result in results:
        for fig in result.stage.figures(out_dir if result.log else None):
            lines.append(f"| {_cell(fig.name)} | {_cell(fig.value or '-')} | "
                         f"{_cell(fig.target)} | {fig.verdict} |")
    lines += ["", "| stage | status | seconds | limit s | log |", "|---|---|---:|---:|---|"]
    for r in results:
        log = os.path.relpath(r.log, out_dir) if r.log else "-"
        lines.append(f"| {r.stage.name} | {_cell(r.status)} | {r.seconds:.0f} | "
                     f"{r.limit_s:.0f} | {log} |")
    for r in results:
        if r.failed and r.log:
            lines += ["", f"## {r.stage.name}: {r.status} (end of its log)", "", "```",
                      tail(r.log) or "(no output)", "```"]
    for r in results:
        table = r.stage.table(out_dir) if r.log else ""
        if table:
            lines += ["", f"## {r.stage.name}", "", table]
    return "\n".join(lines) + "\n"


def write_summary(text: str, out_dir: str) -> str:
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as fh:
        fh.write(text)
    return path


# ---------------------------------------------------------------------------------------------
# The stages of make gpu-check
# ---------------------------------------------------------------------------------------------

def _load(out_dir: Optional[str], name: str):
    """A stage's JSON output, or None when it wrote none (or only part of a file)."""
    if out_dir is None:
        return None
    try:
        with open(os.path.join(out_dir, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def pytest_counts(text: str) -> Dict[str, int]:
    """{outcome: count} from pytest's closing line ('3 failed, 87 passed, 2 skipped in 9s')."""
    found = {}
    for line in text.splitlines():
        if re.search(r"\b(passed|failed|skipped|errors?|no tests ran)\b.* in [\d.]+s", line):
            found = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                     for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
    return found


def _test_figures(out_dir: Optional[str]) -> List[Figure]:
    counts = pytest_counts(tail(os.path.join(out_dir, "tests.log"), 5)) if out_dir else {}
    if not counts:
        return [Figure("CUDA tests (tests/gpu)", None, "0 failed")]
    bad = counts.get("failed", 0) + counts.get("error", 0)
    text = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return [Figure("CUDA tests (tests/gpu)", text, "0 failed", bad == 0 and "passed" in counts)]


def _throughput_figures(out_dir: Optional[str]) -> List[Figure]:
    import gpu_throughput

    data = _load(out_dir, "throughput.json") or {}
    rows = {(r["scheme"], r["mode"]): r for r in data.get("rows", [])}
    figures = []
    for scheme, target in gpu_throughput.TARGETS.items():
        row = rows.get((scheme, "auto"))
        ratio = None if row is None else row.get("ratio")
        value = None if ratio is None else f"{ratio:.2f}x ({row['ms']:.0f} ms/step)"
        figures.append(Figure(f"{scheme} step x bf16 (auto)", value, f"<= {target:.2f}x",
                              None if ratio is None else ratio <= target))
    base = rows.get(("bf16", "auto"))
    if base and base.get("ms") is not None:
        figures.append(Figure(f"bf16 step ({base.get('model', '')})",
                              f"{base['ms']:.0f} ms, peak {base['peak_gib']:.1f} GiB", "-"))
    return figures


def _throughput_table(out_dir: str) -> str:
    import gpu_throughput

    data = _load(out_dir, "throughput.json")
    if not data or not data.get("rows"):
        return ""
    return f"{gpu_throughput.header(data['rows'])}\n\n{gpu_throughput.markdown(data['rows'])}"


def qdq_rows(dtype: str, nbytes: int, ms: Dict[str, float]) -> List[dict]:
    """One dtype's rows from the times of "copy_" and "triton <format>": each Triton QDQ
    kernel's GB/s next to the device copy's (both read and write every element once)."""
    copy = ms["copy_"]
    return [dict(dtype=dtype, format=name[len("triton "):], ms=t, gbs=2 * nbytes / t / 1e6,
                 copy_ms=copy, copy_gbs=2 * nbytes / copy / 1e6, of_copy=copy / t)
            for name, t in ms.items() if name.startswith("triton ")]


def _qdq_figures(out_dir: Optional[str]) -> List[Figure]:
    data = _load(out_dir, "qdq.json") or {}
    rows = {(r["format"], r["dtype"]): r for r in data.get("rows", [])}
    figures = []
    for fmt in QDQ_FIGURE_FORMATS:
        for dtype in QDQ_DTYPES:
            row = rows.get((fmt, dtype))
            value = None if row is None else (f"{row['gbs']:.0f} GB/s, {row['of_copy']:.0%} of "
                                              f"copy ({row['copy_gbs']:.0f} GB/s)")
            figures.append(Figure(f"QDQ {fmt} {dtype}", value, f">= {QDQ_TARGET:.0%} of copy",
                                  None if row is None else row["of_copy"] >= QDQ_TARGET))
    return figures


def _qdq_table(out_dir: str) -> str:
    data = _load(out_dir, "qdq.json")
    return qdq_markdown(data) if data and data.get("rows") else ""


def qdq_markdown(data: dict) -> str:
    lines = [f"{data['size']} x {data['size']} tensors, Triton QDQ against `y.copy_(x)`", "",
             "| format | dtype | QDQ ms | QDQ GB/s | copy GB/s | of copy |",
             "|---|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['format']} | {r['dtype']} | {r['ms']:.3f} | {r['gbs']:.0f} | "
                     f"{r['copy_gbs']:.0f} | {r['of_copy']:.0%} |")
    return "\n".join(lines)


def _attention_figures(out_dir: Optional[str]) -> List[Figure]:
    data = _load(out_dir, "attention.json") or {}
    rows = {(r["seq"], r["head_dim"]): r for r in data.get("rows", [])}
    figures = []
    for d in ATTENTION_HEAD_DIMS:
        row = rows.get((ATTENTION_TARGET_SEQ, d))
        ratio = None if row is None else row["ratio"]
        value = None if row is None else (
            f"{ratio:.2f}x ({row['quant_fwd_ms'] + row['quant_bwd_ms']:.1f} vs "
            f"{row['sdpa_fwd_ms'] + row['sdpa_bwd_ms']:.1f} ms)")
        figures.append(Figure(f"attention kernels fwd+bwd x SDPA, seq {ATTENTION_TARGET_SEQ}, "
                              f"d {d}", value, f"<= {ATTENTION_TARGET:.0f}x",
                              None if row is None else ratio <= ATTENTION_TARGET))
    return figures


def _attention_table(out_dir: str) -> str:
    data = _load(out_dir, "attention.json")
    return attention_markdown(data["rows"]) if data and data.get("rows") else ""


def _py(*args: str) -> List[str]:
    return [sys.executable, *args]


def gpu_stages() -> List[Stage]:
    """The stages of make gpu-check, with their weights (shares of the budget: about 3 min
    each for the tests and the throughput table, 40 s for QDQ, 1 min for attention at 480 s)."""
    def throughput(limit, out):
        # The script keeps its own budget a little inside the stage's, so that it reports the
        # runs it could not finish instead of being killed with them.
        return _py(os.path.join(BENCH_DIR, "gpu_throughput.py"), "--iters", "4", "--warmup", "2",
                   "--budget-s", f"{max(limit - 15, 1):.0f}",
                   "--run-timeout-s", f"{max(limit * 0.4, 30):.0f}",
                   "--json", os.path.join(out, "throughput.json"),
                   "--log-dir", os.path.join(out, "throughput"))

    return [
        Stage("tests", "MEGATRON_LOWP_GPU_TESTS=1 pytest -q tests/gpu",
              lambda limit, out: _py("-m", "pytest", "-q", "tests/gpu"), weight=180,
              env={"MEGATRON_LOWP_GPU_TESTS": "1"}, figures=_test_figures),
        Stage("throughput", "benchmarks/gpu_throughput.py, llama32-1b at full depth, seq 8192",
              throughput, weight=180, outputs=("throughput.json",), figures=_throughput_figures,
              table=_throughput_table),
        Stage("qdq", "Triton QDQ bandwidth against a device copy (benchmarks/quantize.py)",
              lambda limit, out: _py(os.path.abspath(__file__), "--qdq-json",
                                     os.path.join(out, "qdq.json")),
              weight=40, outputs=("qdq.json",), figures=_qdq_figures, table=_qdq_table),
        Stage("attention", "the quantized attention kernels against SDPA",
              lambda limit, out: _py(os.path.abspath(__file__), "--attention-json",
                                     os.path.join(out, "attention.json")),
              weight=60, outputs=("attention.json",), figures=_attention_figures,
              table=_attention_table),
    ]


def measure_qdq(json_path: str, size: int = 8192, repeats: int = 8) -> None:
    """The qdq stage's body: the Triton QDQ kernels of benchmarks/quantize.py and `y.copy_(x)`
    on a size x size CUDA tensor, timed as quantize.py times them (interleaved, median), in
    fp32 and bf16; the rows written to `json_path` after each dtype."""
    import torch

    import quantize

    if not torch.cuda.is_available():
        print("qdq: needs CUDA (no CUDA device here)")
        return
    torch.manual_seed(0)
    found = quantize.triton_candidates(torch.device("cuda"))
    data = {"size": size, "rows": []}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(size, size, dtype=dtype, device="cuda")
        y = torch.empty_like(x)
        candidates = {"copy_": lambda: y.copy_(x)}
        for label, fn in quantize.available(x, found, prefix="triton ").items():
            candidates[f"triton {label}"] = lambda fn=fn: fn(x)
        ms = quantize.interleaved_ms(candidates, repeats, sync=torch.cuda.synchronize)
        name = str(dtype).replace("torch.", "")
        data["rows"] += qdq_rows(name, x.numel() * x.element_size(), ms)
        with open(json_path, "w") as fh:
            json.dump(data, fh, indent=1)
        print(f"{name}: copy_ {ms['copy_']:.3f} ms", flush=True)
    print(f"\n{qdq_markdown(data)}")


# ---------------------------------------------------------------------------------------------
# The attention table (the attention stage's body)
# ---------------------------------------------------------------------------------------------

def timed_ms(run, repeats: int, device, prepare=lambda: None, max_s: float = 3.0) -> float:
    """Median ms of run(prepare()) over up to `repeats` calls after one untimed call (Triton
    compiles there), fewer (at least 2) once `max_s` is spent; prepare() is not timed."""
    import torch

    run(prepare())
    times = []
    while len(times) < repeats and (len(times) < 2 or sum(times) < max_s * 1e3):
        arg = prepare()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(arg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run(arg)
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def sdpa_ms(seq: int, head_dim: int, repeats: int, device) -> tuple:
    """(fwd ms, bwd ms) of causal GQA SDPA in bf16 on [1, heads, seq, head_dim] operands."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def tensor(heads):
        return torch.randn(1, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = tensor(ATTENTION_HEADS), tensor(ATTENTION_KV_HEADS), tensor(ATTENTION_KV_HEADS)
    grad = torch.randn_like(q)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused if device.type == "cuda" else [SDPBackend.MATH]):
        def forward(_=None):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        fwd = timed_ms(forward, repeats, device)
        bwd = timed_ms(lambda out: torch.autograd.grad(out, (q, k, v), grad), repeats, device,
                       prepare=forward)
    return fwd, bwd


def quantized_ms(seq: int, head_dim: int, repeats: int, device) -> tuple:
    """(fwd ms, bwd ms) of the fused quantized attention kernels on the same shapes, in their
    grouped layout (one group per KV head, its 4 query heads' rows one after the other)."""
    import torch
    from megatron.quantization.kernels import attention as kernels

    groups, rows = ATTENTION_KV_HEADS, ATTENTION_HEADS // ATTENTION_KV_HEADS * seq

    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    q, k_t, v, grad = (tensor(groups, rows, head_dim), tensor(groups, head_dim, seq),
                       tensor(groups, seq, head_dim), tensor(groups, rows, head_dim))
    formats = kernels.TileFormats(*[ATTENTION_FORMAT] * 4)
    scale = head_dim ** -0.5

    def forward(_=None):
        return kernels.attention_forward(q, k_t, v, formats, scale, True, seq)

    fwd = timed_ms(forward, repeats, device)
    stats = forward()
    bwd = timed_ms(lambda _: kernels.attention_backward(
        grad, grad, q, q, k_t, k_t, v, stats.row_max, stats.inv_row_sum, formats, scale, True,
        seq), repeats, device)
    return fwd, bwd


def autotuned_configs() -> Dict[str, str]:
    """{kernel: its chosen config} for the attention kernels that are autotuned."""
    from megatron.quantization.kernels import attention as kernels

    found = {}
    for name in ATTENTION_KERNELS:
        config = getattr(getattr(kernels, name, None), "best_config", None)
        if config is not None:
            found[name] = str(config)
    return found


def attention_row(seq: int, head_dim: int, repeats: int, device) -> dict:
    sdpa_fwd, sdpa_bwd = sdpa_ms(seq, head_dim, repeats, device)
    quant_fwd, quant_bwd = quantized_ms(seq, head_dim, repeats, device)
    return dict(seq=seq, head_dim=head_dim, sdpa_fwd_ms=sdpa_fwd, sdpa_bwd_ms=sdpa_bwd,
                quant_fwd_ms=quant_fwd, quant_bwd_ms=quant_bwd,
                ratio=(quant_fwd + quant_bwd) / (sdpa_fwd + sdpa_bwd),
                autotuned=autotuned_configs())


def attention_markdown(rows: List[dict]) -> str:
    """The attention table's rows as a markdown table."""
    lines = ["| seq | head dim | SDPA fwd ms | SDPA bwd ms | quantized fwd ms | quantized bwd ms "
             "| fwd x | bwd x | fwd+bwd x | target | autotuned |", "|" + "---:|" * 9 + "---|---|"]
    for r in rows:
        target = ""
        if r["seq"] == ATTENTION_TARGET_SEQ:
            met = "met" if r["ratio"] <= ATTENTION_TARGET else "NOT met"
            target = f"<= {ATTENTION_TARGET:.0f}x: {met}"
        tuned = "; ".join(f"{k}: {c}" for k, c in r.get("autotuned", {}).items())
        lines.append(f"| {r['seq']} | {r['head_dim']} | {r['sdpa_fwd_ms']:.2f} | "
                     f"{r['sdpa_bwd_ms']:.2f} | {r['quant_fwd_ms']:.2f} | "
                     f"{r['quant_bwd_ms']:.2f} | {r['quant_fwd_ms'] / r['sdpa_fwd_ms']:.2f} | "
                     f"{r['quant_bwd_ms'] / r['sdpa_bwd_ms']:.2f} | {r['ratio']:.2f} | {target} | "
                     f"{_cell(tuned) or '-'} |")
    return "\n".join(lines)


def attention_table(json_path: Optional[str], repeats: int = 5) -> None:
    """Every (seq, head dim) row, shortest first, written to `json_path` after each one (a
    stage cut short keeps the rows it has)."""
    import torch

    if not torch.cuda.is_available():
        print("attention table: needs CUDA (no CUDA device here)")
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: one layer's attention, micro-batch 1, "
          f"{ATTENTION_HEADS} query heads, {ATTENTION_KV_HEADS} KV heads, causal, bf16; "
          f"quantized: P and dS in {ATTENTION_FORMAT} in the kernels", flush=True)
    rows = []
    for seq in ATTENTION_SEQS:
        for head_dim in ATTENTION_HEAD_DIMS:
            rows.append(attention_row(seq, head_dim, repeats, device))
            print(attention_markdown(rows[-1:]).splitlines()[-1], flush=True)
            if json_path:
                with open(json_path, "w") as fh:
                    json.dump({"rows": rows}, fh, indent=1)
    print(f"\n{attention_markdown(rows)}")


def probe_cuda(limit_s: float = 90) -> Optional[str]:
    """'<device name>, torch X, triton Y' when CUDA works (probed in a child process, so this
    one never holds a CUDA context), else None."""
    code = ("import torch\nif torch.cuda.is_available():\n"
            "    try:\n        import triton; t = triton.__version__\n"
            "    except ImportError:\n        t = 'not installed'\n"
            "    print(f'CUDA: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            "triton {t}')\n")
    try:
        out = subprocess.run(_py("-c", code), capture_output=True, text=True, timeout=limit_s,
                             env=child_env()).stdout
    except subprocess.TimeoutExpired:
        return None
    found = [line[len("CUDA: "):] for line in out.splitlines() if line.startswith("CUDA: ")]
    return found[0] if found else None


def plan(stages: List[Stage], budget_s: float, out_dir: str) -> str:
    """The stages, their limits if each takes its whole share, and their commands."""
    usable, left = budget_s * (1 - RESERVE_SHARE), sum(s.weight for s in stages)
    lines = [f"budget {budget_s:.0f} s ({usable:.0f} s for the stages), output {out_dir}"]
    for stage in stages:
        limit = stage_limit(usable, stage, left)
        usable, left = usable - limit, left - stage.weight
        lines.append(f"  {stage.name:<11} up to {limit:4.0f} s  {stage.what}\n"
                     f"              {' '.join(stage.command(limit, out_dir))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    stages = gpu_stages()
    names = [s.name for s in stages]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=480,
                   help="Seconds for the whole check, every stage included (default 480).")
    p.add_argument("--stages", nargs="+", choices=names, default=names,
                   help=f"The stages to run, in this order (default: all: {' '.join(names)}).")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="Folder of the logs, the stages' JSON and summary.md "
                        "(default runs/gpu-check).")
    p.add_argument("--dry-run", action="store_true",
                   help="Print the plan (stages, time limits, commands) and run nothing.")
    p.add_argument("--qdq-json", metavar="PATH",
                   help="Run only the qdq stage's measurement (CUDA) and write it to PATH "
                        "(the qdq stage runs this in its own process).")
    p.add_argument("--attention-json", metavar="PATH",
                   help="Run only the attention table (CUDA; 'needs CUDA' elsewhere) and write "
                        "its rows to PATH (the attention stage runs this in its own process).")
    args = p.parse_args(argv)
    if args.qdq_json:
        measure_qdq(args.qdq_json)
        return 0
    if args.attention_json:
        attention_table(args.attention_json)
        return 0
    chosen = [s for s in stages if s.name in args.stages]
    if args.dry_run:
        print(plan(chosen, args.budget_s, args.out_dir))
        return 0
    return check(chosen, args.budget_s, args.out_dir)


def check(stages: List[Stage], budget_s: float, out_dir: str) -> int:
    """Probe the device, run the stages, print and write the summary; the exit status."""
    start = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    device = probe_cuda()
    print(f"[gpu-check] device: {device or 'no CUDA device'}", flush=True)
    results = run_stages(stages, budget_s - (time.monotonic() - start), out_dir, device)
    text = summary(results, out_dir, device or "no CUDA device (nothing measured)", budget_s,
                   time.monotonic() - start)
    print(f"\n{text}", end="")
    print(f"[gpu-check] summary: {write_summary(text, out_dir)}")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
