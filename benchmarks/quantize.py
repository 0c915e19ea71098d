"""Speed of fake_quantize against memory-bandwidth references and torchao.

Measures, side by side on the same tensors (float32 and bf16), the median time of
fake_quantize for every format (eager and, with --compile, torch.compile'd) next to
`x.clone()` (one fresh allocation plus a copy: what any out-of-place op pays at least),
`y.copy_(x)` into a preallocated tensor (pure bandwidth) and, when torchao is importable, its
quantize-dequantize for the same format where it has one:

    MXFP8 / MXFP4 / MXFP6    to_mx + to_dtype (FLOOR scaling)
    NVFP4                    NVFP4Tensor.to_nvfp4 (per-tensor scale from the amax) + dequantize
    FP8 tensorwise           torchao.float8 hp_tensor_to_float8_dynamic + to_original_precision
    FP8 blockwise 1x128      torch_blockwise_scale_act_quant_lhs (the pure-torch formula of
                             prototype/blockwise_fp8_training, loaded from its source because
                             that module imports triton) + q * scale_inv

With --device cuda (the default when CUDA is present) the tensors live on the GPU and a
"triton" column times the fused Triton kernel of megatron.quantization.kernels for the
formats it covers (MX, HiFP8, NVFP4; NVFP4's time includes the eager 0-d tensor-scale ops),
with its effective bandwidth (one read and one write per element) in GB/s and as a fraction
of the device's peak memory bandwidth where that is known; the "eager" column is then
fake_quantize with kernels="eager". On a CPU the kernel column needs a GPU and is left
out (a line says so).

Ratios are to clone(); "ao/eager" is torchao's time over ours. Formats: MXFP8 (E4M3, E5M2),
MXFP4, HiFP8, NVFP4, MXFP6 (E2M3, E3M2), FP8 E4M3 with per-tensor current scaling and with
1x128 blockwise scaling. A format whose fake_quantize (or a torchao equivalent) raises on a
small probe is skipped with a line "not available: <reason>".

Each candidate is timed in short back-to-back runs (so it sees its own allocator state, as
in a loop of training steps), and the runs of all candidates of one dtype are interleaved
over several passes, so that load from other processes spreads evenly over them; the median
over all timed calls is reported.

Targets: MXFP8 within 4x of clone and at least 2x faster than torchao; MXFP4 and HiFP8 within
8x of clone. NVFP4, MXFP6 and FP8 have no hard target: their ratios to clone and to torchao
are stated as measured.

Allocator state matters on CPU: with glibc's defaults a fresh 64 MiB tensor usually comes from
a new mmap and pays a page fault per 4 KiB page, so clone() (and every out-of-place op) costs
several times copy_(); `--malloc reuse` raises glibc's mmap and trim thresholds so that freed
memory is reused, the steady state of a training loop with a caching allocator, where clone()
costs about as much as copy_().

    python benchmarks/quantize.py [--size 4096] [--repeats 12] [--compile] [--threads N]
                                  [--malloc {default,reuse}] [--device {cpu,cuda}]
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.quantization import dispatch, kernels  # noqa: E402
from megatron.quantization.formats import format_info  # noqa: E402


def fake_quantize(x, fmt, **options):
    """The eager column: the definition, whatever the device."""
    return dispatch.fake_quantize(x, fmt, kernels="eager", **options)


def fake_quantize_compiled(x, fmt, **options):
    return dispatch.fake_quantize(x, fmt, kernels="compile", **options)

# label: (format, fake_quantize options)
CASES = {
    "mxfp8_e4m3": ("mxfp8_e4m3", {}),
    "mxfp8_e5m2": ("mxfp8_e5m2", {}),
    "mxfp4": ("mxfp4", {}),
    "hifp8": ("hifp8", {}),
    "nvfp4": ("nvfp4", {}),
    "mxfp6_e2m3": ("mxfp6_e2m3", {}),
    "mxfp6_e3m2": ("mxfp6_e3m2", {}),
    "fp8_e4m3": ("fp8_e4m3", {"scaling": "tensor"}),
    "fp8_e4m3_1x128": ("fp8_e4m3", {"scaling": "block", "block": (1, 128)}),
    "nvfp4_16x16": ("nvfp4", {"block_2d": True}),
    "nvfp4_rht16": ("nvfp4", {"rht": (16, 0)}),
}
FORMATS = tuple(CASES)
TARGETS = {"mxfp8_e4m3": 4.0, "mxfp8_e5m2": 4.0, "mxfp4": 8.0, "hifp8": 8.0}
TORCHAO_SPEEDUP_TARGET = 2.0       # MXFP8 must be at least this much faster than torchao
TORCHAO_MX_DTYPES = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2",
                     "mxfp4": "float4_e2m1fn_x2", "mxfp6_e2m3": "fp6_e2m3",
                     "mxfp6_e3m2": "fp6_e3m2"}


# Peak memory bandwidth (GB/s) by device name, for the kernel column's fraction.
PEAK_BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 NVL": 3900,
                      "H100 PCIe": 2000, "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935,
                      "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555, "L40S": 864,
                      "RTX 4090": 1008, "B200": 8000, "GB200": 8000}


def peak_bandwidth_gbs(device: torch.device):
    """The device's peak memory bandwidth in GB/s, where its name is in the table."""
    name = torch.cuda.get_device_name(device)
    for key, gbs in PEAK_BANDWIDTH_GBS.items():
        if key in name:
            return gbs
    return None


