"""Fake quantization (quantize + dequantize) to MXFP8, MXFP6, MXFP4, NVFP4, FP8 (per-tensor and
blockwise scaled), HiFP8, BF16 and FP16, with round-to-nearest or stochastic rounding, and the
random Hadamard transform.

One module per family: `mx` (MXFP8/MXFP6/MXFP4), `nvfp4`, `fp8` (per-tensor current or delayed
scaling, 1x128 / 128x128 blocks), `hifp8`, `elements` (rounding to element grids, nearest and
stochastic), `hadamard`; `common` holds the format descriptions and argument checks. This
module is the single entry point, `fake_quantize`.

`fake_quantize(x, fmt, axis, scale_mode, saturate)` returns a tensor of the same shape and
dtype as `x` whose values are exactly the values the format can hold, chosen by the format's
rounding rule. The result is defined as: upcast the input exactly to float32 (float64 stays
float64), round once to the format, dequantize exactly, cast back to the input dtype at the
end; so there is no double rounding (pitfall P6 of the number-formats design note). Faster
routes that give bit for bit the same result are taken where they exist (bf16 MX computed
in bf16, a 65536-entry table for 16-bit HiFP8 inputs, torch's fp8 casts for E4M3/E5M2).

MX (OCP Microscaling v1.0)
    Blocks of 32 consecutive elements along `axis` share one power-of-two scale 2**e (an E8M0
    value, e in [-127, 127]). Each element is divided by the scale, rounded to the element
    format (E4M3, E5M2 or E2M1) to nearest with ties to even, keeping the element format's
    subnormals, and finite overflow saturates to +-max_normal (448, 57344, 6; P7, P8, P9).
    The shared exponent comes from the block maximum amax, exactly (from its exponent bits,
    never a float32 log2, which misfloors just below powers of two: P2):

        "floor" (OCP):  e = floor(log2 amax) - emax_elem       (emax_elem = 8, 15, 2)
        "rceil" (NVIDIA recipe): e = ceil(log2(amax / max_normal))

    and clamped to [-127, 127]. An all-zero block gets e = -127 and stays zero (P1). A block
    holding any NaN or +-Inf becomes all NaN, and its exponent is reported as NAN_EXPONENT
    (P3, P4). The scale 2**-127 is a float32 subnormal; it is kept exactly, never flushed or
    clamped to 2**-126 (P5). A length that is not a multiple of 32 is zero-padded for the scale
    computation and cropped (P14): the short tail acts as its own block. Any axis can be the
    block axis (P15: MX does not commute with transposition, so quantize each GEMM operand
    along that GEMM's reduction axis).

HiFP8 (HiFloat8)
    Every value is rounded to the HiF8 grid: 3 mantissa bits for exponents |E| <= 3, 2 bits
    for 4..7, 1 bit for 8..15, and the denormals 2**-22 .. 2**-16 (powers of two only), to
    nearest with ties AWAY from zero (P18). |x| < 2**-23 becomes 0 and 2**-23 itself rounds up
    to 2**-22 (P17). -0 becomes +0 (HiF8 has a single zero, P16). The plain cast
    (saturate=None or False) sends |x| >= 40960 (the midpoint between the largest finite value
    32768 and the Inf code's slot 49152) to +-Inf and keeps NaN; saturate=True clamps finite
    overflow and +-Inf to +-32768 instead. `hifp8_scaled_fake_quantize` adds an optional
    per-tensor power-of-two scale.

The code is pure, vectorised PyTorch and device agnostic. `set_kernels(mode)` picks how it
runs: "auto" (the default) uses the fused Triton kernels of megatron.quantization.kernels for
CUDA tensors when triton is importable and the call is one they cover (MX formats, HiFP8 and
NVFP4 with 1-D blocks, either rounding; float32/bf16), eager PyTorch otherwise; "triton"
insists on them (an error names what they do not cover; CPU tensors only under Triton's
interpreter, TRITON_INTERPRET=1); "compile" runs this implementation through torch.compile
(`set_compile(True)` and `fake_quantize_compiled` are the same); "eager" always runs it as
is. Every mode gives the same bits (NaN payloads aside).

"compile" compiles one function per format kind (MX, NVFP4, FP8, HiFP8, bf16/fp16), whole
(fullgraph, dynamic shapes, Inductor set to keep eager's roundings). Each call hands it x
detached, contiguous and viewed with the blocks on dimensions of their own, the block axis
in the middle ([outer, nblocks, block, inner], the Triton kernels' view; 2-D tiles as
[rows / b, b, cols / b, b]; element-wise and per-tensor formats flat), a tail zero-padded
beforehand and cropped afterwards. So one graph serves every rank, block axis, length and
requires_grad: a graph per distinct (format, dtype, rounding, scale mode, saturate, block_2d,
imposed amax or not, FP8 scaling options), times Dynamo's specialisation of sizes equal to 1
(outer, the number of blocks, inner). Dynamo would run eager PyTorch, in silence, past
torch._dynamo.config.recompile_limit (8) graphs of a function; the compiled calls instead run
under a patch of their own (not the user's other code) that allows COMPILED_GRAPH_LIMIT
graphs per kind and raises past it, as it raises on a compilation error or graph break.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.quantization.formats.common import (  # noqa: F401 (public and package names)
    _INFO, _PASS_THROUGH_DTYPES, FORMAT_NAMES, HIFP8_DEFAULT_TARGET_EXPONENT, HIFP8_MAX,
    HIFP8_OVERFLOW, MAX_SHARED_EXPONENT, MIN_SHARED_EXPONENT, MX_BLOCK_SIZE, NAN_EXPONENT,
    NVFP4_BLOCK_SIZE, SCALE_MODES, FormatInfo, _check_saturate, _check_scale_mode,
    _check_tensor, _normalize_axis, canonical_format, format_info)
from megatron.quantization.formats.elements import (  # noqa: F401 (patched by tests)
    _NATIVE_FP8_CASTS, _round_to_grid_)
from megatron.quantization.formats.fp8 import (
    FP8_BLOCKS, FP8_SCALINGS, FP8_TILE, _check_fp8_options, _fp8_fake_quantize, fp8_amax,
    fp8_scales)
from megatron.quantization.formats.hadamard import (
    hadamard_sign_vector, random_hadamard_transform)
from megatron.quantization.formats.hifp8 import (
    _hifp8_fake_quantize, _prepare_tables as _prepare_hifp8_tables, hifp8_scale_exponent,
    hifp8_scaled_fake_quantize)
from megatron.quantization.formats.mx import (
    _mx_fake_quantize, mx_block_scales, mx_shared_exponents)
from megatron.quantization.formats.nvfp4 import _nvfp4_fake_quantize, nvfp4_scales
from megatron.quantization.formats.rounding import ROUNDINGS, _check_rounding, uniform_noise
from megatron.quantization import kernels as _kernels

__all__ = [
    "FORMAT_NAMES", "SCALE_MODES", "ROUNDINGS", "FP8_SCALINGS", "MX_BLOCK_SIZE",
    "NVFP4_BLOCK_SIZE", "NAN_EXPONENT", "MIN_SHARED_EXPONENT", "MAX_SHARED_EXPONENT",
    "HIFP8_MAX", "HIFP8_OVERFLOW", "HIFP8_DEFAULT_TARGET_EXPONENT", "FormatInfo",
    "canonical_format", "format_info", "fake_quantize", "mx_shared_exponents",
    "mx_block_scales", "nvfp4_scales", "fp8_scales", "fp8_amax", "FP8_BLOCKS", "random_hadamard_transform", "hadamard_sign_vector",
    "hifp8_scaled_fake_quantize",
    "hifp8_scale_exponent", "fake_quantize_compiled", "set_compile", "compile_enabled",
    "KERNEL_MODES", "set_kernels", "kernels_mode", "COMPILED_GRAPH_LIMIT",
]


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------

def _fake_quantize_impl(x: torch.Tensor, fmt: str, axis: int, scale_mode: str,
                        saturate: bool, options: tuple,
                        noise: Optional[torch.Tensor], amax) -> torch.Tensor:
    """Validated arguments in; the format dispatch (shared by eager and compiled paths).

    options: (block_2d, scaling, margin, pow2_scale, block) -- hashable, so that compiled
    graphs specialise on them. noise: uniform [0, 1) numbers of x's shape for stochastic
    rounding (None: round to nearest). amax: an imposed per-tensor amax (NVFP4, FP8 tensor
    scaling) or None."""
    block_2d, scaling, margin, pow2_scale, block = options
    kind = _INFO[fmt].kind
    if kind == "mx":
        return _mx_fake_quantize(x, fmt, axis, scale_mode, noise)
    if kind == "nvfp4":
        return _nvfp4_fake_quantize(x, axis, block_2d, noise, amax)
    if kind == "fp8":
        return _fp8_fake_quantize(x, fmt, axis, scaling, amax, margin, pow2_scale, block, noise)
    if kind == "hifp8":
        return _hifp8_fake_quantize(x, saturate)
    return _pass_through(x, fmt)


def _pass_through(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to bf16 / fp16 (RNE, IEEE overflow to Inf) and back to x.dtype."""
    if x.dtype != torch.float64:
        return x.to(_PASS_THROUGH_DTYPES[fmt]).to(x.dtype)   # via float: exact upcast, one rounding
    # torch casts float64 -> bf16/fp16 through float32 (a double rounding, P6): round directly.
    info = _INFO[fmt]
    q = _round_to_grid_(x.clone(), info.emin_elem, info.mantissa_bits)
    return torch.where(q.abs() > info.max_normal, q * math.inf, q)


