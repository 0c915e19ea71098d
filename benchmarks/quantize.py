"""Speed of fake_quantize against memory-bandwidth references and torchao.

Measures, side by side on the same tensors (float32 and bf16), the median time of
fake_quantize for every format (eager and, with --compile, torch.compile'd) next to
`x.clone()` (one fresh allocation plus a copy: what any out-of-place op pays at least),
`y.copy_(x)` into a preallocated tensor (pure bandwidth) and, when torchao is importable,
torchao's MX `to_mx` + `to_dtype` quantize-dequantize (FLOOR scaling). Ratios are to clone().

Each candidate is timed in short back-to-back runs (so it sees its own allocator state, as
in a loop of training steps), and the runs of all candidates of one dtype are interleaved
over several passes, so that load from other processes spreads evenly over them; the median
over all timed calls is reported.

Targets: MXFP8 within 4x of clone and at least 2x faster than torchao; MXFP4 and HiFP8 within
8x of clone.

Allocator state matters on CPU: with glibc's defaults a fresh 64 MiB tensor usually comes from
a new mmap and pays a page fault per 4 KiB page, so clone() (and every out-of-place op) costs
several times copy_(); `--malloc reuse` raises glibc's mmap and trim thresholds so that freed
memory is reused, the steady state of a training loop with a caching allocator, where clone()
costs about as much as copy_().

    python benchmarks/quantize.py [--size 4096] [--repeats 12] [--compile] [--threads N]
                                  [--malloc {default,reuse}]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.quantization.formats import fake_quantize, fake_quantize_compiled  # noqa: E402

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "hifp8")
TARGETS = {"mxfp8_e4m3": 4.0, "mxfp8_e5m2": 4.0, "mxfp4": 8.0, "hifp8": 8.0}
TORCHAO_SPEEDUP_TARGET = 2.0       # MXFP8 must be at least this much faster than torchao
TORCHAO_DTYPES = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2",
                  "mxfp4": "float4_e2m1fn_x2"}


def torchao_qdq():
    """A torchao MX quantize-dequantize callable, or None when torchao is not importable."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception:  # torchao is optional
        return None

    def qdq(x, fmt):
        elem = getattr(torch, TORCHAO_DTYPES[fmt])
        scale, data = to_mx(x, elem, 32, ScaleCalculationMode.FLOOR)
        return to_dtype(data, scale, elem, 32, x.dtype)

    return qdq


def interleaved_ms(candidates: dict, repeats: int, passes: int = 3) -> dict:
    """Median wall time (ms) of each callable over `repeats` timed calls, split into `passes`
    interleaved runs, each run after one untimed warm-up call. Names starting with "torchao"
    are slow and get a single call per pass."""
    per_pass = max(1, -(-repeats // passes))
    times = {name: [] for name in candidates}
    for _ in range(passes):
        for name, fn in candidates.items():
            fn()
            for _ in range(1 if name.startswith("torchao") else per_pass):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run(size: int, repeats: int, compile_too: bool) -> list:
    torch.manual_seed(0)
    ao = torchao_qdq()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(size, size, dtype=dtype)
        y = torch.empty_like(x)
        candidates = {"clone": lambda: x.clone(), "copy_": lambda: y.copy_(x)}
        for fmt in FORMATS:
            candidates[f"eager {fmt}"] = lambda fmt=fmt: fake_quantize(x, fmt)
            if compile_too:
                candidates[f"compiled {fmt}"] = lambda fmt=fmt: fake_quantize_compiled(x, fmt)
            if ao and fmt in TORCHAO_DTYPES:
                candidates[f"torchao {fmt}"] = lambda fmt=fmt: ao(x, fmt)
        ms = interleaved_ms(candidates, repeats)
        clone = ms["clone"]
        name = str(dtype).replace("torch.", "")
        print(f"\n{name} [{size} x {size}]   clone {clone:8.2f} ms   copy_ {ms['copy_']:8.2f} ms")
        print(f"  {'format':<11} {'eager ms':>9} {'x clone':>8} {'target':>7}"
              + (f" {'compiled':>9} {'x clone':>8}" if compile_too else "")
              + (f" {'torchao':>9} {'ao/eager':>9}" if ao else ""))
        for fmt in FORMATS:
            eager = ms[f"eager {fmt}"]
            row = {"dtype": name, "format": fmt, "clone": clone, "copy": ms["copy_"],
                   "eager": eager}
            line = f"  {fmt:<11} {eager:9.2f} {eager / clone:7.2f}x {TARGETS[fmt]:6.0f}x"
            if compile_too:
                row["compiled"] = ms[f"compiled {fmt}"]
                line += f" {row['compiled']:9.2f} {row['compiled'] / clone:7.2f}x"
            if f"torchao {fmt}" in ms:
                row["torchao"] = ms[f"torchao {fmt}"]
                line += f" {row['torchao']:9.2f} {row['torchao'] / eager:8.2f}x"
            elif ao:
                line += f" {'-':>9} {'-':>9}"
            met = eager <= TARGETS[fmt] * clone
            if fmt.startswith("mxfp8") and "torchao" in row:
                met = met and row["torchao"] >= TORCHAO_SPEEDUP_TARGET * eager
            line += "   target met" if met else "   TARGET MISSED"
            print(line)
            rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4096, help="square tensor side (default 4096)")
    parser.add_argument("--repeats", type=int, default=12,
                        help="timed calls per candidate, median reported (default 12; torchao 3)")
    parser.add_argument("--compile", action="store_true",
                        help="also time fake_quantize_compiled (torch.compile, dynamic=True)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--malloc", choices=("default", "reuse"), default="default",
                        help="glibc allocator: as configured (default) or reusing freed memory")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "reuse":
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)
        if not ok:
            parser.error("mallopt failed: --malloc reuse needs glibc")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, malloc {args.malloc}")
    run(args.size, args.repeats, args.compile)


if __name__ == "__main__":
    main()
