"""Fake quantization (quantize + dequantize) to MXFP8, MXFP4, HiFP8, BF16 and FP16.

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

The code is pure, vectorised PyTorch and device agnostic. `set_compile(True)` (or calling
`fake_quantize_compiled`) runs the same implementation through torch.compile; the eager
default and the compiled variant give identical results.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "FORMAT_NAMES", "SCALE_MODES", "MX_BLOCK_SIZE", "NAN_EXPONENT", "MIN_SHARED_EXPONENT",
    "MAX_SHARED_EXPONENT", "HIFP8_MAX", "HIFP8_OVERFLOW", "HIFP8_DEFAULT_TARGET_EXPONENT",
    "FormatInfo", "canonical_format", "format_info", "fake_quantize", "mx_shared_exponents",
    "mx_block_scales",
    "hifp8_scaled_fake_quantize", "hifp8_scale_exponent", "fake_quantize_compiled", "set_compile", "compile_enabled",
]

FORMAT_NAMES = ("mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "hifp8", "bf16", "fp16", "none")
_ALIASES = {"mxfp8": "mxfp8_e4m3"}
SCALE_MODES = ("floor", "rceil")

MX_BLOCK_SIZE = 32
MIN_SHARED_EXPONENT = -127          # E8M0 code 0x00 = 2**-127
MAX_SHARED_EXPONENT = 127           # E8M0 code 0xFE = 2**127
NAN_EXPONENT = 128                  # reported for a block holding NaN or Inf (E8M0 code 0xFF)

HIFP8_MAX = 32768.0                 # largest finite HiF8 value, 2**15
HIFP8_OVERFLOW = 40960.0            # 1.25 * 2**15: |x| >= this rounds to the Inf code
HIFP8_MIN_NORMAL = 2.0 ** -15
HIFP8_MIN_SUBNORMAL = 2.0 ** -22
HIFP8_DEFAULT_TARGET_EXPONENT = 3   # see hifp8_scaled_fake_quantize

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------
# Format descriptions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FormatInfo:
    """What a format can represent (values in float, exponents unbiased).

    kind is "mx" (block-scaled elements), "hifp8", "float" (bf16 / fp16 pass-through) or
    "none". For MX the numbers describe the element format; block values are these times the
    block scale 2**e, e in [-127, 127]; emax_elem / emin_elem are the exponents of the largest
    and smallest normal element. mantissa_bits is the largest mantissa width (HiF8 has 3 near 1
    and fewer further out). overflow_threshold is the smallest magnitude that the plain cast
    sends to Inf (HiF8 only; MX elements saturate).
    """

    name: str
    kind: str
    block_size: Optional[int] = None
    emax_elem: Optional[int] = None
    emin_elem: Optional[int] = None
    max_normal: Optional[float] = None
    min_normal: Optional[float] = None
    min_subnormal: Optional[float] = None
    mantissa_bits: Optional[int] = None
    overflow_threshold: Optional[float] = None


def _mx_info(name, emax, emin, mbits, max_normal):
    return FormatInfo(name=name, kind="mx", block_size=MX_BLOCK_SIZE, emax_elem=emax,
                      emin_elem=emin, max_normal=max_normal, min_normal=2.0 ** emin,
                      min_subnormal=2.0 ** (emin - mbits), mantissa_bits=mbits)


_INFO = {
    # E4M3 "fn": S.1111.111 is NaN, so the largest normal is 1.75 * 2**8.
    "mxfp8_e4m3": _mx_info("mxfp8_e4m3", emax=8, emin=-6, mbits=3, max_normal=448.0),
    "mxfp8_e5m2": _mx_info("mxfp8_e5m2", emax=15, emin=-14, mbits=2, max_normal=57344.0),
    "mxfp4": _mx_info("mxfp4", emax=2, emin=0, mbits=1, max_normal=6.0),
    "hifp8": FormatInfo(name="hifp8", kind="hifp8", max_normal=HIFP8_MAX,
                        min_normal=HIFP8_MIN_NORMAL, min_subnormal=HIFP8_MIN_SUBNORMAL,
                        mantissa_bits=3, overflow_threshold=HIFP8_OVERFLOW),
    "bf16": FormatInfo(name="bf16", kind="float", emin_elem=-126,
                       max_normal=torch.finfo(torch.bfloat16).max, min_normal=2.0 ** -126,
                       min_subnormal=2.0 ** -133, mantissa_bits=7),
    "fp16": FormatInfo(name="fp16", kind="float", emin_elem=-14, max_normal=65504.0,
                       min_normal=2.0 ** -14, min_subnormal=2.0 ** -24, mantissa_bits=10),
    "none": FormatInfo(name="none", kind="none"),
}

# torch dtypes whose float32/bf16 casts round to the MX element formats exactly (RNE,
# subnormals kept); see _round_elements_ for the saturation they may lack (P7, P8).
_NATIVE_ELEMENT_DTYPES = {
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
}
_PASS_THROUGH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def canonical_format(name: str) -> str:
    """The canonical name of a format ("mxfp8" -> "mxfp8_e4m3"); ValueError if unknown."""
    if not isinstance(name, str) or name not in FORMAT_NAMES:
        raise ValueError(f"unknown quantization format {name!r}; valid formats: "
                         f"{', '.join(FORMAT_NAMES)}")
    return _ALIASES.get(name, name)


def format_info(fmt: str) -> FormatInfo:
    """The FormatInfo of a format name (aliases accepted)."""
    return _INFO[canonical_format(fmt)]


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MX scale_mode {scale_mode!r}; valid modes: "
                         f"{', '.join(SCALE_MODES)}")


def _check_tensor(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fake_quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"fake_quantize needs a floating-point tensor, got dtype {x.dtype}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"fake_quantize does not support dtype {x.dtype}; supported: "
                        f"{', '.join(str(d) for d in _SUPPORTED_DTYPES)}")


def _normalize_axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool):
        raise TypeError("axis must be an int, got bool")
    axis = operator.index(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor with ndim {ndim} "
                         f"(valid: {-ndim}..{ndim - 1})" if ndim else
                         f"axis {axis} is out of range for a tensor with ndim 0 "
                         "(MX block quantization needs at least one dimension)")
    return axis % ndim


def _check_saturate(fmt: str, saturate) -> bool:
    if fmt == "hifp8":
        if saturate not in (None, False, True):
            raise ValueError(f"saturate must be None, False or True, got {saturate!r}")
        return bool(saturate)
    if saturate is not None:
        raise ValueError(f"saturate applies to hifp8 only (MX always saturates finite values, "
                         f"bf16/fp16 casts never do); got saturate={saturate!r} for {fmt!r}")
    return False


# --------------------------------------------------------------------------------------------
# Exact powers of two and compute dtypes
# --------------------------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype, native_bf16: bool = False) -> torch.dtype:
    """float64 stays float64; bf16 stays bf16 where the caller computes exactly in it;
    everything else computes in float32."""
    if dtype == torch.float64 or (native_bf16 and dtype == torch.bfloat16):
        return dtype
    return torch.float32


def _bit_layout(dtype: torch.dtype):
    """(integer view dtype, mantissa bits, exponent bias, exponent-field maximum)."""
    if dtype == torch.float64:
        return torch.int64, 52, 1023, 0x7FF
    if dtype == torch.bfloat16:
        return torch.int16, 7, 127, 0xFF
    return torch.int32, 23, 127, 0xFF


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly 2**exponent (float32 or float64) for integer exponents in [-127, 127], built
    from the bit pattern.

    2**-127 is a float32 subnormal (bits 0x00400000): `(e + 127) << 23` would give 0 for it,
    and clamping it to 2**-126 halves tiny blocks (P5).
    """
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    e = exponent.to(torch.int32)
    return torch.where(e > -127, (e + 127) << 23, 0x00400000).view(torch.float32)