KERNEL_MODES = ("auto", "triton", "compile", "eager")
_KERNELS = "auto"


def set_kernels(mode: str = "auto") -> None:
    """How fake_quantize runs (results are identical in every mode):

    "auto"     the Triton kernels for CUDA tensors when triton is importable and they cover
               the call (MX formats, HiFP8, NVFP4 without block_2d; float32/bf16), else
               eager PyTorch;
    "triton"   the Triton kernels, or a ValueError naming the format, option, dtype or
               device they do not cover (CPU tensors need TRITON_INTERPRET=1);
    "compile"  eager PyTorch through torch.compile (a RuntimeError rather than a silent
               eager fallback past COMPILED_GRAPH_LIMIT graphs of a format kind);
    "eager"    eager PyTorch.
    """
    global _KERNELS
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; valid: {', '.join(KERNEL_MODES)}")
    _KERNELS = mode


def kernels_mode() -> str:
    return _KERNELS


def set_compile(enabled: bool = True) -> None:
    """Route fake_quantize through torch.compile (set_kernels("compile")); False restores
    the default ("auto")."""
    set_kernels("compile" if enabled else "auto")


def compile_enabled() -> bool:
    return _KERNELS == "compile"


def _use_triton(x: torch.Tensor, fmt: str, kind: str, rounding: str, block_2d: bool) -> bool:
    """Whether this call runs on the Triton kernels under the current kernel mode."""
    if _KERNELS not in ("auto", "triton"):
        return False
    if _KERNELS == "auto" and x.device.type != "cuda":
        return False
    reason = (_kernels.unsupported_reason(kind, fmt, x.dtype, rounding, block_2d)
              or _kernels.device_reason(x))
    if reason is None:
        return True
    if _KERNELS == "triton":
        raise ValueError(f"kernel mode 'triton' does not cover {reason}; use "
                         "set_kernels('auto') to fall back to eager PyTorch for it")
    return False


