"""Sufficient statistics of a GEMM operand on its device: the training-time telemetry's sums.

`operand_statistics` measures one operand (and its quantization) as a vector of sums
(SUM_FIELDS: counts, squared signal and error, HiFP8 region counts, NVFP4/FP8 block-scale
counts) and maxima (MAX_FIELDS), all float64 tensors on the operand's device, so the telemetry
(telemetry.py) accumulates them over micro-batches, chunks and ranks without a host
synchronisation; the record statistics of a capture (stats.py) compute the same quantities
from the same definitions for one tensor at a time.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple, Optional

import torch

from megatron.quantization.formats import HIFP8_OVERFLOW, format_info, mx_block_scales
from megatron.tensor_capture.stats import (
    CONSTANT_CACHE, HIFP8_REGIONS, SCALED_KINDS, block_view, constant, rows, scale_stats)

_F64 = torch.float64
_F32 = torch.float32


# Layout of the vector `operand_statistics` returns (summed over micro-batches, chunks and
# ranks), then of the maxima (reduced with max; the exponent minimum is stored negated).
# Scales (NVFP4, FP8): block counts are summed; the per-tensor and block scale ranges are
# maxima (minima stored negated), -inf where an operand has none.
SUM_FIELDS = ("count", "nonzero", "flushed", "saturated", "signal_sq", "error_sq",
              "nonfinite", *(f"hifp8_{name}" for name in HIFP8_REGIONS),
              "blocks", "zero_scale_blocks", "subnormal_scale_blocks")
MAX_FIELDS = ("amax", "neg_scale_exp_min", "scale_exp_max", "neg_tensor_scale_min",
              "tensor_scale_max", "neg_block_scale_min", "block_scale_max")
_NO_EXPONENT = -1e9
# What an operand without a value contributes to each maximum.
MAX_EMPTY = (_NO_EXPONENT, _NO_EXPONENT, _NO_EXPONENT) + (-math.inf,) * 4
# floor(log2 |x * 2**k|) of any float32/bf16 value times any scale 2**k, k in [-127, 127],
# lies in [-276, 255]: histogram bins [-288, 288).
_E_OFFSET, _E_BINS = 288, 576


def _region_matrix(device) -> torch.Tensor:
    """[bins, 6] 0/1: the HiFP8 region of each exponent bin (HIFP8_REGIONS order); e = 15
    counts as mant1 here, its overflowing part is moved by the caller."""
    matrix = torch.zeros(_E_BINS, len(HIFP8_REGIONS), dtype=_F64)
    for b in range(_E_BINS):
        e = b - _E_OFFSET
        region = ("underflow" if e <= -24 else "denormal" if e <= -16 else
                  "mant3" if abs(e) <= 3 else "mant2" if abs(e) <= 7 else
                  "mant1" if abs(e) <= 15 else "overflow")
        matrix[b, HIFP8_REGIONS.index(region)] = 1.0
    return matrix.to(device)


_REGION_MATRICES = {}


def _norm(t: torch.Tensor) -> torch.Tensor:
    """sqrt(sum(t**2)) as a float64 0-dim tensor, fast and accurate for a float32 (or
    float64) t with |t| <= 1 (the caller scales by a power of two below 1 / amax, so no
    square overflows): fused norms, in t's dtype, of rows of 8192, and the norm of those in
    float64 (relative error about 1e-8 in float32)."""
    body, tail = rows(t)
    norm = torch.linalg.vector_norm
    if not tail.numel():
        return norm(norm(body, dim=1), dtype=_F64)
    return norm(torch.cat([norm(body, dim=1), norm(tail).reshape(1)]), dtype=_F64)


# The integer view of each working float dtype and the mask that clears its sign bit.
_MAGNITUDE_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF),
                   torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
_SCRATCH = threading.local()


def _scratch(device: torch.device):
    """get(name, like, dtype): a buffer shaped like `like`, reused between calls on a CPU (one
    per name, dtype and thread, grown when too small; its views cached by shape); on an
    accelerator a fresh tensor, its caching allocator already reuses memory."""
    if device.type != "cpu":
        return lambda name, like, dtype: torch.empty(like.shape, dtype=dtype, device=device)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})

    def get(name, like, dtype):
        key = (name, dtype)
        flat, views = buffers.get(key, (None, None))
        if flat is None or flat.numel() < like.numel():
            flat, views = torch.empty(like.numel(), dtype=dtype), {}
            buffers[key] = (flat, views)
        view = views.get(like.shape)
        if view is None:
            view = views[like.shape] = flat[:like.numel()].view(like.shape)
        return view

    return get


def _scaled_bits(value: float, k: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The bits of value * 2**-k in like's dtype (float32 or float64; exact for HiFP8's
    thresholds), for comparing magnitudes as integers."""
    scaled = torch.ldexp(torch.tensor(value, dtype=like.dtype, device=like.device), -k)
    return scaled.view(_MAGNITUDE_BITS[like.dtype][0])


