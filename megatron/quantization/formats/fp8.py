"""FP8 (E4M3 / E5M2) with float32 scales: per-tensor current or delayed scaling, and 1x128 /
128x128 blockwise scaling (the TransformerEngine Float8CurrentScaling, DelayedScaling and
Float8BlockScaling recipes; design note section 7).

Every step is float32 arithmetic on the exactly upcast input, f32(.) = round to nearest
float32, ties to even:

    scale     = f32(f32(fp8_max * 2**-margin) / amax)   IEEE division (fp8_max: 448 / 57344)
                1.0 if amax is 0, negative, Inf or NaN; value_for_inf if the quotient is +Inf;
                pow2_scale keeps only the exponent bits (bits & 0xFF800000)
    v         = f32(x * scale), saturated to +-fp8_max (+-Inf included)
    q         = v rounded to E4M3 / E5M2, nearest, ties to even, subnormals kept
                (or stochastically rounded between its two grid neighbours)
    scale_inv = f32(1 / scale)
    y         = f32(q * scale_inv)                       (a product: NOT q / scale)

and y is cast back to x's dtype (RNE). fp8_max * 2**-margin is evaluated in float32 first, as
TE's delayed-scaling kernel does, then divided.

Scaling ("scaling", "amax", "block"):
  * "tensor", amax None -- current scaling: amax = max|x| over the tensor, value_for_inf =
    FLT_MAX. A NaN or +-Inf anywhere makes every output NaN (TE's reference; its kernel
    ignores NaN and saturates Inf, which would hide the overflow). A zero tensor gets scale 1
    (output +-0). An fp32 subnormal tensor gets scale FLT_MAX (pow2: 2**127) and is not
    flushed.
  * "tensor", amax A -- delayed scaling: the scale comes from the caller's A (e.g. the amax
    history), not from x. Values of x above A saturate to +-fp8_max * scale_inv; a NaN or
    +-Inf element becomes NaN at its own position only.
  * "block" -- one scale per tile: block (1, 128) is 128 consecutive elements along `axis`
    (any ndim), (128, 128) a tile of a 2-D x (the same for either axis: the tile is square).
    Partial tiles are zero-padded (zeros never change an amax). value_for_inf is the largest
    finite value of x's dtype, as TE's blockwise kernels use: FLT_MAX for float32,
    3.3895314e38 (0x7F7F0000) for bfloat16, 65504 for float16. A NaN or +-Inf in a tile makes
    that tile all NaN; other tiles are unaffected.

float64 inputs (no TE counterpart; kept for references): the scales are the same float32
numbers, from the float64 amax rounded to float32 (a finite amax above FLT_MAX counts as
FLT_MAX), value_for_inf is FLT_MAX; x * scale, the element rounding and q * scale_inv are
float64 arithmetic (q * scale_inv is then exact). float16 inputs upcast to float32 exactly like
bfloat16.

Large margins follow the float32 sequence literally (as TE would): with amax near FLT_MAX a
margin >= 7 (E5M2: >= 14) makes the scale a float32 subnormal, which pow2_scale truncates to 0,
and a margin >= 9 (E5M2: >= 16) makes scale_inv = 1 / scale overflow to Inf; the outputs are
then NaN / Inf -- visible, never silently wrong. Margins up to 6 (E5M2: 13), and any negative
margin, are safe for every finite float32 amax.
"""

from __future__ import annotations

from types import MappingProxyType
import math
import numbers
from typing import Optional, Tuple

import torch

from megatron.quantization.formats.common import (
    FORMAT_INFO, FormatInfo, block_view, check_tensor, normalize_axis, canonical_format)
from megatron.quantization.formats.elements import round_elements_
from megatron.quantization.formats.rounding import stochastic_round_to_grid

FP8_SCALINGS = ("tensor", "block")
FP8_BLOCKS = ((1, 128), (128, 128))
FP8_TILE = 128
FLT_MAX = float(torch.finfo(torch.float32).max)

# The scale used when fp8_max * 2**-margin / amax overflows float32 (amax tiny).
# Per tensor TE passes FLT_MAX; its blockwise kernels pass the input type's largest finite
# value (the scale is still a float32 number). float64 has no TE kernel and a float32 scale.
_TENSOR_VALUE_FOR_INF = FLT_MAX
_BLOCK_VALUE_FOR_INF = MappingProxyType({
    torch.float32: FLT_MAX,
    torch.bfloat16: float(torch.finfo(torch.bfloat16).max),   # 0x7F7F0000 = 3.3895314e38
    torch.float16: float(torch.finfo(torch.float16).max),     # 65504
    torch.float64: FLT_MAX,
})
_EXPONENT_MASK = 0x7F800000   # scales are positive: bits & 0xFF800000 == bits & 0x7F800000


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