# --------------------------------------------------------------------------------------------
# Kernel mode "compile"
# --------------------------------------------------------------------------------------------

# The graphs each format kind may compile before one more raises an error. Past Dynamo's own
# limit (torch._dynamo.config.recompile_limit, 8 by default) torch.compile would instead run
# eager PyTorch from then on, in silence. Each distinct guard set is one graph: the format,
# dtype, rounding, scale mode, saturate, block_2d, imposed amax or not and FP8 scaling options
# of a call, times the pattern of its graph input's sizes equal to 1 (Dynamo specialises on
# them: outer, the number of blocks, inner; a run's GEMMs show three patterns). A recipe uses
# per kind a few formats, both roundings and one or two dtypes, e.g. MX 3 formats x 2
# roundings x 2 dtypes x 3 patterns = 36; the limit leaves room for recipe files mixing
# configs, and still stops a runaway recompilation within minutes.
COMPILED_GRAPH_LIMIT = 64

# Inductor options that keep eager's roundings, which the formats are defined by: a cast to a
# narrower dtype and back is kept (fused, bf16(x) would else stay x: the bf16 and fp16
# formats), no FMA contraction, and float32 division correctly rounded in Triton kernels (its
# default is an approximation; the NVFP4 and FP8 scales are quotients).
_EAGER_NUMERICS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}