def _count_above(magnitude: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor):
    """count(magnitude > threshold) for sign-cleared float32/float64 bits (threshold
    broadcasts): minus the sum of the sign bits of threshold - magnitude (-1 where above),
    which cannot overflow as both are non-negative. On a CPU a subtraction, a shift and a sum
    in the bits' own integer type are several times faster than a comparison to bool."""
    sign = magnitude.element_size() * 8 - 1
    negative = torch.sub(threshold, magnitude, out=out).bitwise_right_shift_(sign)
    if negative.numel() >= 2 ** 31:         # the count might not fit the int32 sum
        return torch.count_nonzero(negative)
    return negative.sum(dtype=negative.dtype).neg_()


def _exponents(x_abs: torch.Tensor, x_bits: torch.Tensor, nonzero: torch.Tensor, scratch):
    """(frexp's exponent of every |x| as int32, the exponent its zeros get). A CPU reads it
    from the float32 bits, the exponent field minus 126, when no value is subnormal (checked
    at no cost there: no device to wait for); elsewhere, or with subnormals, torch.frexp,
    which is several times slower on a CPU."""
    exponent = scratch("exponent", x_abs, torch.int32)
    if x_abs.dtype == _F32 and x_abs.device.type == "cpu":
        largest_subnormal = constant(0x7FFFFF, x_abs.device, dtype=torch.int32)
        normal_or_more = _count_above(x_bits, largest_subnormal, scratch("count", x_bits,
                                                                         torch.int32))
        if int(nonzero - normal_or_more) == 0:
            torch.bitwise_right_shift(x_bits, 23, out=exponent).sub_(126)
            return exponent, -126          # a zero's field is 0
    torch.frexp(x_abs, out=(scratch("mantissa", x_abs, x_abs.dtype), exponent))
    return exponent, 0


def _max_empty(device) -> torch.Tensor:
    """MAX_EMPTY as a cached float64 tensor on `device` (callers never write to it)."""
    key = ("max_empty", device)
    t = CONSTANT_CACHE.get(key)
    if t is None:
        t = CONSTANT_CACHE[key] = torch.tensor(MAX_EMPTY, dtype=_F64, device=device)
    return t


class XSide(NamedTuple):
    """What operand_statistics learns from x alone (0-dim device tensors): reusable when the
    same data is another GEMM's operand (the weight in fprop and dgrad, x in fprop and wgrad,
    dY in dgrad and wgrad)."""

    amax: torch.Tensor             # float32 (float64 for a float64 x), like the two below
    inverse: torch.Tensor          # 2**-e with amax in [2**(e-1), 2**e)
    scale: torch.Tensor            # 2**e, float64
    scaled_norm: torch.Tensor      # sqrt(sum((x * inverse)**2)), float64
    nonzero: torch.Tensor