def check_fp8_options(x: torch.Tensor, scaling, margin, pow2_scale, block):
    """Validate the FP8 options and fill in defaults; returns the hashable tuple
    (scaling, margin as float, pow2_scale, block as a tuple or None).

    scaling None means "tensor"; block None means (1, 128) with scaling "block" and must stay
    None with scaling "tensor"; (128, 128) tiles need a 2-D x.
    """
    if scaling is None:
        scaling = "tensor"
    if not isinstance(scaling, str) or scaling not in FP8_SCALINGS:
        raise ValueError(f"unknown fp8 scaling {scaling!r}; valid: {', '.join(FP8_SCALINGS)}")
    try:
        finite = (not isinstance(margin, bool) and isinstance(margin, numbers.Real)
                  and math.isfinite(margin))
    except OverflowError:            # an int beyond the float range
        finite = False
    if not finite:
        raise ValueError(f"margin must be a finite real number, got {margin!r}")
    if not isinstance(pow2_scale, bool):
        raise ValueError(f"pow2_scale must be True or False, got {pow2_scale!r}")
    valid_blocks = ", ".join(str(b) for b in FP8_BLOCKS)
    if scaling == "tensor":
        if block is not None:
            raise ValueError(f"block applies to scaling='block' only, got block={block!r} "
                             "with scaling='tensor'")
        return scaling, float(margin), pow2_scale, None
    if block is None:
        block = FP8_BLOCKS[0]
    try:
        normalized = tuple(_as_int(b) for b in block)
    except TypeError:
        normalized = None
    if normalized not in FP8_BLOCKS:
        raise ValueError(f"unknown fp8 block {block!r}; valid blocks: {valid_blocks}")
    if normalized == (FP8_TILE, FP8_TILE) and x.dim() != 2:
        raise ValueError(f"block (128, 128) needs a 2-D tensor, got shape {tuple(x.shape)}")
    return scaling, float(margin), pow2_scale, normalized


def _as_int(value) -> int:
    """int(value) for integers (not bools or floats); TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"not an integer: {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------

def _round_to_f32(value: float) -> float:
    """`value` rounded to the nearest float32 (ties to even; +-Inf past the float32 range),
    as a Python float. Pure Python (frexp / ldexp / round are exact), so it folds to a
    constant under torch.compile."""
    if value == 0 or not math.isfinite(value):
        return value
    _, e = math.frexp(abs(value))
    quantum = max(e - 24, -149)                 # 24 significant bits; subnormal step 2**-149
    rounded = math.ldexp(round(math.ldexp(abs(value), -quantum)), quantum)  # round(): ties even
    return math.copysign(math.inf if rounded > FLT_MAX else rounded, value)


def block_value_for_inf(dtype: torch.dtype) -> float:
    """The scale blockwise scaling uses where fp8_max / amax overflows float32 (see
    _BLOCK_VALUE_FOR_INF)."""
    return _BLOCK_VALUE_FOR_INF[dtype]


def scaled_max(fp8_max: float, margin: float) -> float:
    """f32(fp8_max * f32(2**-margin)): TE's `fp8_max * pow(2, -margin)` in float32.

    Exact for integer margins in [-120, 120] (a power of two times 448 or 57344); past the
    float32 range it is +Inf or 0 (see the module note on degenerate margins)."""
    margin = min(max(margin, -400.0), 400.0)   # 2**+-400 is already Inf / 0 in float32
    return _round_to_f32(fp8_max * _round_to_f32(2.0 ** -margin))


def _scales_from_amax(amax: torch.Tensor, fp8_max: float, margin: float, pow2_scale: bool,
                      value_for_inf: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv), float32, elementwise from float32 amax values (design note 7.1).

    The division is a float32 tensor division (IEEE, correctly rounded), never
    `python_number / tensor` (which torch evaluates as reciprocal * number: two roundings).
    """
    scale = torch.full_like(amax, scaled_max(fp8_max, margin)).div_(amax)
    scale = torch.where(scale == math.inf, value_for_inf, scale)
    usable = (amax > 0) & (amax < math.inf)      # False for 0, negative, Inf and NaN
    scale = torch.where(usable, scale, 1.0)
    if pow2_scale:
        scale = scale.view(torch.int32).bitwise_and(_EXPONENT_MASK).view(torch.float32)
    return scale, torch.reciprocal(scale)