# How the compiled graphs take their input (see _graph_input).
_BLOCKS, _TILES, _FLAT = "blocks", "tiles", "flat"


def _layout(kind: str, block_2d: bool, scaling, block) -> Tuple[str, int]:
    """(layout, block size): _BLOCKS for 1-D blocks along an axis, _TILES for square 2-D
    tiles (NVFP4 block_2d, FP8 (128, 128)), _FLAT for element-wise and per-tensor scaling."""
    if kind == "mx":
        return _BLOCKS, MX_BLOCK_SIZE
    if kind == "nvfp4":
        return (_TILES if block_2d else _BLOCKS), NVFP4_BLOCK_SIZE
    if kind == "fp8" and scaling == "block":
        return (_TILES if block == (FP8_TILE, FP8_TILE) else _BLOCKS), FP8_TILE
    return _FLAT, 1


def _pad_to_multiple(t: torch.Tensor, dims, size: int) -> torch.Tensor:
    """t zero-padded at the end of `dims` to multiples of `size` (itself when they are)."""
    pads = [-t.shape[d] % size for d in dims]
    if not any(pads):
        return t
    spec = [0, 0] * t.dim()
    for d, pad in zip(dims, pads):
        spec[2 * (t.dim() - 1 - d) + 1] = pad
    return F.pad(t, spec)      # zeros never change an amax (P14); the caller crops