@torch.no_grad()
def operand_statistics(x: torch.Tensor, q: Optional[torch.Tensor], fmt: str = "none",
                       axis: Optional[int] = None, scale_mode: str = "floor",
                       hifp8_scale_exponent=None, x_side: Optional[XSide] = None, *,
                       options: Optional[dict] = None):
    """(sums, maxima, x_side): float64 vectors laid out as SUM_FIELDS and MAX_FIELDS, on x's device,
    with no host synchronisation, so a training step can afford them and a whole logging
    iteration reduces in one transfer. They add up exactly over pieces of a tensor
    (micro-batches, chunks, ranks) and give quant_error's statistics:

        saturated_fraction = saturated / count      flushed_fraction = flushed / nonzero
        sqnr_db = 10 log10(signal_sq / error_sq)     relative_error = sqrt(error_sq / signal_sq)
        hifp8 region shares = hifp8_<region> / (their sum)

        NVFP4 block scales: zero / subnormal shares = zero_scale_blocks /
        subnormal_scale_blocks over blocks; tensor and block scale ranges in the maxima

    with the same definitions for tensors whose x and q are finite (MX saturation |x| >
    max_normal * 2**e; HiFP8 saturation and regions on the grid's side of a per-tensor scale
    2**k given as `hifp8_scale_exponent`, a 0-dim tensor or int; NVFP4 and FP8 saturation
    and scales from their format `options`, gemm.format_options, whose `amax` may be an
    imposed 0-dim tensor). They are computed for that
    common case only, in few passes; `nonfinite` is 1 when x or q holds NaN/Inf, and the
    other fields of such a piece are then meaningless (its amax is NaN or Inf). With q None
    (an operand kept in high precision) only count, nonfinite and amax are filled.
    `x_side` (returned for quantized operands) skips the passes over x alone when the same
    data is measured again.
    """
    n = x.numel()
    device = x.device
    no_exponent = constant(_NO_EXPONENT, device)
    if n == 0:
        return (torch.zeros(len(SUM_FIELDS), dtype=_F64, device=device),
                _max_empty(device).clone(), None)
    if q is None:
        # max(|min|, |max|): one pass in x's own dtype, no copy; NaN and Inf propagate.
        lo, hi = torch.aminmax(x)
        amax = torch.maximum(hi, -lo).to(_F64)
        sums = torch.zeros(len(SUM_FIELDS), dtype=_F64, device=device)
        sums[0], sums[6] = n, (~torch.isfinite(amax)).to(_F64)
        return sums, torch.cat([amax.reshape(1), _max_empty(device)[1:]]), None
    scratch = _scratch(device)
    info = format_info(fmt)
    # |x| and |q| as float32 (float64 for a float64 x): exact copies, in buffers reused
    # between calls on a CPU (a fresh one costs a page fault per 4 KiB). q is 0 or has x's
    # sign, so (q - x)**2 = (|q| - |x|)**2. For non-negative floats the bit patterns order
    # like the values (NaN above Inf), so counts and thresholds work on the bits.
    work = _F64 if x.dtype == _F64 else _F32
    int_work, sign_clear = _MAGNITUDE_BITS[work]
    x_abs = scratch("x_work", x, work).copy_(x).abs_()
    q_abs = scratch("q_work", x, work).copy_(q).abs_()
    x_bits, q_bits = x_abs.view(int_work), q_abs.view(int_work)
    known = x_side is not None
    if known:
        amax, down, nonzero = x_side.amax, x_side.inverse, x_side.nonzero
    else:
        amax = x_abs.amax()                          # NaN propagates, so does Inf
        # 2**-e with amax = m * 2**e, m in [0.5, 1): scaled values stay exact and no square
        # overflows.
        _, e = torch.frexp(amax)
        down = torch.ldexp(torch.ones((), dtype=work, device=device), -e.clamp(-126, 126))
        nonzero = torch.count_nonzero(x_bits)
    counts = [nonzero, nonzero - torch.count_nonzero(q_bits)]        # x == 0 gives q == 0
    exp_min = exp_max = no_exponent
    regions = constant(0.0, device, len(HIFP8_REGIONS))      # read only
    block_counts = constant(0.0, device, 3)                   # read only
    scale_range = constant(-math.inf, device, 4)              # read only
    if info.kind == "mx":
        dim = axis % x.dim()
        blocks = block_view(x_abs, dim, info.block_size)
        exps, up = mx_block_scales(blocks.amax(dim + 1, keepdim=True), fmt, scale_mode)
        # max_normal * 2**e is exact (or Inf); NaN blocks' limits are meaningless
        limit = up.mul_(info.max_normal).view(int_work).bitwise_and_(sign_clear)
        bits = blocks.view(int_work)
        counts.append(_count_above(bits, limit, scratch("count", bits, int_work)))
        exp_min, exp_max = -exps.amin(), exps.amax()
    elif info.kind == "hifp8":
        k = torch.as_tensor(0 if hifp8_scale_exponent is None else hifp8_scale_exponent,
                            device=device).to(torch.int32)
        # Thresholds on the caller's side of the scale, value * 2**-k, exact; a >= t is
        # a > t - 1 on the bits (both thresholds are positive normals).
        counts.append(_count_above(q_bits, _scaled_bits(info.max_normal, k, x_abs) - 1,
                                   scratch("count", x_bits, int_work)))
        overflow = _count_above(x_bits, _scaled_bits(HIFP8_OVERFLOW, k, x_abs) - 1,
                                scratch("count", x_bits, int_work))
        exponent, zero_exponent = _exponents(x_abs, x_bits, nonzero, scratch)
        bins = exponent.add_(k - 1 + _E_OFFSET).clamp_(0, _E_BINS - 1)
        hist = torch.bincount(bins.reshape(-1), minlength=_E_BINS).to(_F64)
        # remove the zeros from the bin their exponent put them in
        zero_bin = (k - 1 + _E_OFFSET + zero_exponent).clamp(0, _E_BINS - 1).reshape(1).long()
        hist.index_add_(0, zero_bin, (nonzero - n).to(_F64).reshape(1))
        matrix = _REGION_MATRICES.get(device)
        if matrix is None:
            matrix = _REGION_MATRICES[device] = _region_matrix(device)
        regions = hist @ matrix
        mant1, over = HIFP8_REGIONS.index("mant1"), HIFP8_REGIONS.index("overflow")
        regions[mant1] -= overflow - regions[over]   # e = 15 at or above 40960 overflows
        regions[over] = overflow.to(_F64)
    elif info.kind in SCALED_KINDS:
        scaled = scale_stats(x, info.name, axis, options, all_finite=True)
        counts.append(scaled.saturated)
        block_counts = torch.stack([scaled.blocks, scaled.zero_blocks,
                                    scaled.subnormal_blocks]).to(_F64)
        scale_range = torch.stack([-scaled.block_min, scaled.block_max])
        if scaled.tensor_scale is not None:
            tensor_scale = scaled.tensor_scale.to(_F64)
            scale_range = torch.cat([torch.stack([-tensor_scale, tensor_scale]), scale_range])
        else:
            scale_range = torch.cat([constant(-math.inf, device, 2), scale_range])
    elif info.kind == "float":
        limit = torch.tensor(info.max_normal, dtype=work, device=device).view(int_work)
        counts.append(_count_above(x_bits, limit, scratch("count", x_bits, int_work)))
    else:
        counts.append(torch.zeros((), dtype=torch.int64, device=device))
    # |q| - |x| is exact (Sterbenz: q is 0 or within a factor 2 of x), except for HiFP8
    # saturating far above its maximum, where its rounding does not matter to the sums.
    # Last, as it overwrites the buffers.
    error = _norm(q_abs.sub_(x_abs).mul_(down))
    if not known:
        x_side = XSide(amax, down, torch.reciprocal(down.to(_F64)), _norm(x_abs.mul_(down)),
                       nonzero)
    signal_error = torch.stack([x_side.scaled_norm, error]).mul_(x_side.scale).square_()
    counts.insert(0, constant(n, device, dtype=torch.int64))
    nonfinite = signal_error.sum(0, keepdim=True).isfinite().logical_not_()
    # cat and stack promote their inputs: float64 results in few operations
    sums = torch.cat([torch.stack(counts), signal_error, nonfinite, regions, block_counts])
    maxima = torch.cat([torch.stack([amax, exp_min, exp_max]).to(_F64), scale_range])
    return sums, maxima, x_side