def _to_compute(x: torch.Tensor, native_bf16: bool = False) -> Tuple[torch.Tensor, bool]:
    """x in its compute dtype, and whether the result is a private copy we may overwrite."""
    cdtype = _compute_dtype(x.dtype, native_bf16)
    if x.dtype == cdtype:
        return x, False
    return x.to(cdtype), True   # exact: every bf16/fp16 value is a float32 value


# --------------------------------------------------------------------------------------------
# MX
# --------------------------------------------------------------------------------------------

def _pad_axis(x: torch.Tensor, axis: int, pad: int) -> torch.Tensor:
    """Zero-pad `x` at the end of `axis` (zeros never change a block's amax, P14)."""
    spec = [0, 0] * (x.dim() - 1 - axis) + [0, pad]
    return F.pad(x, spec)


def _blocks(work: torch.Tensor, axis: int):
    """(view of work as [..., nblocks, 32, ...], padded length) with blocks along `axis`."""
    n = work.shape[axis]
    nblocks = -(-n // MX_BLOCK_SIZE)
    pad = nblocks * MX_BLOCK_SIZE - n
    if pad:
        work = _pad_axis(work, axis, pad)
    return work.unflatten(axis, (nblocks, MX_BLOCK_SIZE)), pad


def _block_scales(amax: torch.Tensor, info: FormatInfo, scale_mode: str):
    """(2**-e, 2**e) per block, exactly, from the block maxima (in amax's dtype).

    Everything is read from the float bits and stays a power of two (P2: no log2). With
    P = 2**floor(log2 amax) (amax with its mantissa bits cleared) and max_normal = 1.n * 2**En:
    floor:  2**e = P * 2**-emax_elem;
    rceil:  2**e = P * 2**-En, doubled when amax > 1.n * P (the mantissa of amax exceeds
            that of max_normal), i.e. the smallest power of two with max_normal * 2**e >= amax.
    2**e is clamped to [2**-127, 2**127]: a zero or subnormal amax has P = 0 and gets 2**-127
    (P1), which is a float32 (and bf16) subnormal and is kept (P5). 2**-e = 1 / 2**e is exact.
    2**e is NaN for blocks holding NaN or Inf (amax * 0 is NaN there), so that dequantization
    turns all their elements into NaN (P3, P4).
    """
    int_dtype, mbits, _, field_max = _bit_layout(amax.dtype)
    pow2 = (amax.view(int_dtype) & (field_max << mbits)).view(amax.dtype)
    if scale_mode == "floor":
        up = pow2.mul_(2.0 ** -info.emax_elem)
    else:
        # max_normal = 1.n * 2**En with 1.n = 2 * mant_n and En = exp_n - 1
        mant_n, exp_n = math.frexp(info.max_normal)
        exceeds = amax > pow2 * (2 * mant_n)
        up = pow2.mul_(2.0 ** (1 - exp_n)).mul_(torch.where(exceeds, 2.0, 1.0).to(amax.dtype))
    up.clamp_(2.0 ** MIN_SHARED_EXPONENT, 2.0 ** MAX_SHARED_EXPONENT)
    down = torch.reciprocal(up)
    return down, up.add_(amax * 0.0)


def _exponents_from_scales(up: torch.Tensor) -> torch.Tensor:
    """int32 e from the exact 2**e (exponent field; 2**-127 is the float32/bf16 subnormal with
    field 0, which reads as -127 too); NAN_EXPONENT where 2**e is NaN."""
    int_dtype, mbits, bias, _ = _bit_layout(up.dtype)
    e = ((up.view(int_dtype) >> mbits) - bias).to(torch.int32)
    return e.masked_fill_(torch.isnan(up), NAN_EXPONENT)


def _block_amax(blocks: torch.Tensor, dim: int, scratch: Optional[torch.Tensor] = None):
    """max |x| over `dim`: NaN if the block holds a NaN, Inf if it holds +-Inf.

    `scratch`, a tensor like `blocks` that may be overwritten, saves an allocation for bf16.
    """
    if blocks.dtype == torch.bfloat16:
        # bf16 float reductions are slow on CPU; for |x| the 15 low bits order like the values
        # (NaN above Inf above finite), so an int16 max of (bits & 0x7FFF) is the exact amax.
        out = None if scratch is None else scratch.view(torch.int16)
        magnitude = torch.bitwise_and(blocks.view(torch.int16), 0x7FFF, out=out)
        return magnitude.amax(dim, keepdim=True).view(torch.bfloat16)
    # max(max, -min): two reductions instead of a full-size |x| temporary; both propagate NaN.
    return torch.maximum(blocks.amax(dim, keepdim=True), blocks.amin(dim, keepdim=True).neg_())


def _round_to_grid_(a: torch.Tensor, emin: int, mbits: int) -> torch.Tensor:
    """Round `a` in place to nearest, ties to even, on the grid of a binary float format with
    `mbits` mantissa bits and smallest normal exponent `emin` (subnormals kept, no overflow
    handling).

    The grid spacing at |a| is 2**(max(floor(log2|a|), emin) - mbits): read floor(log2|a|)
    from the exponent bits, clamp it at emin (below it the spacing is that of the
    subnormals), and divide, round half-to-even (torch.round), multiply: all exact, since the
    spacing is a power of two and a / spacing < 2**(mbits + 2).
    """
    int_dtype, mbits_fp, bias, field_max = _bit_layout(a.dtype)
    spacing = a.view(int_dtype) & (field_max << mbits_fp)
    spacing.clamp_(min=(emin + bias) << mbits_fp)
    spacing.sub_(mbits << mbits_fp)
    spacing = spacing.view(a.dtype)
    return a.div_(spacing).round_().mul_(spacing)


def _round_to_element_grid_(a: torch.Tensor, info: FormatInfo) -> torch.Tensor:
    """MX element rounding in place: RNE with subnormals, finite overflow saturated to
    +-max_normal (P7, P8, P9)."""
    _round_to_grid_(a, info.emin_elem, info.mantissa_bits)
    return a.clamp_(-info.max_normal, info.max_normal)


# Use torch's fp8 casts for E4M3/E5M2 element rounding (else the generic grid rounding).
_NATIVE_FP8_CASTS = {torch.float32: True, torch.bfloat16: True}
_ELEMENT_EXPONENT_BITS = {"mxfp8_e4m3": 4, "mxfp8_e5m2": 5}
_ELEMENT_BIAS = {"mxfp8_e4m3": 7, "mxfp8_e5m2": 15}


def _cast_saturates(dtype: torch.dtype, max_normal: float) -> bool:
    """Whether this torch's CPU float32 -> `dtype` cast clamps overflow (probed, not assumed)."""
    probe = torch.tensor([max_normal * 1.2, -max_normal * 1.2, 1e30, -1e30])
    return probe.to(dtype).float().abs().eq(max_normal).all().item()


_SATURATING_CPU_CASTS = {dtype for dtype, max_normal in ((torch.float8_e4m3fn, 448.0),
                                                          (torch.float8_e5m2, 57344.0))
                         if _cast_saturates(dtype, max_normal)}


def _decode_fp8_(out: torch.Tensor, codes: torch.Tensor, fmt: str) -> float:
    """Write the fp8 `codes` into float32/bf16 `out` as value * 2**-k; returns 2**k.

    torch's fp8 -> float conversion is several times slower on CPU than these integer ops.
    The code byte S.E..E.M..M, sign-extended (int8 view), is shifted so that E..E.M..M sits at
    the bottom of out's exponent field and the sign copies reach out's sign bit; masking keeps
    the sign and those 7 bits. The pattern then reads as value * 2**(elem_bias - bias) for
    normals and subnormals alike (element subnormals land on subnormals or normals of `out`,
    exactly). NaN codes decode to finite values; they only occur in NaN blocks, whose NaN
    scale turns them back into NaN.
    """
    int_dtype, _, bias, _ = _bit_layout(out.dtype)
    width = int_dtype.itemsize * 8
    shift = width - 8 - (8 - _ELEMENT_EXPONENT_BITS[fmt])
    bits = out.view(int_dtype)
    bits.copy_(codes.view(torch.int8))                    # sign-extending
    bits.bitwise_left_shift_(shift)
    keep = (1 << (width - 1)) | (0x7F << shift)           # sign bit and the 7 E/M bits
    bits.bitwise_and_(keep - (1 << width))
    return 2.0 ** (bias - _ELEMENT_BIAS[fmt])


def _round_elements_(a: torch.Tensor, fmt: str, info: FormatInfo) -> float:
    """Round `a` in place to the element format; returns the factor still to apply."""
    native = _NATIVE_ELEMENT_DTYPES.get(fmt)
    if native is not None and _NATIVE_FP8_CASTS.get(a.dtype, False):
        # torch's float32/bf16 -> fp8 casts are RNE with subnormals (from bf16 through the
        # exact float32 value: one rounding). Clamp first unless the cast is known to
        # saturate (probed on CPU): the e5m2 cast does not, nor does e4m3fn before torch 2.13
        # (P7, P8).
        if not (a.device.type == "cpu" and native in _SATURATING_CPU_CASTS):
            a.clamp_(-info.max_normal, info.max_normal)
        return _decode_fp8_(a, a.to(native), fmt)
    _round_to_element_grid_(a, info)
    return 1.0


def _mx_fake_quantize(x: torch.Tensor, fmt: str, axis: int, scale_mode: str) -> torch.Tensor:
    """MX quantize-dequantize. bf16 inputs are computed in bf16 without upcasting: scaling by
    a power of two, the element rounding (exact value -> element grid, once) and the final
    product (exact value -> bf16, RNE, once) give bit for bit the float32 result cast to bf16.
    """
    info = _INFO[fmt]
    work, owned = _to_compute(x, native_bf16=True)
    blocks, pad = _blocks(work, axis)
    owned = owned or pad > 0
    # The result buffer; the bf16 amax borrows it as scratch before it is filled.
    scaled = blocks if owned else torch.empty_like(blocks)
    amax = _block_amax(blocks, axis + 1, None if owned else scaled)
    down, up = _block_scales(amax, info, scale_mode)
    # Exact: |x| * 2**-e < 2**(emax_elem + 1) cannot overflow, and values small enough to
    # lose bits to underflow round to zero in any element format.
    torch.mul(blocks, down, out=scaled)
    factor = _round_elements_(scaled, fmt, info)
    # Dequantize: (factor * q) * 2**e, in this order (q * 2**e alone could underflow). Exact
    # (element values times 2**e fit float32, even at e = -127, P5), except that rceil can
    # round a block near float32 max up to 2**128 = inf (P12); bf16 rounds the exact value once.
    if factor != 1.0:
        scaled.mul_(factor)
    scaled.mul_(up)
    out = scaled.flatten(axis, axis + 1)
    if pad:
        out = out.narrow(axis, 0, x.shape[axis])
    return out.to(x.dtype)


def mx_shared_exponents(x: torch.Tensor, fmt: str, axis: int = -1,
                        scale_mode: str = "floor") -> torch.Tensor:
    """Unbiased int32 shared exponents of the MX blocks of `x` along `axis`.

    The result has x's shape with `axis` replaced by the number of blocks, ceil(n / 32). A
    block's scale is 2**e; the E8M0 code is e + 127. All-zero blocks give -127; blocks holding
    NaN or Inf give NAN_EXPONENT (128). fake_quantize uses this same computation.
    """
    _check_tensor(x)
    fmt = canonical_format(fmt)
    _check_scale_mode(scale_mode)
    info = _INFO[fmt]
    if info.kind != "mx":
        raise ValueError(f"{fmt!r} is not an MX format; MX formats: mxfp8, mxfp8_e4m3, "
                         "mxfp8_e5m2, mxfp4")
    axis = _normalize_axis(axis, x.dim())
    work, _ = _to_compute(x, native_bf16=True)
    if work.shape[axis] == 0:
        return torch.empty(work.shape, dtype=torch.int32, device=x.device)
    blocks, _ = _blocks(work, axis)
    exponents, _ = mx_block_scales(_block_amax(blocks, axis + 1), fmt, scale_mode)
    return exponents.squeeze(axis + 1)


def mx_block_scales(amax: torch.Tensor, fmt: str, scale_mode: str = "floor"):
    """(unbiased int32 shared exponents e, 2**e in amax's dtype) from the blocks' max |x|
    (float32 or bf16; NaN for a block holding NaN, Inf for one holding Inf): the rule of
    mx_shared_exponents, for callers that already have the block maxima. 2**e is NaN and e is
    NAN_EXPONENT for blocks holding NaN or Inf."""
    fmt = canonical_format(fmt)
    _check_scale_mode(scale_mode)
    _, up = _block_scales(amax, _INFO[fmt], scale_mode)
    return _exponents_from_scales(up), up


# --------------------------------------------------------------------------------------------
# HiFP8
# --------------------------------------------------------------------------------------------

def _hifp8_spacing_exponent(e: int) -> int:
    """log2 of the HiF8 rounding step for a value with floor(log2|x|) = e.

    In range, r = |x| / step lies in [2**m, 2**(m + 1)) with m mantissa bits and
    floor(r + 0.5) is the ties-away rounding: 0.5 is a multiple of r's ulp, so r + 0.5 is
    exact unless it carries into the next binade, and then it can only round to a value at or
    above that (integer) binade boundary, which floors to the right integer. The same holds
    for r in [1/2, 1), but not for r in [1/4, 1/2), whose sum can round up to 1. Below the
    HiF8 range, e = -23 uses the step 2**-22 (r in [1/2, 1) -> 1: 2**-23 ties away to 2**-22,
    P17) and e <= -24 a step that makes r < 1/4, so the result is 0.
    """
    if e >= -15:
        width = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1   # above 15: overflow anyway
        return e - width
    if e >= -22:
        return e              # denormals 2**-22 .. 2**-16: powers of two only
    if e == -23:
        return -22
    return e + 3


def _hifp8_spacing_table(dtype: torch.dtype) -> torch.Tensor:
    """MINUS the step 2**s, indexed by the biased exponent field of the compute dtype.

    Negative so that floor(r + 0.5) * table[field] comes out as -q: the overflow test then
    fits one in-place threshold_ (see _hifp8_round). Field 0 (zeros and subnormals of the
    compute dtype) behaves like the lowest binade and rounds to 0; the all-ones field
    (Inf / NaN) maps to -1, which keeps Inf and NaN as they are.
    """
    _, _, bias, field_max = _bit_layout(dtype)
    steps = [-1.0 if f == field_max else -math.ldexp(1.0, _hifp8_spacing_exponent(max(f, 1) - bias))
             for f in range(field_max + 1)]
    return torch.tensor(steps, dtype=dtype)


_HIFP8_TABLES = {(dtype, torch.device("cpu")): _hifp8_spacing_table(dtype)
                 for dtype in (torch.float32, torch.float64)}


def _device_table(tables: dict, key, device: torch.device) -> torch.Tensor:
    """tables[(key, device)], copied from the CPU table once per device (not once per call:
    on an accelerator a host-to-device copy each call would stall the step)."""
    if (key, device) not in tables:
        tables[(key, device)] = tables[(key, torch.device("cpu"))].to(device)
    return tables[(key, device)]
# -q is below this exactly when q overflowed: q > 32768 means q >= 49152 on the HiF8 grid.
_HIFP8_NEG_OVERFLOW = -(HIFP8_MAX + HIFP8_OVERFLOW) / 2


def _hifp8_round(work: torch.Tensor, sign_source: torch.Tensor, owned: bool,
                 saturate: bool) -> torch.Tensor:
    """HiF8 TA rounding of `work` (float32/64); returns a new tensor, or `work` if owned."""
    int_dtype, mbits_fp, _, field_max = _bit_layout(work.dtype)
    table = _device_table(_HIFP8_TABLES, work.dtype, work.device)
    field = (work.view(int_dtype) >> mbits_fp).bitwise_and_(field_max)
    # One gather from a 256-entry (float64: 2048) table beats a chain of piecewise ops.
    neg_step = table.index_select(0, field.reshape(-1)).view(field.shape)
    # r = |x| / step (exact: power of two); written over `field` to save an allocation.
    r = work.div_(neg_step) if owned else torch.div(work, neg_step, out=field.view(work.dtype))
    del field
    # Ties away from zero on |x| (P18): floor(r + 0.5) with r >= 0 and r + 0.5 exact.
    neg_q = r.abs_().add_(0.5).floor_().mul_(neg_step)
    del neg_step
    if saturate:
        neg_q.clamp_(min=-HIFP8_MAX)                   # finite overflow and Inf -> 32768
    else:
        # Results above 32768 are >= 49152, i.e. inputs >= 40960: the Inf code (P17).
        # threshold_ keeps NaN (the comparison is false for it).
        F.threshold_(neg_q, _HIFP8_NEG_OVERFLOW, -math.inf)
    # Set the sign from x, then + 0.0 turns -0 into +0 (HiF8 has no -0, P16).
    return neg_q.copysign_(sign_source).add_(0.0)


def _hifp8_half_table(dtype: torch.dtype, saturate: bool, device: torch.device) -> torch.Tensor:
    """HiF8 result for each of the 65536 bf16 / fp16 bit patterns, in that dtype.

    Computed by the float32 path from the exactly upcast values, so a lookup is by construction
    the float32 result cast back (one rounding, P6).
    """
    key = (dtype, saturate)
    if (key, torch.device("cpu")) not in _HALF_TABLES:
        values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        _HALF_TABLES[(key, torch.device("cpu"))] = _hifp8_round(
            values.float(), values, True, saturate).to(dtype)
    return _device_table(_HALF_TABLES, key, device)


_HALF_TABLES = {}


def _hifp8_fake_quantize(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    if x.dtype in (torch.bfloat16, torch.float16):
        # 16-bit inputs: one gather from the table of all 65536 bit patterns.
        table = _hifp8_half_table(x.dtype, saturate, x.device)
        index = x.view(torch.int16).to(torch.int32).add_(32768)
        return table.index_select(0, index.reshape(-1)).view(x.shape)
    work, owned = _to_compute(x)
    return _hifp8_round(work, x, owned, saturate).to(x.dtype)


def hifp8_scale_exponent(x: torch.Tensor,
                         target_exponent: int = HIFP8_DEFAULT_TARGET_EXPONENT) -> torch.Tensor:
    """The per-tensor scale exponent k of `hifp8_scaled_fake_quantize`, as a 0-dim int tensor
    on x's device (no host sync): k = target_exponent - floor(log2 amax), clamped to
    [-127, 127]; 0 for an all-zero tensor or one holding NaN/Inf."""
    _check_tensor(x)
    _check_target_exponent(target_exponent)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int32, device=x.device)
    amax = x.detach().abs().amax().float()
    return _scale_exponent_of_amax(amax, target_exponent)


def _scale_exponent_of_amax(amax: torch.Tensor, target_exponent: int) -> torch.Tensor:
    _, e = torch.frexp(amax)                  # amax = m * 2**e, m in [0.5, 1)
    k = (target_exponent + 1 - e).clamp(MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT)
    return torch.where(torch.isfinite(amax) & (amax > 0), k, torch.zeros_like(k))


def _check_target_exponent(target_exponent) -> None:
    if not isinstance(target_exponent, int) or not -15 <= target_exponent <= 15:
        raise ValueError(f"target_exponent must be an int in [-15, 15], got {target_exponent!r}")


def hifp8_scaled_fake_quantize(x: torch.Tensor,
                               target_exponent: int = HIFP8_DEFAULT_TARGET_EXPONENT,
                               saturate: bool = True,
                               scale_exponent=None) -> torch.Tensor:
    """HiFP8 fake quantization with one per-tensor power-of-two scale.

    The scale is 2**k with k = target_exponent - floor(log2 amax) (exact, from frexp), so the
    tensor's largest magnitude lands in [2**target_exponent, 2**(target_exponent + 1)); the
    scaled tensor is rounded to HiF8 and divided by the scale again. Both multiplications are
    exact, so the result is exactly 2**-k * HiF8(2**k * x).

    Default target 3, i.e. amax in [8, 16): the top binade of the 3-bit-mantissa region
    [1/8, 16). The largest values, which dominate a GEMM, then get the finest HiF8 precision,
    the 3-bit region covers 7 binades below amax, 2 and 1 mantissa bits the next 12, and the
    denormals reach 25 binades below amax; nothing can overflow. Mapping amax to the HiF8
    maximum (target 15) instead trades the top precision (1 mantissa bit) for 12 more binades
    of range at the bottom. k is clamped to [-127, 127]; a tensor that is all zeros or holds
    NaN/Inf is quantized unscaled.

    `scale_exponent` (an int or a 0-dim integer tensor) imposes k instead of deriving it from
    x: the operand of a GEMM processed in pieces (chunked attention) is scaled by the k of the
    whole operand (`hifp8_scale_exponent`).
    """
    _check_tensor(x)
    _check_target_exponent(target_exponent)
    _check_saturate("hifp8", saturate)
    if x.numel() == 0:
        return x.clone()
    with torch.no_grad():
        work, owned = _to_compute(x)
        if scale_exponent is None:
            k = _scale_exponent_of_amax(torch.maximum(work.amax(), work.amin().neg()),
                                        target_exponent)
        else:
            k = torch.as_tensor(scale_exponent, device=x.device).to(torch.int32)
        scaled = work.mul_(_pow2(k, work.dtype)) if owned else work * _pow2(k, work.dtype)
        q = _hifp8_round(scaled, x, True, bool(saturate))
        return q.mul_(_pow2(-k, work.dtype)).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------

def _fake_quantize_impl(x: torch.Tensor, fmt: str, axis: int, scale_mode: str,
                        saturate: bool) -> torch.Tensor:
    """Validated arguments in; the format dispatch (shared by eager and compiled paths)."""
    kind = _INFO[fmt].kind
    if kind == "mx":
        return _mx_fake_quantize(x, fmt, axis, scale_mode)
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


_COMPILE = False


def set_compile(enabled: bool = True) -> None:
    """Route fake_quantize through torch.compile (off by default; results are identical)."""
    global _COMPILE
    _COMPILE = bool(enabled)


def compile_enabled() -> bool:
    return _COMPILE


@functools.lru_cache(maxsize=1)
def _compiled_impl():
    return torch.compile(_fake_quantize_impl, dynamic=True)


def fake_quantize(x: torch.Tensor, fmt: str, axis: int = -1, scale_mode: str = "floor",
                  saturate: Optional[bool] = None) -> torch.Tensor:
    """Quantize `x` to `fmt` and dequantize it back: same shape and dtype, exact values.

    fmt: "mxfp8" (= "mxfp8_e4m3"), "mxfp8_e5m2", "mxfp4" (E2M1), "hifp8", "bf16", "fp16"
    (round to that dtype and back) or "none" (returns x itself).
    axis: the MX block axis (32 consecutive elements along it share a scale); ignored by the
    element-wise formats. scale_mode: "floor" (OCP) or "rceil" (NVIDIA), MX only.
    saturate: HiFP8 only. None/False is the plain cast (|x| >= 40960 -> +-Inf); True clamps
    overflow and +-Inf to +-32768. Other formats accept only None.
    The result carries no autograd history (wrap it in a straight-through function, or use
    gemm.quantized_linear / quantized_matmul, to train through it).
    """
    return _fake_quantize(x, fmt, axis, scale_mode, saturate, _COMPILE)


def fake_quantize_compiled(x: torch.Tensor, fmt: str, axis: int = -1,
                           scale_mode: str = "floor",
                           saturate: Optional[bool] = None) -> torch.Tensor:
    """fake_quantize through torch.compile(dynamic=True); identical results, fused kernels."""
    return _fake_quantize(x, fmt, axis, scale_mode, saturate, True)


def _fake_quantize(x, fmt, axis, scale_mode, saturate, compiled):
    _check_tensor(x)
    fmt = canonical_format(fmt)
    _check_scale_mode(scale_mode)
    saturate = _check_saturate(fmt, saturate)
    info = _INFO[fmt]
    if info.kind == "mx":
        axis = _normalize_axis(axis, x.dim())
    else:
        axis = -1
    if fmt == "none":
        return x
    if x.numel() == 0:
        return x.clone()
    impl = _compiled_impl() if compiled else _fake_quantize_impl
    with torch.no_grad():   # rounding has no useful gradient; the GEMMs define their own
        return impl(x, fmt, axis, scale_mode, saturate)
