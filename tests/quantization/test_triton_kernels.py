"""The fused Triton kernels (MX and NVFP4 with round to nearest and stochastic rounding, HiFP8)
are bit for bit the eager fake_quantize.

The kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before triton is
first imported, and must not reach the other test modules, so the comparisons run in one
subprocess (this file run as a script, `python tests/quantization/test_triton_kernels.py`),
which prints
one JSON line: for each case, None when the kernel and eager agree on every bit (NaN with NaN,
whatever the payload), else a description of the first mismatches. The tests below read it.
The dispatch checks that need no kernel run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, child_env
from interpreted import require_interpreter, run_interpreted

MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4")
SCALE_MODES = ("floor", "rceil", "ceil", "even")
STOCHASTIC_SCALE_MODES = ("floor", "rceil")    # the scale code is the same for every rounding
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Test inputs (built the same way in both processes)
# ---------------------------------------------------------------------------------------------

def wide_random(shape, seed) -> torch.Tensor:
    """Random signs, mantissas and exponents over most of the float32 range, subnormals too."""
    g = torch.Generator().manual_seed(seed)
    mant = 1 + torch.rand(shape, generator=g)
    exp = torch.randint(-150, 100, shape, generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    # Per-row offsets give blocks of very different scales.
    return sign * mant * torch.exp2(exp) * torch.exp2(torch.randint(-20, 20, shape[:1],
                                                                    generator=g).float()
                                                      .reshape((-1,) + (1,) * (len(shape) - 1)))


def special_values() -> torch.Tensor:
    """Rows of 70 (two full blocks and a 6-element tail) holding the edge cases."""
    nan, inf = float("nan"), float("inf")
    f32max = torch.finfo(torch.float32).max
    rows = torch.linspace(-3, 3, 70).repeat(16, 1)
    rows[0, :] = 0.0                                    # all-zero blocks and tail
    rows[1, :32] = -0.0                                 # negative zeros
    rows[1, 40] = -0.0
    rows[2, 3], rows[2, 64] = nan, nan                  # NaN in a block and in the tail
    rows[3, 5], rows[3, 40] = inf, -inf
    rows[4, 0], rows[4, 33] = f32max, -f32max           # huge (rceil overflows to Inf: P12)
    rows[4, 1], rows[4, 34] = 3.0e38, 1.0e-30
    rows[5, :] = torch.tensor([1e-40, -1e-45, 2.0 ** -149, -(2.0 ** -126) * 0.75,
                               5.877472e-39, -2.9e-39, 0.0, -0.0, 1.4e-45, 1.1754942e-38]
                              * 7)                      # fp32 subnormals only (scale 2**-127)
    rows[6, :] = 2.0 ** -125 * torch.linspace(-1, 1, 70)  # tiny blocks
    rows[7, :] = 2.0 ** torch.arange(-60, 10).float()   # wide range within blocks
    rows[8, 1::2] = -1e-38                              # tiny negatives flush to -0
    rows[9, :] = torch.tensor([2.0 ** k * (1 - 2.0 ** -24) for k in range(-35, 35)])  # below 2**k
    rows[10, :] = torch.tensor([2.0 ** k for k in range(-35, 35)])  # powers of two
    rows[11, :] = 448.0 * torch.linspace(-1.2, 1.2, 70)
    rows[12, :] = 57344.0 * torch.linspace(-1.2, 1.2, 70)
    rows[13, :] = 6.0 * torch.linspace(-1.3, 1.3, 70)
    rows[14, 0] = 1e-40                                 # a subnormal beside normal values
    rows[15, :] = -rows[15, :]
    # The "even" rule's thresholds 2 - 2**-(mbits + 1) (E2M1, E3M2/E5M2, E4M3/E2M3) times
    # powers of two, and the float32 values just below them.
    at = torch.tensor([c * 2.0 ** k for k in range(-12, 12)
                       for c in (1.75, 1.875, 1.9375)])[:70]
    rows = torch.cat([rows, at[None], torch.nextafter(at, torch.zeros_like(at))[None]])
    return rows


def grid_midpoints(fmt: str) -> torch.Tensor:
    """Blocks scaled by 2**0 (amax = max_normal) holding every element value, every midpoint
    between neighbours (ties) and the float32 neighbours of each midpoint."""
    from megatron.quantization.formats import fake_quantize, format_info
    info = format_info(fmt)
    dense = torch.cat([torch.linspace(-info.max_normal, info.max_normal, 20001),
                       torch.linspace(-8 * info.min_normal, 8 * info.min_normal, 20001)])
    padded = torch.cat([dense.reshape(-1, 1),
                        torch.full((dense.numel(), 31), info.max_normal)], 1)
    grid = torch.unique(fake_quantize(padded, fmt)[:, 0])
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]),
                        torch.nextafter(mid, grid[:-1])])
    values = torch.cat([values, torch.zeros(-values.numel() % 31)])
    blocks = values.reshape(-1, 31)
    return torch.cat([blocks, torch.full((blocks.shape[0], 1), info.max_normal)], 1)


# ---------------------------------------------------------------------------------------------
# The subprocess: kernel against eager
# ---------------------------------------------------------------------------------------------

def _mismatch(kernel: torch.Tensor, eager: torch.Tensor):
    if kernel.dtype != eager.dtype or kernel.shape != eager.shape:
        return f"dtype/shape {kernel.dtype} {tuple(kernel.shape)} vs {eager.dtype} " \
               f"{tuple(eager.shape)}"
    nan_k, nan_e = torch.isnan(kernel), torch.isnan(eager)
    if not torch.equal(nan_k, nan_e):
        return f"NaN at {int((nan_k != nan_e).sum())} different positions"
    bits = torch.int16 if kernel.dtype == torch.bfloat16 else torch.int32
    differ = (kernel.view(bits) != eager.view(bits)) & ~nan_e
    if differ.any():
        return (f"{int(differ.sum())} elements differ, e.g. kernel "
                f"{kernel[differ][:4].tolist()} eager {eager[differ][:4].tolist()}")
    return None


def run_cases() -> dict:
    from megatron.quantization import kernels
    from megatron.quantization.dispatch import fake_quantize

    from megatron.quantization.formats.mx import mx_fake_quantize
    from megatron.quantization.kernels.mx import mx_fake_quantize_triton

    calls = []
    original = kernels.triton_fake_quantize

    def counted(x, call, noise):
        calls.append(call.fmt)
        return original(x, call, noise)
    kernels.triton_fake_quantize = counted

    def compare(x, fmt, axis=-1, mode="floor", seed=None, **options):
        if seed is not None:
            options["generator"] = torch.Generator().manual_seed(seed)
        eager = fake_quantize(x, fmt, axis, mode, kernels="eager", **options)
        if seed is not None:
            options["generator"] = torch.Generator().manual_seed(seed)
        before = len(calls)
        kernel = fake_quantize(x, fmt, axis, mode, kernels="triton", **options)
        if len(calls) != before + 1:
            return "the Triton kernel was not called"
        return _mismatch(kernel, eager)

    results = {}
    random3d = wide_random((35, 6, 40), seed=1)         # tails on axes 0 and 2, inner > 1
    special = special_values()
    # Blocks of scale about 2**10 holding values whose x * 2**-e is an fp32 subnormal, some
    # rounding to zero there (at or below 2**-150), some not.
    tiny = 2.0 ** -149
    subnormal_scaled = torch.tensor([1000.0, -700.0, tiny, -tiny, 3 * tiny, -5 * tiny,
                                     2.0 ** -140, 1e-40, -3e-39, 2.0 ** -130, 0.0, -0.0,
                                     1.5 * 2.0 ** -120, 1.0, 2.0 ** -126, 7 * 2.0 ** -146]
                                    * 4).reshape(2, 32).repeat(8, 1)
    subnormal_scaled[4:] *= 2.0 ** 20
    for fmt in MX_FORMATS:
        mids = grid_midpoints(fmt)
        for mode in SCALE_MODES:
            for dname, dtype in DTYPES.items():
                for axis in (0, 1, 2, -1):
                    results[f"random3d {fmt} {mode} {dname} axis={axis}"] = compare(
                        random3d.to(dtype), fmt, axis, mode)
                for axis in (0, 1, -1):
                    results[f"specials {fmt} {mode} {dname} axis={axis}"] = compare(
                        special.to(dtype), fmt, axis, mode)
                results[f"midpoints {fmt} {mode} {dname}"] = compare(
                    mids.to(dtype), fmt, -1, mode)
                # Stochastic rounding through fake_quantize (the same generator state), and
                # with uniform numbers that include zeros (a zero rounds up anything off the
                # grid, also fp32 subnormals that eager's x * 2**-e keeps or flushes).
                if mode not in STOCHASTIC_SCALE_MODES:
                    continue
                for axis in (0, -1):
                    results[f"stochastic {fmt} {mode} {dname} axis={axis}"] = compare(
                        special.to(dtype), fmt, axis, mode, seed=7, rounding="stochastic")
                for name, x in (("specials", special), ("midpoints", mids),
                                ("subnormal scaled", subnormal_scaled)):
                    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(8))
                    noise[::2, ::3] = 0.0
                    noise[1::4] = 0.0
                    xd = x.to(dtype)
                    results[f"stochastic zeros {name} {fmt} {mode} {dname}"] = _mismatch(
                        mx_fake_quantize_triton(xd, fmt, 1, mode, noise),
                        mx_fake_quantize(xd, fmt, 1, mode, noise))
    # More blocks than one program takes (partial last group), a non-contiguous input, a
    # 1-D tensor shorter than a block, a 4-D tensor.
    results["many blocks"] = compare(wide_random((3, 700, 65), seed=2), "mxfp8_e4m3", 1,
                                     "floor")
    results["transposed view"] = compare(wide_random((64, 50), seed=3).t(), "mxfp4", 0,
                                         "rceil")
    results["short 1-D"] = compare(wide_random((7,), seed=4), "mxfp6_e3m2", 0, "floor")
    results["4-D bf16"] = compare(wide_random((2, 3, 33, 5), seed=5).bfloat16(),
                                  "mxfp8_e5m2", 2, "rceil")
    # HiFP8: every bf16 bit pattern, its float32 values and their midpoint neighbours,
    # the thresholds, random values; plain cast and saturating.
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16)
    wide = every_bf16.float()
    near = torch.cat([wide, torch.nextafter(wide, torch.full_like(wide, 1e38)),
                      torch.nextafter(wide, torch.full_like(wide, -1e38)),
                      torch.tensor([40960.0, -40960.0, 40959.996, 49152.0, 36864.0, 2.0 ** -23,
                                    -(2.0 ** -23), 2.0 ** -23 * 0.99, 1.5 * 2.0 ** -17, 1.0625,
                                    1.1875, -0.0, 3e38])])
    # NVFP4 (1-D blocks of 16): its own and imposed tensor amax, NaN/Inf tensors (all NaN),
    # tiny tensors (subnormal scales), stochastic rounding.
    from megatron.quantization.formats.nvfp4 import nvfp4_fake_quantize
    from megatron.quantization.kernels.nvfp4 import nvfp4_fake_quantize_triton
    finite_rows = special[[0, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    nv_inputs = {"random3d": random3d, "specials": special, "finite specials": finite_rows,
                 "tiny": wide_random((20, 40), seed=10) * 1e-30,
                 "subnormal": torch.tensor([1e-40, -3e-39, 2.0 ** -149, 0.0] * 10).reshape(2, 20)}
    for name, x in nv_inputs.items():
        for dname, dtype in DTYPES.items():
            xd = x.to(dtype)
            for axis in range(x.dim()):
                for amax in (None, 3.0, 1e-30, 0.0, float("inf")):
                    results[f"nvfp4 {name} {dname} axis={axis} amax={amax}"] = compare(
                        xd, "nvfp4", axis, amax=amax)
                results[f"nvfp4 stochastic {name} {dname} axis={axis}"] = compare(
                    xd, "nvfp4", axis, seed=11, rounding="stochastic")
            noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(12))
            noise.view(-1)[::3] = 0.0
            results[f"nvfp4 stochastic zeros {name} {dname}"] = _mismatch(
                nvfp4_fake_quantize_triton(xd, 0, noise), nvfp4_fake_quantize(xd, 0, False,
                                                                                noise, None))
            # 16x16 tiles (weights): 2-D inputs with tails on both axes.
            if x.dim() == 2:
                for amax in (None, 3.0, 0.0, float("inf")):
                    results[f"nvfp4 2-D tiles {name} {dname} amax={amax}"] = compare(
                        xd, "nvfp4", 1, amax=amax, block_2d=True)
                results[f"nvfp4 2-D tiles stochastic {name} {dname}"] = compare(
                    xd, "nvfp4", 0, seed=13, block_2d=True, rounding="stochastic")
                results[f"nvfp4 2-D tiles stochastic zeros {name} {dname}"] = _mismatch(
                    nvfp4_fake_quantize_triton(xd, 0, noise, None, True),
                    nvfp4_fake_quantize(xd, 0, True, noise, None))
    results.update(fp8_cases(compare, random3d, special))
    results.update(hadamard_cases(compare))
    results.update(delayed_linear_cases())
    for saturate in (False, True):
        results[f"hifp8 every bf16 saturate={saturate}"] = compare(
            every_bf16, "hifp8", saturate=saturate)
        results[f"hifp8 float32 saturate={saturate}"] = compare(near, "hifp8", saturate=saturate)
        results[f"hifp8 random saturate={saturate}"] = compare(
            wide_random((50, 70), seed=9), "hifp8", saturate=saturate)
        results[f"hifp8 specials saturate={saturate}"] = compare(
            special.bfloat16(), "hifp8", saturate=saturate)
    return results


def hadamard_cases(compare) -> dict:
    """The random Hadamard transform computed in the MX and NVFP4 kernels: every block size,
    both axes of a 3-D input (a non-finite element in one block), float32 and bf16, nearest and
    stochastic; and RHT 16 inside 32-element MX blocks with a half-block tail. Then a linear
    layer with the transform on all three GEMMs: the Triton kernels against eager PyTorch,
    forward and backward."""
    results = {}
    x3 = wide_random((3, 128, 256), seed=18)
    x3[0, 5, 7] = float("inf")
    tail = wide_random((6, 48), seed=19)
    for fmt in ("mxfp4", "mxfp8_e5m2", "nvfp4"):
        for dname, dtype in DTYPES.items():
            for block in (16, 32, 64, 128):
                for axis in (1, 2):
                    results[f"rht {fmt} {dname} block={block} axis={axis}"] = compare(
                        x3.to(dtype), fmt, axis, rht=(block, 5))
                results[f"rht stochastic {fmt} {dname} block={block}"] = compare(
                    x3[1:].to(dtype), fmt, 1, seed=20, rounding="stochastic", rht=(block, 6))
            results[f"rht tail {fmt} {dname}"] = compare(tail.to(dtype), fmt, 1, rht=(16, 7))
    results.update(hadamard_linear_cases())
    return results


def hadamard_linear_cases() -> dict:
    from megatron.quantization.config import (
        BackendSettings, MatmulQuantConfig, OperandFormats, RhtSettings)
    from megatron.quantization.gemm import SiteState
    from megatron.quantization.runtime import QuantRuntime
    results = {}
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    w = torch.randn(96, 64, generator=g).bfloat16()
    grad = torch.randn(2, 32, 96, generator=g).bfloat16()
    for fmt in ("mxfp4", "nvfp4"):
        ops = OperandFormats(fmt, fmt)
        cfg = MatmulQuantConfig(fprop=ops, dgrad=ops, wgrad=ops,
                                stochastic=frozenset({"dgrad.a", "wgrad.b"}),
                                rht=RhtSettings(("fprop", "dgrad", "wgrad"), 16, 8))
        states = {mode: SiteState("layer", cfg, QuantRuntime(BackendSettings(kernels=mode)))
                  for mode in ("eager", "triton")}
        for state in states.values():
            state.runtime.start_iteration(seed=1, iteration=1)
        for name, mismatch in linear_in_both_modes(cfg, states, x, w, grad).items():
            results[f"rht linear {fmt} {name}"] = mismatch
    return results


def linear_in_both_modes(cfg, states, x, w, grad) -> dict:
    """{result: mismatch} of one forward and backward of a linear layer with the Triton
    kernels (states["triton"]) against eager PyTorch (states["eager"])."""
    from megatron.quantization.gemm import quantized_linear
    outs = {}
    for mode, state in states.items():
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_linear(xi, wi, None, cfg, state=state)
        y.backward(grad)
        outs[mode] = (y.detach(), xi.grad, wi.grad)
    return {name: _mismatch(a, b) for name, a, b in zip(("y", "dx", "dw"), outs["triton"],
                                                          outs["eager"])}


def vector_access() -> dict:
    """Every QDQ kernel compiled for sm_90 (no GPU needed) as the launches specialise it, and
    the kinds of its global loads and stores, and its instructions that flush subnormals to
    zero ("ftz"): {kernel: {instruction: count}}."""
    import re
    from collections import Counter

    from megatron.quantization.kernels import offline
    out = {}
    for name, (*launch, _) in offline.qdq_launches().items():
        ptx = offline.compile_for(*launch).asm["ptx"]
        out[name] = dict(Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)),
                         ftz=len(re.findall(r"\.ftz\b", ptx)))
    return out


def delayed_linear_cases() -> dict:
    """A linear layer with delayed FP8 scaling over four steps of very different amaxes, the
    amax kernel writing each operand's amax into its history entry: the Triton kernels against
    eager PyTorch (results and histories), for both amax algorithms."""
    from megatron.quantization.config import (
        BackendSettings, Fp8Settings, MatmulQuantConfig, OperandFormats)
    from megatron.quantization.gemm import SiteState
    from megatron.quantization.runtime import QuantRuntime
    results = {}
    g = torch.Generator().manual_seed(22)
    for algo in ("max", "most_recent"):
        cfg = MatmulQuantConfig(fprop=OperandFormats("fp8_e4m3", "fp8_e4m3"),
                                dgrad=OperandFormats("fp8_e5m2", "fp8_e4m3"),
                                wgrad=OperandFormats("fp8_e4m3", "fp8_e5m2"),
                                fp8=Fp8Settings(recipe="delayed", amax_history_len=3,
                                                amax_compute_algo=algo))
        states = {mode: SiteState("layer", cfg, QuantRuntime(BackendSettings(kernels=mode)))
                  for mode in ("eager", "triton")}
        for step, scale in enumerate((1.0, 300.0, 0.01, 2.0)):
            x = (torch.randn(24, 64, generator=g) * scale).bfloat16()
            w = torch.randn(48, 64, generator=g).bfloat16()
            grad = (torch.randn(24, 48, generator=g) / scale).bfloat16()
            for name, mismatch in linear_in_both_modes(cfg, states, x, w, grad).items():
                results[f"delayed linear {algo} step={step} {name}"] = mismatch
        histories = [state.amax.state_dict() for state in states.values()]
        results[f"delayed linear {algo} histories"] = (
            None if histories[0] == histories[1] else f"{histories[1]} vs {histories[0]}")
    return results


def fp8_cases(compare, random3d, special) -> dict:
    """FP8 E4M3/E5M2: current scaling (NaN/Inf tensors all NaN), delayed scaling from an
    imposed amax (0, tiny, Inf, NaN: the scale's special cases), margins and power-of-two
    scales, 1x128 blocks along every axis (tails), 128x128 tiles of 2-D inputs larger than one
    tile, stochastic rounding."""
    results = {}
    tiles = wide_random((200, 150), seed=14)
    tiles[130:140, 10] = float("inf")                  # one tile NaN, the others not
    inputs = {"random3d": random3d, "specials": special, "tiles": tiles,
              "tiny": wide_random((20, 40), seed=15) * 1e-37,
              "whole blocks": wide_random((6, 256), seed=23)}
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        for name, x in inputs.items():
            for dname, dtype in DTYPES.items():
                xd = x.to(dtype)
                for amax in (None, 3.0, 1e-30, 0.0, float("inf"), float("nan")):
                    for margin, pow2 in ((0, False), (2, True), (-1.5, False)):
                        results[f"{fmt} tensor {name} {dname} amax={amax} margin={margin} "
                                f"pow2={pow2}"] = compare(xd, fmt, scaling="tensor", amax=amax,
                                                          margin=margin, pow2_scale=pow2)
                for axis in range(x.dim()):
                    for pow2 in (False, True):
                        results[f"{fmt} 1x128 {name} {dname} axis={axis} pow2={pow2}"] = compare(
                            xd, fmt, axis, scaling="block", block=(1, 128), pow2_scale=pow2)
                if x.dim() == 2:
                    results[f"{fmt} 128x128 {name} {dname}"] = compare(
                        xd, fmt, scaling="block", block=(128, 128), margin=1)
                results[f"{fmt} tensor stochastic {name} {dname}"] = compare(
                    xd, fmt, scaling="tensor", seed=16, rounding="stochastic")
                results[f"{fmt} 1x128 stochastic {name} {dname}"] = compare(
                    xd, fmt, 0, scaling="block", seed=17, rounding="stochastic")
    return results


# ---------------------------------------------------------------------------------------------
# The tests (this process never imports triton)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_results():
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("group", ["random3d", "specials", "midpoints"])
def test_mx_kernel_is_bit_exact(kernel_results, group):
    cases = {k: v for k, v in kernel_results.items() if k.startswith(group + " ")}
    # every format, scale rule and dtype (and, but for midpoints, axis) was run
    assert len(cases) == len(MX_FORMATS) * len(SCALE_MODES) * 2 * {"random3d": 4, "specials": 3,
                                                    "midpoints": 1}[group]
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


@pytest.mark.parametrize("group, count", [("stochastic", 40), ("stochastic zeros", 60)])
def test_mx_stochastic_kernel_is_bit_exact(kernel_results, group, count):
    cases = {k: v for k, v in kernel_results.items() if k.startswith(group + " ")
             and (group == "stochastic zeros" or not k.startswith("stochastic zeros "))}
    assert len(cases) == count
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


def test_nvfp4_kernel_is_bit_exact(kernel_results):
    cases = {k: v for k, v in kernel_results.items()
             if k.startswith("nvfp4 ") and not k.startswith("nvfp4 2-D tiles ")}
    # 5 inputs (one 3-D, four 2-D) x 2 dtypes x (axes x (5 amax + stochastic) + zero noise)
    assert len(cases) == 2 * ((3 + 4 * 2) * 6 + 5)
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


def test_hadamard_transform_in_the_kernels_is_bit_exact(kernel_results):
    cases = {k: v for k, v in kernel_results.items() if k.startswith("rht ")}
    # 3 formats x 2 dtypes x (4 blocks x (2 axes + stochastic) + tail) + 2 linear layers x 3
    assert len(cases) == 3 * 2 * (4 * 3 + 1) + 2 * 3
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


def test_nvfp4_2d_tile_kernel_is_bit_exact(kernel_results):
    cases = {k: v for k, v in kernel_results.items() if k.startswith("nvfp4 2-D tiles ")}
    # four 2-D inputs x 2 dtypes x (4 amax + stochastic + zero noise)
    assert len(cases) == 4 * 2 * 6
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


def test_kernels_move_the_operands_in_16_byte_vectors():
    """The QDQ kernels compiled for sm_90 (in a process without the interpreter; no GPU
    needed): every element load and store of the operand is a 16-byte vector access (4
    float32 or 8 bf16 values), along whichever axis the blocks run; the only scalar loads are
    the per-tensor amax and the Hadamard signs. And no instruction flushes subnormals to zero
    (.ftz): the MX rounding to nearest is float arithmetic that must keep them, as numpy does
    under the interpreter."""
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-sm90"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    access = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(access) == 2 * (3 * 2 + 4)
    for name, kinds in access.items():
        assert kinds.pop("ftz") == 0, name
        if name.startswith("amax "):        # loads only; one atomic per program
            assert set(kinds) == {"ld.global.v4.b32"}, (name, kinds)
            continue
        stores = {k: n for k, n in kinds.items() if k.startswith("st.")}
        assert set(stores) == {"st.global.v4.b32"}, (name, kinds)
        vector_loads = kinds.get("ld.global.v4.b32", 0)
        assert vector_loads >= stores["st.global.v4.b32"], (name, kinds)
        scalar_loads = sum(n for k, n in kinds.items() if k.startswith("ld.") and "v4" not in k)
        assert scalar_loads <= (6 if "rht" in name else 1), (name, kinds)


def test_delayed_scaling_with_the_amax_kernel_is_bit_exact(kernel_results):
    cases = {k: v for k, v in kernel_results.items() if k.startswith("delayed linear ")}
    assert len(cases) == 2 * (4 * 3 + 1)          # 2 algorithms x (4 steps x 3 results + 1)
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


@pytest.mark.parametrize("scaling, count", [
    ("tensor", 2 * 5 * 2 * (6 * 3 + 1)),          # formats x inputs x dtypes x (amax x margin
    ("1x128", 2 * 2 * (3 + 2 + 2 + 2 + 2) * 2 + 2 * 5 * 2),   # + SR); axes x pow2 + SR
    ("128x128", 2 * 4 * 2),                        # the 2-D inputs
])
def test_fp8_kernel_is_bit_exact(kernel_results, scaling, count):
    cases = {k: v for k, v in kernel_results.items()
             if k.startswith("fp8_") and k.split()[1] == scaling}
    assert len(cases) == count
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


def test_hifp8_kernel_is_bit_exact(kernel_results):
    cases = {k: v for k, v in kernel_results.items() if k.startswith("hifp8 ")}
    assert len(cases) == 8
    failures = {k: v for k, v in cases.items() if v is not None}
    assert not failures, failures


@pytest.mark.parametrize("case", ["many blocks", "transposed view", "short 1-D", "4-D bf16"])
def test_mx_kernel_layouts(kernel_results, case):
    assert kernel_results[case] is None, kernel_results[case]


@pytest.fixture
def no_interpreter(monkeypatch):
    """This process without Triton's interpreter: the kernels cannot run on CPU tensors."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_kernel_mode_is_an_explicit_argument(no_interpreter):
    """No process-global mode: fake_quantize and a model's BackendSettings default to "auto";
    "compile" and "eager" are taken as asked, "auto" runs CPU tensors eagerly; an unknown mode
    is an error naming the valid ones."""
    import inspect

    from megatron.quantization import dispatch, formats
    from megatron.quantization.config import KERNEL_MODES, BackendSettings
    assert KERNEL_MODES == ("auto", "triton", "compile", "eager")
    assert inspect.signature(dispatch.fake_quantize).parameters["kernels"].default == "auto"
    assert BackendSettings().kernels == "auto"
    x = torch.ones(4, 32)
    call = formats.prepare_call(x, "mxfp8")
    assert [dispatch.quantize_backend(x, call, mode) for mode in ("auto", "compile", "eager")] \
        == ["eager", "compile", "eager"]
    assert dispatch.check_kernel_mode("triton") == "triton"
    with pytest.raises(ValueError, match="unknown kernel mode 'cuda'; valid: auto, triton, "
                                         "compile, eager"):
        dispatch.check_kernel_mode("cuda")
    with pytest.raises(ValueError, match="unknown kernel mode 'cuda'"):
        dispatch.fake_quantize(x, "mxfp8", kernels="cuda")
    with pytest.raises(ValueError, match="--quant-kernels 'cuda': not one of auto, triton, "
                                         "compile, eager"):
        BackendSettings(kernels="cuda")


def test_auto_mode_on_cpu_is_eager(no_interpreter, monkeypatch):
    from megatron.quantization import kernels
    from megatron.quantization.dispatch import fake_quantize
    monkeypatch.setattr(kernels, "triton_fake_quantize",
                        lambda *a: pytest.fail("the kernel ran on a CPU tensor in auto mode"))
    x = wide_random((4, 64), seed=6)
    eager = fake_quantize(x, "mxfp8", kernels="eager")
    assert torch.equal(fake_quantize(x, "mxfp8", kernels="auto"), eager)
    assert torch.equal(fake_quantize(x, "mxfp8"), eager)        # "auto" is the default


@pytest.mark.parametrize("fmt, options, dtype, message", [
    ("nvfp4", {"four_over_six": "mae"}, torch.float32, "NVFP4 4/6"),
    ("bf16", {}, torch.float32, "format 'bf16'"),
    ("mxfp8", {}, torch.float16, "dtype torch.float16"),
    ("hifp8", {}, torch.float64, "dtype torch.float64"),
    ("mxfp8", {}, torch.float32, "a tensor on cpu"),
])
def test_triton_mode_names_what_it_does_not_cover(no_interpreter, fmt, options, dtype, message):
    from megatron.quantization.dispatch import fake_quantize
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        fake_quantize(torch.ones(4, 32, dtype=dtype), fmt, kernels="triton", **options)


MINIMAL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "5",
                "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "100"]


@pytest.mark.parametrize("argv, mode", [
    ([], "auto"), (["--quant-kernels", "triton"], "triton"),
    (["--quant-kernels", "eager"], "eager"), (["--quant-kernels", "compile"], "compile"),
])
def test_quant_kernels_flag(argv, mode):
    """The flag sets the kernel mode of the run's QuantConfig (its sites' runtime)."""
    from megatron.training.arguments import parse_args, validate_args
    args = parse_args(MINIMAL_ARGS + argv)
    args.world_size = 1
    args = validate_args(args, check_paths=False)
    assert args.quant_kernels == mode and args.quant_config.backend.kernels == mode


def test_an_unknown_quant_kernels_value_is_an_error(capsys):
    from megatron.quantization.config import SettingError, settings_from_flags
    from megatron.training.arguments import parse_args
    with pytest.raises(SystemExit):
        parse_args(MINIMAL_ARGS + ["--quant-kernels", "cuda"])
    assert "invalid choice: 'cuda'" in capsys.readouterr().err
    with pytest.raises(SettingError, match="'cuda'.*'auto', 'triton', 'compile', 'eager'"):
        settings_from_flags(["--quant-kernels", "cuda"])


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile-sm90"]:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            sys.exit("compile without TRITON_INTERPRET")
        print(json.dumps(vector_access()))
        sys.exit(0)
    require_interpreter()
    import numpy as np
    np.seterr(all="ignore")     # the interpreter's numpy: 1/0 and overflow are intended
    torch.set_num_threads(1)
    print(json.dumps(run_cases()))
