"""Statistics of captured tensors and of their quantization error (docs/capture-format.md).

The functions run on the tensor's own device (a GPU in real runs, so only a handful of scalars
cross to the host) and return plain Python values ready for JSON. Non-finite results (an `inf`
SQNR) stay floats here; the manifest writer encodes them as strings.

Speed matters: stats mode runs every iteration. The common case (every value finite, known
from min and max, which propagate NaN and show Inf) uses reductions and at most one or two
full-size temporaries; masks are built only when NaN/Inf are present. Reductions over x are
shared between tensor_info and quant_error (`Moments`) and reused for re-quantized copies of
the same data.

Accuracy: sums and sums of squares accumulate in float64; the variance is recomputed in two
passes when the mean dominates it. `q - x` is computed in the input dtype, where it is exact:
fake quantization rounds to a grid whose spacing is at most |x|, so q lies within a factor 2
of x (or is 0), and by Sterbenz's lemma the difference is representable. The exceptions are
computed in float64: HiFP8 saturating values far above its maximum, NVFP4 and FP8 (an element
of a block with a subnormal scale, or beyond a delayed scale's range, clamps far below itself)
and stochastically rounded operands (a value far below the grid's spacing may round up to it).

The telemetry's device-resident sums of the same quantities are in operand_sums.py.

Formats with scales: MX blocks (E8M0 exponents, recomputed from the block maxima), NVFP4 (E4M3
block scales and a float32 tensor scale) and FP8 (float32 per-tensor or per-tile scales) are
recomputed from x with the operand's format options (`gemm.format_options`), through the
format library's own `nvfp4_scales` / `fp8_scales` (`scale_stats`), so that saturation and the
scale statistics describe exactly what the quantizer did.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron.quantization.formats import (
    HIFP8_OVERFLOW, NAN_EXPONENT, format_info, mx_shared_exponents)
from megatron.quantization.formats.fp8 import fp8_scales
from megatron.quantization.formats.nvfp4 import nvfp4_scales
from megatron.quantization.formats.nvfp4 import tensor_scales as nvfp4_tensor_scales


HIFP8_REGIONS = ("mant3", "mant2", "mant1", "denormal", "underflow", "overflow")
_F64 = torch.float64
_F32 = torch.float32


def _scalars(values: List[torch.Tensor]) -> List[float]:
    """Many 0-d tensors to Python floats with a single device synchronisation."""
    if not values:
        return []
    return torch.stack([v.to(_F64) for v in values]).tolist()


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


_ROW, _MAX_ROWS = 8192, 16384


def rows(t: torch.Tensor):
    """t flattened into equal rows plus a tail. Reducing each row (one thread per row) and
    then the few row results serially gives sums that do not depend on the number of
    threads, so the same tensor gets bit-identical statistics in either capture mode."""
    flat = t.reshape(-1)
    n = flat.numel()
    width = max(_ROW, -(-n // _MAX_ROWS))
    full = n - n % width
    return flat[:full].view(-1, width), flat[full:]


def _sum64(t: torch.Tensor) -> torch.Tensor:
    body, tail = rows(t)
    return body.sum(dim=1, dtype=_F64).sum() + tail.sum(dtype=_F64)


def _sumsq64(t: torch.Tensor) -> torch.Tensor:
    body, tail = rows(t)
    norm = torch.linalg.vector_norm
    return norm(body, dim=1, dtype=_F64).square().sum() + norm(tail, dtype=_F64).square()


# --------------------------------------------------------------------------------------------
# tensor_info
# --------------------------------------------------------------------------------------------

def _empty_info(x: torch.Tensor) -> dict:
    return {
        "shape": list(x.shape), "dtype": str(x.dtype), "device": str(x.device),
        "requires_grad": bool(x.requires_grad), "is_leaf": bool(x.is_leaf),
        "numel": int(x.numel()), "min": None, "max": None, "mean": None, "std": None,
        "absmax": None, "zero_fraction": 0.0, "nan_count": 0, "inf_count": 0,
    }


class Moments:
    """Reductions over the finite values of one tensor, shared by tensor_info and
    quant_error: count, min, max, sum, sum of squares (float64), nonzero count, variance.

    Plain numbers once built (no tensor is kept), so a record that re-quantizes the same
    data (weight_dgrad, input_wgrad, ...) can reuse them.
    """

    def __init__(self, x: torch.Tensor):
        self.n = x.numel()
        lo, hi = x.aminmax()           # NaN propagates; an Inf shows up as min or max
        self.lo, self.hi = float(lo), float(hi)
        self.all_finite = math.isfinite(self.lo) and math.isfinite(self.hi)
        self.nan_count = 0
        values = x
        if not self.all_finite:
            finite = torch.isfinite(x)
            self.nan_count = int(torch.isnan(x).sum())
            values = x[finite]
            if values.numel():
                lo, hi = values.aminmax()
                self.lo, self.hi = float(lo), float(hi)
        self.count = values.numel()
        self.sum = self.sumsq = self.nonzero = self.variance = 0.0
        if self.count:
            self.sum, self.sumsq, self.nonzero = _scalars(
                [_sum64(values), _sumsq64(values), torch.count_nonzero(values)])
            self.variance = self._variance(values)

    def _variance(self, values: torch.Tensor) -> float:
        n, mean = self.count, self.sum / self.count
        var = self.sumsq / n - mean * mean
        # The one-pass formula loses digits when mean**2 dominates: redo it in two passes.
        if mean * mean > 16.0 * max(var, 0.0):
            centred = values.reshape(-1).to(_F64, copy=True).sub_(mean)
            var, shift = _scalars([_sumsq64(centred) / n, _sum64(centred) / n])
            var -= shift * shift
        return max(var, 0.0)


def _info_from(x: torch.Tensor, m: Moments) -> dict:
    info = _empty_info(x)
    info.update(nan_count=m.nan_count, inf_count=m.n - m.count - m.nan_count)
    if m.count:
        info.update(min=m.lo, max=m.hi, mean=m.sum / m.count, std=math.sqrt(m.variance),
                    absmax=max(abs(m.lo), abs(m.hi)),
                    zero_fraction=(m.count - m.nonzero) / m.n)
    return info


def tensor_info(x: torch.Tensor) -> dict:
    """Shape, dtype and value statistics of `x` (statistics over its finite values).

    std is the population standard deviation (ddof 0); zero_fraction is the fraction of all
    elements that are zero; min/max/mean/std/absmax are None when no value is finite.
    """
    if x.numel() == 0:
        return _empty_info(x)
    return _info_from(x, Moments(x.detach()))


# --------------------------------------------------------------------------------------------
# Format-specific parts of quant_error
# --------------------------------------------------------------------------------------------

def block_view(t: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """t as [..., nblocks, block, ...] along `axis`, zero-padded like the MX quantizer."""
    n = t.shape[axis]
    pad = -n % block
    if pad:
        t = F.pad(t, [0, 0] * (t.dim() - 1 - axis) + [0, pad])
    return t.unflatten(axis, ((n + pad) // block, block))


def _mx_block_stats(x: torch.Tensor, fmt: str, info, axis: int, scale_mode: str,
                    all_finite: bool = False):
    """(saturated count tensor, scale-exponent histogram, NaN block count) of an MX operand.

    An element saturates when |x| / 2**e exceeds the element format's max_normal, e being
    its block's shared exponent. Elements of NaN/Inf blocks never count.
    """
    exps = mx_shared_exponents(x, fmt, axis=axis, scale_mode=scale_mode)
    bad = exps == NAN_EXPONENT
    any_bad = bool(bad.any())
    # The limit max_normal * 2**e is exact in float32 (inf above its range, where no float32
    # value can exceed it); 16-bit inputs are compared in float32 too.
    work = x if x.dtype in (torch.float32, _F64) else x.float()
    limit = torch.ldexp(torch.full(exps.shape, info.max_normal, dtype=work.dtype,
                                   device=x.device), torch.where(bad, 0, exps) if any_bad else exps)
    if any_bad:
        limit = torch.where(bad, math.inf, limit)
    excess = block_view(work.abs(), axis, info.block_size)
    if all_finite:
        # |x| - limit > 0 exactly when |x| > limit; in place on the |x| temporary.
        saturated = torch.count_nonzero(excess.sub_(limit.unsqueeze(axis + 1)).clamp_(min=0))
    else:
        # NaN compares False, so non-finite elements are never counted.
        saturated = torch.count_nonzero(excess > limit.unsqueeze(axis + 1))
    good = exps[~bad] if any_bad else exps.reshape(-1)
    nan_blocks = exps.numel() - good.numel()
    if good.numel() == 0:
        return saturated, {"min": None, "counts": []}, nan_blocks
    lo = int(good.min())
    counts = torch.bincount((good - lo).reshape(-1)).tolist()
    return saturated, {"min": lo, "counts": counts}, nan_blocks


# --------------------------------------------------------------------------------------------
# Scaled formats: NVFP4 (E4M3 block scales, float32 tensor scale) and FP8 (float32 scales)
# --------------------------------------------------------------------------------------------

FLT_MAX = float(torch.finfo(torch.float32).max)
E4M3_MIN_NORMAL = 2.0 ** -6          # smaller nonzero E4M3 block scales are subnormal
SCALED_KINDS = ("nvfp4", "fp8")


def clamp_threshold(info):
    """(t, inclusive): a scaled element value v of an FP8 / NVFP4 element format is clamped --
    it would round to a magnitude beyond the largest finite one, max_normal, if the format had
    one -- when |v| > t (inclusive: |v| >= t), t = max_normal + half a step at the top. The tie
    at t rounds to even, which is beyond max_normal when max_normal's last mantissa bit is 1:
    E4M3 |v| > 464, E5M2 |v| >= 61440, E2M1 |v| >= 7 (values up to t round to max_normal
    anyway, so the clamp changes nothing for them)."""
    step = 2.0 ** (info.emax_elem - info.mantissa_bits)
    return info.max_normal + step / 2, int(info.max_normal / step) % 2 == 1


def _count_clamped(v: torch.Tensor, info) -> torch.Tensor:
    """Elements of the scaled values `v` the element format's clamp changed (NaN never)."""
    t, inclusive = clamp_threshold(info)
    magnitude = v.abs()
    return torch.count_nonzero(magnitude >= t if inclusive else magnitude > t)