def _graph_input(t: torch.Tensor, axis: int, layout: str, size: int) -> torch.Tensor:
    """t as the compiled graphs take it: contiguous, whole blocks only, each on a dimension of
    its own of static length; a view of t when t is contiguous and nothing needs padding.

    _BLOCKS: [outer, nblocks, size, inner] (the Triton kernels' [outer, length, inner] view,
    the blocked axis in the middle); _TILES: [rows / size, size, cols / size, size]; _FLAT:
    1-D. Only the sizes then differ between operands, and dynamic shapes cover sizes: one
    graph serves every rank, block axis, memory layout and length, tails included (a graph
    that padded and cropped a tail itself would guard on whether the length was a multiple of
    the block). Detached, so that it is no view either: Dynamo guards on the base of a view."""
    t = t.contiguous()      # a permuted operand would be a graph (and guards) of its own
    if layout == _FLAT:
        return t.view(-1).detach()
    if layout == _BLOCKS:
        shape = t.shape
        t = t.view(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:]))
        t = _pad_to_multiple(t, (1,), size)
        return t.view(t.shape[0], t.shape[1] // size, size, t.shape[2]).detach()
    t = _pad_to_multiple(t, (0, 1), size)
    return t.view(t.shape[0] // size, size, t.shape[1] // size, size).detach()


def _from_graph_input(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor the shared dispatch quantizes: [outer, length, inner] blocked along 1,
    the padded 2-D tensor, or the 1-D one."""
    if layout == _BLOCKS:
        return t.flatten(1, 2)
    if layout == _TILES:
        return t.flatten(2, 3).flatten(0, 1)
    return t


def _graph_output_to(out: torch.Tensor, x: torch.Tensor, axis: int,
                     layout: str) -> torch.Tensor:
    """A compiled graph's result in x's shape, the padding cropped (a copy only then)."""
    if layout == _BLOCKS:
        out = out.flatten(1, 2).narrow(1, 0, x.shape[axis])
    elif layout == _TILES:
        out = out.flatten(2, 3).flatten(0, 1)[:x.shape[0], :x.shape[1]]
    return out.reshape(x.shape)


def _compiled_body(x, layout, fmt, scale_mode, saturate, options, noise, amax):
    """What torch.compile traces: the shared dispatch on a _graph_input, its result in the
    same layout."""
    work = _from_graph_input(x, layout)
    if noise is not None:
        noise = _from_graph_input(noise, layout)
    out = _fake_quantize_impl(work, fmt, 1 if layout == _BLOCKS else 0, scale_mode, saturate,
                              options, noise, amax)
    return out.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _compiled_impl(kind: str):
    """torch.compile of _compiled_body for one format kind ("mx", "nvfp4", "fp8", "hifp8",
    "float"). Dynamo keeps graphs, and counts them against its recompile limit, per code
    object: each kind compiles a copy of the body's code of its own, so that the graphs of one
    kind never use up another's limit. fullgraph: a graph break raises too, rather than
    leaving part of the call to eager PyTorch."""
    name = f"fake_quantize_{kind}"
    code = _compiled_body.__code__.replace(co_name=name, co_qualname=name)
    body = types.FunctionType(code, _compiled_body.__globals__, name)
    return torch.compile(body, dynamic=True, fullgraph=True, options=_EAGER_NUMERICS)


@functools.lru_cache(maxsize=None)
def _raising_past(limit: int):
    """Dynamo settings for the compiled calls only (a thread-local patch, undone on exit,
    reusable): up to `limit` graphs per kind, then an error instead of eager PyTorch;
    compilation errors raised instead of suppressed (the two settings exclude each other); and
    float options (the FP8 margin) constants of the graph, as the code reads them with
    Python's math functions."""
    import torch._dynamo    # not imported with torch; only the compile mode needs it

    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True,
                                      suppress_errors=False, specialize_float=True)


def _compiled_fake_quantize(x, fmt, kind, axis, scale_mode, saturate, options, noise, amax):
    """_fake_quantize_impl's bits through the compiled graphs of the call's kind."""
    block_2d, scaling, _, _, block = options
    layout, size = _layout(kind, block_2d, scaling, block)
    # x detached: the result carries no autograd history anyway, and requires_grad is a guard.
    graph_x = _graph_input(x, axis, layout, size)
    if noise is not None:
        noise = _graph_input(noise, axis, layout, size)
    if kind == "hifp8":
        _prepare_hifp8_tables(x.dtype, saturate, x.device)
    limit = COMPILED_GRAPH_LIMIT
    try:
        with _raising_past(limit):
            out = _compiled_impl(kind)(graph_x, layout, fmt, scale_mode, saturate, options,
                                       noise, amax)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            f"kernel mode 'compile': fake_quantize's {kind} graphs would exceed "
            f"COMPILED_GRAPH_LIMIT = {limit} with this call ({fmt}, {x.dtype}, shape "
            f"{tuple(x.shape)}, axis {axis}); past the limit torch.compile would run eager "
            "PyTorch. Each distinct format, dtype, rounding, scale mode and option set takes a "
            "graph, times the 0/1 specialisations of the sizes: raise "
            "megatron.quantization.formats.COMPILED_GRAPH_LIMIT if the run needs that many, "
            "else look for the guard that recompiles (TORCH_LOGS=recompiles)") from error
    return _graph_output_to(out, x, axis, layout)


def fake_quantize(x: torch.Tensor, fmt: str, axis: int = -1, scale_mode: str = "floor",
                  saturate: Optional[bool] = None, *, block_2d: bool = False,
                  rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                  scaling: Optional[str] = None, amax=None, margin: float = 0,
                  pow2_scale: bool = False,
                  block: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Quantize `x` to `fmt` and dequantize it back: same shape and dtype, exact values.

    fmt: "mxfp8" (= "mxfp8_e4m3"), "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4" (E2M1),
    "nvfp4", "fp8_e4m3", "fp8_e5m2", "hifp8", "bf16", "fp16" (round to that dtype and back) or
    "none" (returns x itself).
    axis: the block axis (the GEMM's reduction axis): 32 consecutive elements share an E8M0
    scale (MX), 16 an E4M3 scale (NVFP4), 128 a float32 scale (FP8 block=(1, 128)); ignored
    by element-wise and per-tensor scaled formats.
    scale_mode: "floor" (OCP) or "rceil" (NVIDIA), MX only.
    saturate: HiFP8 only. None/False is the plain cast (|x| >= 40960 -> +-Inf); True clamps
    overflow and +-Inf to +-32768. Other formats accept only None.
    block_2d: NVFP4 only: one E4M3 scale per 16x16 tile of a 2-D x (weights), so that the
    copies quantized along either axis are the same numbers.
    rounding: "nearest" (ties to even) or "stochastic" (the element rounds to one of its two
    grid neighbours with probabilities that make it unbiased; scales as with "nearest"), for
    MX, NVFP4 and FP8. Stochastic rounding draws from `generator` (required), so the same
    generator state gives the same bits.
    scaling (FP8 only): "tensor" (default: one scale from the tensor's amax, or from `amax`
    when given -- delayed scaling) or "block" (one scale per `block` tile: (1, 128) along
    `axis` or (128, 128) for a 2-D x). margin and pow2_scale: the FP8 scale is
    (fp8_max * 2**-margin) / amax, truncated to a power of two when pow2_scale.
    amax (NVFP4 and FP8 "tensor"): the per-tensor amax to derive the tensor scale from, a
    float or 0-d tensor, instead of x's own (delayed scaling, or one piece of a larger
    operand).
    The result carries no autograd history (wrap it in a straight-through function, or use
    gemm.quantized_linear / quantized_matmul, to train through it).
    """
    return _fake_quantize(x, fmt, axis, scale_mode, saturate, block_2d, rounding, generator,
                          scaling, amax, margin, pow2_scale, block, None)


def fake_quantize_compiled(x: torch.Tensor, fmt: str, axis: int = -1,
                           scale_mode: str = "floor", saturate: Optional[bool] = None,
                           **options) -> torch.Tensor:
    """fake_quantize through torch.compile, whatever the kernel mode: identical results, fused
    kernels (see the module note on the "compile" mode)."""
    merged = dict(block_2d=False, rounding="nearest", generator=None, scaling=None, amax=None,
                  margin=0, pow2_scale=False, block=None)
    unknown = set(options) - set(merged)
    if unknown:
        raise TypeError(f"fake_quantize_compiled got unexpected options {sorted(unknown)}")
    merged.update(options)
    return _fake_quantize(x, fmt, axis, scale_mode, saturate, *merged.values(), True)


def _check_options(fmt: str, kind: str, x: torch.Tensor, block_2d, rounding, generator):
    if block_2d and kind != "nvfp4":
        raise ValueError(f"block_2d applies to nvfp4 only (16x16 tiles), got {fmt!r}")
    if block_2d and x.dim() != 2:
        raise ValueError(f"block_2d needs a 2-D tensor (a weight), got shape {tuple(x.shape)}")
    _check_rounding(rounding, generator)
    if rounding == "stochastic" and kind not in ("mx", "nvfp4", "fp8"):
        raise ValueError(f"stochastic rounding applies to the MX, NVFP4 and FP8 formats, "
                         f"not {fmt!r}")


def _fake_quantize(x, fmt, axis, scale_mode, saturate, block_2d, rounding, generator,
                   scaling, amax, margin, pow2_scale, block, compiled):
    _check_tensor(x)
    fmt = canonical_format(fmt)
    _check_scale_mode(scale_mode)
    saturate = _check_saturate(fmt, saturate)
    info = _INFO[fmt]
    _check_options(fmt, info.kind, x, block_2d, rounding, generator)
    if info.kind == "fp8":
        scaling, margin, pow2_scale, block = _check_fp8_options(
            x, scaling, margin, pow2_scale, block)
    elif scaling is not None or block is not None or margin != 0 or pow2_scale:
        raise ValueError(f"scaling, block, margin and pow2_scale apply to the fp8 formats, "
                         f"not {fmt!r}")
    if amax is not None and not (info.kind == "nvfp4" or (info.kind == "fp8"
                                                          and scaling == "tensor")):
        raise ValueError(f"amax applies to nvfp4 and to fp8 with scaling='tensor', not "
                         f"{fmt!r}" + (f" with scaling={scaling!r}" if scaling else ""))
    if info.kind in ("mx", "nvfp4") or (info.kind == "fp8" and scaling == "block"):
        axis = _normalize_axis(axis, x.dim())
    else:
        axis = -1
    if fmt == "none":
        return x
    if x.numel() == 0:
        return x.clone()
    triton = compiled is None and _use_triton(x, fmt, info.kind, rounding, block_2d)
    if compiled is None:        # fake_quantize: the kernel mode decides
        compiled = _KERNELS == "compile"
    with torch.no_grad():   # rounding has no useful gradient; the GEMMs define their own
        noise = uniform_noise(x, generator) if rounding == "stochastic" else None
        if amax is not None:
            amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if triton:
            return _kernels.fake_quantize(x, fmt, info.kind, axis, scale_mode, saturate, noise,
                                          amax)
        options = (bool(block_2d), scaling, margin, bool(pow2_scale), block)
        if compiled:
            return _compiled_fake_quantize(x, fmt, info.kind, axis, scale_mode, saturate,
                                           options, noise, amax)
        return _fake_quantize_impl(x, fmt, axis, scale_mode, saturate, options, noise, amax)