def _abs_max(t: torch.Tensor, dims: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """max |t| as float32, over all of t (0-d) or over `dims` (kept): NaN if a NaN is there,
    else Inf if an Inf is.

    max(max, -min): reductions that propagate NaN, without a full-size |t| temporary (16-bit
    inputs are reduced in their own dtype, exactly). float64: the amax is rounded to float32,
    a finite one above FLT_MAX counting as FLT_MAX.
    """
    if dims is None:
        low, high = torch.aminmax(t)
    else:
        low, high = t.amin(dims, keepdim=True), t.amax(dims, keepdim=True)
    top = torch.maximum(high, low.neg()).abs_()     # abs_: max(-0, +0) may come out as -0
    if t.dtype == torch.float64:
        top = torch.where(top == math.inf, top, top.clamp(max=FLT_MAX))
    return top.float()


# --------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------

def _row_tiles(t: torch.Tensor, axis: int):
    """t zero-padded along `axis` to a multiple of 128 and viewed as [..., nblocks, 128, ...]."""
    return block_view(t, axis, FP8_TILE)[0]


def _square_tiles(t: torch.Tensor):
    """2-D t zero-padded to multiples of 128 and viewed as [rows/128, 128, cols/128, 128]."""
    rows, cols = t.shape
    nr, nc = -(-rows // FP8_TILE), -(-cols // FP8_TILE)
    if nr * FP8_TILE != rows or nc * FP8_TILE != cols:
        t = torch.nn.functional.pad(t, (0, nc * FP8_TILE - cols, 0, nr * FP8_TILE - rows))
    return t.reshape(nr, FP8_TILE, nc, FP8_TILE)


def _tiled(t: torch.Tensor, axis: int, block: Tuple[int, int]):
    """(tiles view, the dims one tile spans) for blockwise scaling."""
    if block == (1, FP8_TILE):
        return _row_tiles(t, axis), (axis + 1,)
    return _square_tiles(t), (1, 3)


def _untiled(tiles: torch.Tensor, shape, axis: int, block: Tuple[int, int]) -> torch.Tensor:
    """The inverse of _tiled: back to `shape`, padding cropped."""
    if block == (1, FP8_TILE):
        return tiles.flatten(axis, axis + 1).narrow(axis, 0, shape[axis])
    rows, cols = shape
    return tiles.flatten(0, 1).flatten(1, 2)[:rows, :cols]


# --------------------------------------------------------------------------------------------
# Quantize-dequantize
# --------------------------------------------------------------------------------------------

def _quantize_dequantize(x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                         fmt: str, info: FormatInfo,
                         noise: Optional[torch.Tensor]) -> torch.Tensor:
    """f32(q * scale_inv) with q = fp8(f32(x * scale)), saturated; a fresh float32 tensor
    (float64 for float64 x). scale and scale_inv have x's ndim and broadcast against it.
    16-bit x is upcast first (exactly) and scaled in place: cheaper on CPU than letting the
    multiplication promote.
    """
    if x.dtype in (torch.float32, torch.float64):
        v = torch.mul(x, scale)
    else:
        v = x.to(torch.float32).mul_(scale)      # exact upcast, then one rounding
    if noise is None:
        # RNE; saturates first (torch's e5m2 cast does not, P8); +-Inf -> +-max.
        factor = round_elements_(v, fmt, info)
        if factor != 1.0:
            v.mul_(factor)           # exact: q = decoded * 2**k
    else:
        v.clamp_(-info.max_normal, info.max_normal)
        # (the rounded values come back as the result; v itself is left as scratch)
        v = stochastic_round_to_grid(v, noise, info.emin_elem, info.mantissa_bits)
    return v.mul_(scale_inv)


def _tensor_fake_quantize(x, fmt, info, amax, margin, pow2_scale, noise):
    """Per-tensor scaling: current (amax None) or delayed (amax given)."""
    delayed = amax is not None
    if delayed:
        if amax.dim() != 0:
            raise ValueError(f"amax must be a scalar (python number or 0-d tensor), got shape "
                             f"{tuple(amax.shape)}")
        amax = amax.to(torch.float32)
    else:
        amax = _abs_max(x)
    scale, scale_inv = _scales_from_amax(amax, info.max_normal, margin, pow2_scale,
                                         _TENSOR_VALUE_FOR_INF)
    if not delayed:
        scale_inv = scale_inv + amax * 0.0      # NaN when amax is NaN/Inf: all outputs NaN
    ones = [1] * x.dim()
    y = _quantize_dequantize(x, scale.reshape(ones), scale_inv.reshape(ones), fmt, info, noise)
    out = y.to(x.dtype)
    if delayed:
        # The scale does not depend on x: only the non-finite elements themselves are NaN.
        # out + x * 0 in one pass, in x's dtype: NaN where x is NaN or +-Inf, out itself
        # elsewhere (x * 0 is a zero of out's sign there, so -0 stays -0).
        out.addcmul_(x, torch.zeros((), dtype=x.dtype, device=x.device))
    return out


def _block_fake_quantize(x, fmt, info, axis, block, margin, pow2_scale, noise):
    """Blockwise scaling: one scale per 1x128 or 128x128 tile."""
    tiles, dims = _tiled(x, axis, block)
    amax = _abs_max(tiles, dims)
    scale, scale_inv = _scales_from_amax(amax, info.max_normal, margin, pow2_scale,
                                         _BLOCK_VALUE_FOR_INF[x.dtype])
    scale_inv.add_(amax * 0.0)                   # NaN for tiles holding NaN/Inf
    if noise is not None:
        noise = _tiled(noise, axis, block)[0]
    y = _quantize_dequantize(tiles, scale, scale_inv, fmt, info, noise)
    return _untiled(y, x.shape, axis, block).to(x.dtype)


def fp8_fake_quantize(x: torch.Tensor, fmt: str, axis: int, scaling: str,
                       amax: Optional[torch.Tensor], margin: float, pow2_scale: bool,
                       block: Optional[Tuple[int, int]],
                       noise: Optional[torch.Tensor]) -> torch.Tensor:
    """FP8 quantize-dequantize of a validated x (float dtype, numel > 0, axis >= 0) with
    options from check_fp8_options; amax a 0-d float32 tensor or None; noise uniform [0, 1)
    float32 of x's shape (stochastic rounding) or None (round to nearest, ties to even)."""
    info = FORMAT_INFO[fmt]
    if scaling == "tensor":
        return _tensor_fake_quantize(x, fmt, info, amax, margin, pow2_scale, noise)
    return _block_fake_quantize(x, fmt, info, axis, block, margin, pow2_scale, noise)


# --------------------------------------------------------------------------------------------
# Public helpers (captures, telemetry, delayed-scaling bookkeeping)
# --------------------------------------------------------------------------------------------

def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d float32 tensor: NaN if x holds a NaN, else Inf if it holds an Inf;
    0 for an empty x. This is the amax current scaling uses, and what a delayed-scaling amax
    history records."""
    check_tensor(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.no_grad():
        return _abs_max(x)


def fp8_scales(x: torch.Tensor, fmt: str, axis: int = -1, scaling: str = "tensor",
               amax=None, margin: float = 0, pow2_scale: bool = False,
               block: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """The float32 scales fake_quantize(x, fmt, ...) uses (the quantize multiplier; the
    dequantize factor is 1 / scale rounded to float32).

    Tensor scaling: a 0-d tensor (from `amax` when given, else from x). Block (1, 128): x's
    shape with `axis` replaced by ceil(n / 128). Block (128, 128): [ceil(rows / 128),
    ceil(cols / 128)]. A scale is 1.0 where the amax is 0, NaN or Inf (the outputs there are
    NaN all the same for current and blockwise scaling).
    """
    check_tensor(x)
    fmt = canonical_format(fmt)
    info = FORMAT_INFO[fmt]
    if info.kind != "fp8":
        raise ValueError(f"{fmt!r} is not an fp8 format; fp8 formats: fp8_e4m3, fp8_e5m2")
    scaling, margin, pow2_scale, block = check_fp8_options(x, scaling, margin, pow2_scale,
                                                            block)
    if amax is not None and scaling != "tensor":
        raise ValueError(f"amax applies to scaling='tensor', not scaling={scaling!r}")
    if x.dim() or scaling == "block":
        axis = normalize_axis(axis, x.dim())
    with torch.no_grad():
        if scaling == "tensor":
            if amax is None:
                amax = fp8_amax(x)
            else:
                amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
                if amax.dim() != 0:
                    raise ValueError(f"amax must be a scalar (python number or 0-d tensor), "
                                     f"got shape {tuple(amax.shape)}")
            return _scales_from_amax(amax, info.max_normal, margin, pow2_scale,
                                     _TENSOR_VALUE_FOR_INF)[0]
        value_for_inf = _BLOCK_VALUE_FOR_INF[x.dtype]
        if block == (1, FP8_TILE):
            shape = list(x.shape)
            shape[axis] = -(-shape[axis] // FP8_TILE)
        else:
            shape = [-(-n // FP8_TILE) for n in x.shape]
        if x.numel() == 0:
            return torch.ones(shape, dtype=torch.float32, device=x.device)
        tiles, dims = _tiled(x, axis, block)
        scale = _scales_from_amax(_abs_max(tiles, dims), info.max_normal, margin, pow2_scale,
                                  value_for_inf)[0]
        return scale.reshape(shape)