def triton_candidates(device: torch.device) -> dict:
    """{label: fused Triton quantize-dequantize} for the formats the kernels cover, on CUDA."""
    if device.type != "cuda":
        print("triton kernel: needs a CUDA device (the kernel column is left out on the CPU)")
        return {}
    if not kernels.triton_available():
        print("triton kernel: not available: triton is not importable")
        return {}
    found = {}
    for label, (fmt, options) in CASES.items():
        kind = format_info(fmt).kind
        if kernels.unsupported_reason(kind, fmt, torch.float32, "nearest"):
            continue
        found[label] = lambda t, f=fmt, o=options: dispatch.fake_quantize(t, f, kernels="triton",
                                                                         **o)
    return found


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _torchao_mx():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    def make(label):
        name = TORCHAO_MX_DTYPES[label]
        elem = getattr(torch, name) if hasattr(torch, name) else name   # fp6: a string

        def qdq(x):
            scale, data = to_mx(x, elem, 32, ScaleCalculationMode.FLOOR)
            return to_dtype(data, scale, elem, 32, x.dtype)

        return qdq

    return {label: make(label) for label in TORCHAO_MX_DTYPES}


def _torchao_nvfp4():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def qdq(x):
        scale = per_tensor_amax_to_scale(x.abs().max())
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)

    return {"nvfp4": qdq}


def _torchao_fp8_tensorwise():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    def qdq(x):
        return hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn,
                                           LinearMMConfig()).to_original_precision()

    return {"fp8_e4m3": qdq}