class ScaleStats(NamedTuple):
    """An NVFP4 or FP8 operand's scales and the elements its element clamp changed, as device
    tensors (no host synchronisation). Block fields count NVFP4 blocks or FP8 tiles; a
    per-tensor FP8 scale has none (blocks = 0)."""

    saturated: torch.Tensor             # int64: elements clamped (clamp_threshold)
    blocks: torch.Tensor                # int64
    nan_blocks: torch.Tensor            # int64: blocks whose scale is undefined (NaN/Inf data)
    zero_blocks: torch.Tensor           # int64: NVFP4 E4M3 scale 0 (all-zero or flushed block)
    subnormal_blocks: torch.Tensor      # int64: NVFP4 E4M3 scale in (0, 2**-6)
    block_min: torch.Tensor             # float64: smallest nonzero defined block scale (+inf: none)
    block_max: torch.Tensor             # float64: largest (-inf: none)
    tensor_scale: Optional[torch.Tensor]    # float32 0-d: NVFP4 s_enc (None row-scaled),
                                            # FP8 per-tensor scale
    block_scales: Optional[torch.Tensor]    # float32 block scales (NaN where undefined)
    valid: Optional[torch.Tensor]           # bool, like block_scales: defined and nonzero


def _zero_padded(t: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    pad = -t.shape[axis] % block
    if pad:
        t = F.pad(t, [0, 0] * (t.dim() - 1 - axis) + [0, pad])
    return t


def _tiles(t: torch.Tensor, axis: int, block: int, square: bool):
    """(t zero-padded and viewed in blocks, how a per-block tensor broadcasts against it):
    `block` consecutive elements along `axis`, or block x block tiles of a 2-D t."""
    if square:
        t = _zero_padded(_zero_padded(t, 0, block), 1, block)
        rows, cols = t.shape
        return t.reshape(rows // block, block, cols // block, block), \
            lambda s: s.reshape(rows // block, 1, cols // block, 1)
    t = _zero_padded(t, axis, block)
    return t.unflatten(axis, (t.shape[axis] // block, block)), lambda s: s.unsqueeze(axis + 1)


def _block_extrema(scales: torch.Tensor, valid: torch.Tensor):
    inf = constant(math.inf, scales.device)
    values = scales.to(_F64)
    return (torch.where(valid, values, inf).amin() if values.numel() else inf,
            torch.where(valid, values, -inf).amax() if values.numel() else -inf)


def _nvfp4_scale_stats(x: torch.Tensor, axis: int, options: dict) -> ScaleStats:
    """NVFP4 (design note 6.1): the E4M3 block scales s, the tensor scale s_enc, and
    v = f32(x * enc_b), enc_b = 1 / f32(s * s_dec), the values the E2M1 rounding saw."""
    block_2d = bool(options.get("block_2d")) and x.dim() == 2
    bound = int(options.get("four_over_six_bound", 448))
    s, amax = nvfp4_scales(x, axis=axis, block_2d=block_2d, amax=options.get("amax"),
                           four_over_six=options.get("four_over_six"), four_over_six_bound=bound,
                           row_scaled=bool(options.get("row_scaled")))
    _, s_enc, s_dec, _ = nvfp4_tensor_scales(amax, None, bound)   # per row when row-scaled
    enc = torch.reciprocal(s * s_dec).clamp_(max=FLT_MAX)
    blocks, spread = _tiles(x.to(_F32), axis, 16, block_2d)
    saturated = _count_clamped(blocks * spread(enc), format_info("nvfp4"))
    defined = ~torch.isnan(s)
    valid = defined & (s > 0)
    lo, hi = _block_extrema(s, valid)
    count = lambda mask: torch.count_nonzero(mask)  # noqa: E731
    return ScaleStats(saturated, constant(s.numel(), x.device, dtype=torch.int64),
                      count(~defined),
                      count(s == 0), count(valid & (s < E4M3_MIN_NORMAL)), lo, hi,
                      None if options.get("row_scaled") else s_enc, s, valid)


def _fp8_scale_stats(x: torch.Tensor, fmt: str, axis: int, options: dict,
                     all_finite: bool) -> ScaleStats:
    """FP8 (design note 7): the float32 scale(s) and v = f32(x * scale) (float64 for float64
    x), the values the element rounding saw."""
    info = format_info(fmt)
    work = x if x.dtype in (_F32, _F64) else x.to(_F32)
    zero = constant(0, x.device, dtype=torch.int64)
    pow2 = bool(options.get("pow2_scale", False))
    if (options.get("scaling") or "tensor") == "tensor":
        amax = options.get("amax")
        scale = fp8_scales(x, fmt, axis, "tensor", amax=amax,
                           margin=options.get("margin", 0) or 0, pow2_scale=pow2)
        v = work * scale
        if all_finite:
            saturated = _count_clamped(v, info)
        else:
            finite = torch.isfinite(v)
            saturated = _count_clamped(torch.where(finite, v, 0.0), info)
            if amax is None:       # current scaling of a tensor with NaN / Inf: all NaN
                saturated = torch.where(finite.all(), saturated, 0)
        inf = constant(math.inf, x.device)
        return ScaleStats(saturated, zero, zero, zero, zero, inf, -inf, scale, None, None)
    block = tuple(options.get("block") or (1, 128))
    square = block == (128, 128)
    scales = fp8_scales(x, fmt, axis, "block", margin=options.get("margin", 0) or 0,
                        pow2_scale=pow2, block=block)
    tiles, spread = _tiles(work, axis, 128, square)
    dims = (1, 3) if square else (axis + 1,)
    tile_amax = torch.maximum(tiles.amax(dims), tiles.amin(dims).neg())   # NaN propagates
    tile_amax = tile_amax.reshape(scales.shape)
    defined = torch.isfinite(tile_amax)
    v = tiles * spread(scales)
    if not all_finite:           # a tile holding NaN / Inf is all NaN
        v = torch.where(spread(defined), v, 0.0)
    saturated = _count_clamped(v, info)
    valid = defined & (tile_amax > 0)            # a zero tile's scale is a placeholder 1
    lo, hi = _block_extrema(scales, valid)
    return ScaleStats(saturated, constant(scales.numel(), x.device, dtype=torch.int64),
                      torch.count_nonzero(~defined), zero, zero, lo, hi, None,
                      torch.where(defined, scales, math.nan), valid)


def scale_stats(x: torch.Tensor, fmt: str, axis: Optional[int],
                options: Optional[dict] = None, all_finite: bool = False) -> Optional[ScaleStats]:
    """ScaleStats of an NVFP4 or FP8 operand quantized with the fake_quantize format
    `options` (gemm.format_options: block_2d, amax, scaling, block, margin, pow2_scale);
    None for other formats. `all_finite`: the caller knows x holds no NaN / Inf (skips the
    masks that keep such elements, and blocks or tensors that become all NaN, out of the
    saturated count)."""
    kind = format_info(fmt).kind
    if kind not in SCALED_KINDS or x.numel() == 0:
        return None
    options = options or {}
    axis = (axis if axis is not None else -1) % max(x.dim(), 1)
    with torch.no_grad():
        if kind == "nvfp4":
            return _nvfp4_scale_stats(x.detach(), axis, options)
        return _fp8_scale_stats(x.detach(), format_info(fmt).name, axis, options, all_finite)


def block_scales(x: torch.Tensor, fmt: str, axis: Optional[int],
                 options: Optional[dict] = None) -> Optional[torch.Tensor]:
    """The scales a record file keeps beside an NVFP4 / FP8 operand (float32): NVFP4 the E4M3
    block scales (x's shape with `axis` replaced by its number of 16-blocks, or
    [rows/16, cols/16] for 2-D tiles), FP8 the per-tensor scale (0-d) or the tile scales; NaN
    where undefined. None for other formats."""
    stats = scale_stats(x, fmt, axis, options)
    if stats is None:
        return None
    return stats.tensor_scale.reshape(()) if stats.block_scales is None else stats.block_scales


def _exponent_histogram(values: torch.Tensor) -> dict:
    """{"min", "counts"} of floor(log2 v) of positive finite values (exact, from frexp)."""
    if values.numel() == 0:
        return {"min": None, "counts": []}
    _, e = torch.frexp(values.to(_F64))
    e = (e - 1).reshape(-1).long()
    lo = int(e.min())
    return {"min": lo, "counts": torch.bincount(e - lo).tolist()}


def _scale_error_fields(stats: ScaleStats, kind: str) -> dict:
    """The quant_error keys of an NVFP4 / FP8 operand's scales (docs/capture-format.md)."""
    out = {}
    if stats.tensor_scale is not None:
        value = float(stats.tensor_scale)
        out["tensor_scale"] = value if math.isfinite(value) else None
    if stats.block_scales is None:
        return out
    blocks, nan_blocks, zero, subnormal, lo, hi = _scalars(
        [stats.blocks, stats.nan_blocks, stats.zero_blocks, stats.subnormal_blocks,
         stats.block_min, stats.block_max])
    defined = blocks - nan_blocks
    out.update(blocks=int(blocks), nan_blocks=int(nan_blocks),
               block_scale_min=lo if math.isfinite(lo) else None,
               block_scale_max=hi if math.isfinite(hi) else None,
               block_scale_hist=_exponent_histogram(stats.block_scales[stats.valid]))
    if kind == "nvfp4":
        out.update(block_scale_zero_fraction=_ratio(zero, defined),
                   block_scale_subnormal_fraction=_ratio(subnormal, defined))
    return out


# Region of a finite nonzero value by e = floor(log2|x|), for e clamped to [-24, 16].
_REGION_OF_EXPONENT = [
    4 if e <= -24 else 3 if e <= -16 else
    0 if abs(e) <= 3 else 1 if abs(e) <= 7 else 2 if abs(e) <= 15 else 5
    for e in range(-24, 17)
]
# (integer view dtype, shift to the exponent field, field mask, bias) of float dtypes.
_EXPONENT_FIELD = {torch.float32: (torch.int32, 23, 0xFF, 127),
                   torch.bfloat16: (torch.int16, 7, 0xFF, 127),
                   torch.float64: (torch.int64, 52, 0x7FF, 1023)}


def hifp8_regions(x: torch.Tensor, all_finite: bool = False) -> dict:
    """Fractions of the finite nonzero values of `x` in each HiFP8 precision region.

    By e = floor(log2|x|): mant3 |e| <= 3, mant2 4..7, mant1 8..15, denormal -23..-16
    (2**-23 <= |x| < 2**-15, rounded to powers of two), underflow e <= -24 (|x| < 2**-23,
    rounded to 0), overflow |x| >= 40960 (1.25 * 2**15, beyond the largest finite value).
    e is read from the exponent bits: one histogram pass, no per-element branching.
    `all_finite` skips the check for NaN/Inf when the caller already knows.
    """
    x = x.detach()
    if x.dtype not in _EXPONENT_FIELD:
        x = x.float()
    if not all_finite:
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            x = x[finite]
    view, shift, mask, bias = _EXPONENT_FIELD[x.dtype]
    field = (x.reshape(-1).view(view) >> shift) & mask
    per_field = torch.bincount(field, minlength=mask + 1).tolist()
    zeros = x.numel() - int(torch.count_nonzero(x))
    overflow = int(torch.count_nonzero(x.abs() >= HIFP8_OVERFLOW))
    counts = [0] * len(HIFP8_REGIONS)
    counts[4] += per_field[0] - zeros           # subnormals of the dtype: far below 2**-23
    for f in range(1, mask):
        if per_field[f]:
            e = min(max(f - bias, -24), 16)
            counts[_REGION_OF_EXPONENT[e + 24]] += per_field[f]
    # |x| in [40960, 65536) has e = 15 (mant1) but overflows.
    counts[2] -= overflow - counts[5]
    counts[5] = overflow
    total = sum(counts)
    return {name: _ratio(c, total) for name, c in zip(HIFP8_REGIONS, counts)}


# --------------------------------------------------------------------------------------------
# quant_error
# --------------------------------------------------------------------------------------------

def _difference(x: torch.Tensor, q: torch.Tensor, info, absmax: float,
                stochastic: bool = False) -> torch.Tensor:
    """q - x, exact (see the module docstring)."""
    if stochastic or info.kind in SCALED_KINDS or (info.kind not in ("mx", "none")
                                                   and absmax > 2 * info.max_normal):
        # Stochastic rounding may round a value far below the grid's spacing up to it.
        # saturated far beyond the format's range (HiFP8), or possibly so: an NVFP4 element
        # of a subnormal-scaled block, an FP8 value beyond a delayed scale's range
        return q.to(_F64) - x.to(_F64)
    return q - x


def quant_error(x: torch.Tensor, q: torch.Tensor, fmt: str, axis: Optional[int] = None,
                scale_mode: str = "floor", hifp8_scale_exponent: Optional[int] = None, *,
                options: Optional[dict] = None) -> dict:
    """Error of q = fake_quantize(x, fmt, axis, scale_mode, ..., **options) relative to x.

    mse, sqnr_db and relative_error are over the elements where both x and q are finite
    (float64 accumulation); fractions have the documented denominators and are 0 when that
    is empty. `hifp8_scale_exponent` k says q = 2**-k * HiF8(2**k * x) (per-tensor scaling):
    saturation and the HiFP8 regions are then those of the values the grid saw, 2**k * x,
    and `hifp8_regions_unscaled` adds the regions x itself would occupy. `options` are the
    format options of NVFP4 and FP8 operands (gemm.format_options: block_2d, amax,
    scaling, block, margin, pow2_scale), from which their scales are recomputed, and
    `stochastic: True` for a stochastically rounded q (q - x is then taken in float64: such
    a q need not lie within a factor 2 of x).
    """
    return record_stats(x, q, fmt, axis, scale_mode, hifp8_scale_exponent, options=options)[1]


def record_stats(x: torch.Tensor, q: Optional[torch.Tensor] = None, fmt: str = "none",
                 axis: Optional[int] = None, scale_mode: str = "floor",
                 hifp8_scale_exponent: Optional[int] = None, *,
                 options: Optional[dict] = None):
    """(tensor_info(x), quant_error(x, q, ...) or None), sharing the reductions over x."""
    info, error, _ = compute_stats(x, q, fmt, axis, scale_mode, hifp8_scale_exponent,
                                   options=options)
    return info, error


def compute_stats(x: torch.Tensor, q: Optional[torch.Tensor] = None, fmt: str = "none",
                  axis: Optional[int] = None, scale_mode: str = "floor",
                  hifp8_scale_exponent: Optional[int] = None,
                  moments: Optional[Moments] = None, *, options: Optional[dict] = None):
    """record_stats plus the Moments of x; pass `moments` of the same data (another view of
    the same tensor) to skip recomputing them."""
    if x.numel() == 0:
        error = _empty_error(format_info(fmt)) if q is not None else None
        return _empty_info(x), error, None
    m = moments if moments is not None else Moments(x.detach())
    info = _info_from(x, m)     # requires_grad / is_leaf of the tensor as given
    if q is None:
        return info, None, m
    return info, _quant_error(x.detach(), q.detach(), format_info(fmt), axis, scale_mode, m,
                              hifp8_scale_exponent, options), m


def _empty_error(info) -> dict:
    result = {"mse": None, "sqnr_db": None, "relative_error": None, "flushed_fraction": 0.0,
              "saturated_fraction": 0.0, "nonfinite_fraction": 0.0}
    if info.kind == "mx":
        result.update(scale_exponent_hist={"min": None, "counts": []}, nan_blocks=0)
    if info.kind == "hifp8":
        result["hifp8_regions"] = {name: 0.0 for name in HIFP8_REGIONS}
    return result


def _quant_error(x, q, info, axis, scale_mode, m: Moments, hifp8_k: Optional[int] = None,
                 options: Optional[dict] = None) -> dict:
    result = _empty_error(info)
    n = m.n
    qlo, qhi = q.aminmax()
    all_finite = m.all_finite and math.isfinite(float(qlo)) and math.isfinite(float(qhi))
    if all_finite:
        # x == 0 implies q == 0, so the flushed count is nonzero(x) - nonzero(q).
        n_finite_q = count = n
        sig2, n_nonzero = m.sumsq, m.nonzero
        diff = _difference(x, q, info, max(-m.lo, m.hi),
                           stochastic=bool((options or {}).get("stochastic")))
        values = [_sumsq64(diff), m.nonzero - torch.count_nonzero(q)]
    else:
        finite_x, finite_q = torch.isfinite(x), torch.isfinite(q)
        n_finite_q = int(finite_q.sum())
        both = finite_x & finite_q
        xs, qs = x[both].to(_F64), q[both].to(_F64)
        count = xs.numel()
        nonzero = finite_x & (x != 0)
        values = [_sumsq64(qs - xs), (nonzero & (q == 0)).sum(), _sumsq64(xs), nonzero.sum()]

    if info.kind == "mx":
        saturated, hist, nan_blocks = _mx_block_stats(x, info.name, info, axis % x.dim(),
                                                      scale_mode, all_finite)
        result.update(scale_exponent_hist=hist, nan_blocks=nan_blocks)
    elif info.kind == "hifp8":
        # Clamped to +-32768 (saturating cast) or sent to +-Inf (plain cast), on the grid's
        # side of the scale: |2**k q| >= 32768.
        limit = info.max_normal * 2.0 ** -(hifp8_k or 0)
        big = q.abs() >= limit
        saturated = torch.count_nonzero(big if all_finite else big & torch.isfinite(x))
        if hifp8_k is None:
            result["hifp8_regions"] = hifp8_regions(x, all_finite)
        else:
            grid = x.double() * 2.0 ** hifp8_k   # exact: float64 holds every scaled value
            result["hifp8_regions"] = hifp8_regions(grid, all_finite)
            result["hifp8_regions_unscaled"] = hifp8_regions(x, all_finite)
    elif info.kind in SCALED_KINDS:
        # Elements the element clamp changed, from the scales recomputed (never a NaN / Inf
        # element, nor one of a block or tensor whose output is all NaN).
        scaled = scale_stats(x, info.name, axis, options, all_finite=all_finite)
        saturated = scaled.saturated
        result.update(_scale_error_fields(scaled, info.kind))
    elif info.kind == "float":
        saturated = torch.count_nonzero(torch.isfinite(x) & (x.abs() > info.max_normal))
    else:
        saturated = torch.zeros((), dtype=torch.int64)
    scalars = _scalars(values + [saturated])
    if all_finite:
        err2, flushed, saturated = scalars
    else:
        err2, flushed, sig2, n_nonzero, saturated = scalars

    if count:
        result["mse"] = err2 / count
        if sig2 > 0:
            result["relative_error"] = math.sqrt(err2 / sig2)
            result["sqnr_db"] = math.inf if err2 == 0 else 10.0 * math.log10(sig2 / err2)
    result["flushed_fraction"] = _ratio(flushed, n_nonzero)
    result["saturated_fraction"] = _ratio(saturated, m.count)
    result["nonfinite_fraction"] = _ratio(n - n_finite_q, n)
    return result


# Cached constant tensors, by (value, device, size, dtype); callers never write to them.
CONSTANT_CACHE = {}


def constant(value, device, size=(), dtype=_F64) -> torch.Tensor:
    """A cached tensor full of value; callers never write to it."""
    key = (value, device, size, dtype)
    t = CONSTANT_CACHE.get(key)
    if t is None:
        if len(CONSTANT_CACHE) > 4096:
            CONSTANT_CACHE.clear()
        t = CONSTANT_CACHE[key] = torch.full(size if isinstance(size, tuple) else (size,), value,
                                         dtype=dtype, device=device)
    return t