def _torchao_fp8_1x128():
    """torchao's pure-torch 1x128 quantizer, compiled from the source of its module (which
    imports triton at the top; the function itself uses torch only)."""
    from torchao.float8.config import e4m3_dtype

    spec = importlib.util.find_spec("torchao.prototype.blockwise_fp8_training")
    path = os.path.join(os.path.dirname(spec.origin), "kernels.py")
    with open(path) as fh:
        tree = ast.parse(fh.read())
    nodes = [n for n in tree.body
             if (isinstance(n, ast.FunctionDef) and n.name == "torch_blockwise_scale_act_quant_lhs")
             or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "EPS"
                                                    for t in n.targets))]
    namespace = {"torch": torch, "e4m3_dtype": e4m3_dtype}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)
    quantize = namespace["torch_blockwise_scale_act_quant_lhs"]

    def qdq(x):
        q, scale_inv = quantize(x)
        rows, cols = x.shape
        out = q.float().view(rows, cols // 128, 128) * scale_inv.view(rows, cols // 128, 1)
        return out.view(rows, cols).to(x.dtype)

    return {"fp8_e4m3_1x128": qdq}


def torchao_candidates() -> dict:
    """{label: torchao quantize-dequantize callable} for the families torchao can run here;
    a family that fails to import is reported and left out (torchao is optional)."""
    found = {}
    for family, build in (("MX", _torchao_mx), ("NVFP4", _torchao_nvfp4),
                          ("float8 tensorwise", _torchao_fp8_tensorwise),
                          ("float8 blockwise", _torchao_fp8_1x128)):
        try:
            found.update(build())
        except Exception as exc:  # torchao is optional
            print(f"torchao {family}: not available: {_reason(exc)}")
    return found


def available(probe: torch.Tensor, candidates: dict, prefix: str = "") -> dict:
    """The candidates that run on the probe tensor; the others are reported and dropped (a
    format whose implementation is not there yet, a shape torchao does not take)."""
    ok = {}
    for label, fn in candidates.items():
        try:
            fn(probe)
        except Exception as exc:
            print(f"{prefix}{label}: not available: {_reason(exc)}")
            continue
        ok[label] = fn
    return ok


def interleaved_ms(candidates: dict, repeats: int, passes: int = 3,
                   sync=lambda: None) -> dict:
    """Median wall time (ms) of each callable over `repeats` timed calls, split into `passes`
    interleaved runs, each run after one untimed warm-up call. Names starting with "torchao"
    are slow and get a single call per pass. `sync` waits for the device (CUDA)."""
    per_pass = max(1, -(-repeats // passes))
    times = {name: [] for name in candidates}
    for _ in range(passes):
        for name, fn in candidates.items():
            fn()
            sync()
            for _ in range(1 if name.startswith("torchao") else per_pass):
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run(size: int, repeats: int, compile_too: bool, device: str = "cpu") -> list:
    torch.manual_seed(0)
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ao_all = torchao_candidates()
    tri_all = triton_candidates(device)
    peak = peak_bandwidth_gbs(device) if tri_all else None
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        x = torch.randn(size, size, dtype=dtype, device=device)
        y = torch.empty_like(x)
        print(f"\n{name} [{size} x {size}]")
        ours = available(x, {label: (lambda t, f=f, o=o: fake_quantize(t, f, **o))
                             for label, (f, o) in CASES.items()})
        ao = available(x, {label: fn for label, fn in ao_all.items() if label in ours},
                       prefix="torchao ")
        tri = available(x, {label: fn for label, fn in tri_all.items() if label in ours},
                        prefix="triton ")
        candidates = {"clone": lambda: x.clone(), "copy_": lambda: y.copy_(x)}
        for label in ours:
            fmt, options = CASES[label]
            candidates[f"eager {label}"] = lambda f=fmt, o=options: fake_quantize(x, f, **o)
            if compile_too:
                candidates[f"compiled {label}"] = \
                    lambda f=fmt, o=options: fake_quantize_compiled(x, f, **o)
            if label in ao:
                candidates[f"torchao {label}"] = lambda fn=ao[label]: fn(x)
            if label in tri:
                candidates[f"triton {label}"] = lambda fn=tri[label]: fn(x)
        ms = interleaved_ms(candidates, repeats, sync=sync)
        clone = ms["clone"]
        print(f"  clone {clone:8.2f} ms   copy_ {ms['copy_']:8.2f} ms")
        print(f"  {'format':<15} {'eager ms':>9} {'x clone':>8} {'target':>7}"
              + (f" {'compiled':>9} {'x clone':>8}" if compile_too else "")
              + (f" {'torchao':>9} {'ao/eager':>9}" if ao_all else "")
              + (f" {'triton':>9} {'GB/s':>7} {'of peak':>7}" if tri_all else ""))
        for label in ours:
            eager = ms[f"eager {label}"]
            row = {"dtype": name, "format": label, "clone": clone, "copy": ms["copy_"],
                   "eager": eager}
            target = TARGETS.get(label)
            line = f"  {label:<15} {eager:9.2f} {eager / clone:7.2f}x " + (
                f"{target:6.0f}x" if target else f"{'-':>7}")
            if compile_too:
                row["compiled"] = ms[f"compiled {label}"]
                line += f" {row['compiled']:9.2f} {row['compiled'] / clone:7.2f}x"
            if f"torchao {label}" in ms:
                row["torchao"] = ms[f"torchao {label}"]
                line += f" {row['torchao']:9.2f} {row['torchao'] / eager:8.2f}x"
            elif ao_all:
                line += f" {'-':>9} {'-':>9}"
            if f"triton {label}" in ms:
                row["triton"] = ms[f"triton {label}"]
                row["triton_gbs"] = 2 * x.numel() * x.element_size() / row["triton"] / 1e6
                line += f" {row['triton']:9.3f} {row['triton_gbs']:7.0f} " + (
                    f"{row['triton_gbs'] / peak:6.0%}" if peak else f"{'-':>7}")
            elif tri_all:
                line += f" {'-':>9} {'-':>7} {'-':>7}"
            if target:
                met = eager <= target * clone
                if label.startswith("mxfp8") and "torchao" in row:
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
                        help="also time fake_quantize with kernels='compile' (torch.compile, dynamic=True)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the tensors live (default: cuda when present); the "
                             "Triton kernel column needs cuda")
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
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    run(args.size, args.repeats, args.compile, args.device)


if __name__ == "__main__":
    main()
