"""Independent numpy reference for the FP8 recipes of the number-formats design note, section 7
(test-only helper; nothing here imports the code under test).

Written step by step from the note in numpy float32 scalars and arrays (numpy float32
arithmetic is IEEE: each operation rounds once, to nearest even). The E4M3 / E5M2 element
values are decoded from their bit layouts (format_reference.decode_e4m3 / decode_e5m2) and
rounding picks the nearer grid neighbour, a tie going to the neighbour whose code is even.
Tiles are walked with explicit index arithmetic, not reshapes shared with the implementation.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

import format_reference as ref

FLT_MAX = np.float32(np.finfo(np.float32).max)
BF16_MAX = np.float32(float(ml_dtypes.finfo(ml_dtypes.bfloat16).max))   # 0x7F7F0000
FP16_MAX = np.float32(65504.0)

FP8 = {  # name: (bit decoder, max normal, ml_dtypes dtype)
    "fp8_e4m3": (ref.decode_e4m3, 448.0, ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": (ref.decode_e5m2, 57344.0, ml_dtypes.float8_e5m2),
}
OUT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
              "float64": np.float64}
BLOCK_VALUE_FOR_INF = {"float32": FLT_MAX, "bfloat16": BF16_MAX, "float16": FP16_MAX,
                       "float64": FLT_MAX}


def positive_grid(fmt: str):
    """(sorted non-negative finite values, their codes) of an FP8 format, from the bits."""
    decode = FP8[fmt][0]
    pairs = sorted((decode(c), c) for c in range(128) if math.isfinite(decode(c)))
    return np.array([v for v, _ in pairs]), np.array([c for _, c in pairs])


def round_to_fp8(v: np.ndarray, fmt: str) -> np.ndarray:
    """RNE of float32/float64 values onto the FP8 grid (float64 out): saturate to +-max first
    (+-Inf too), nearest grid value, a tie going to the even code; sign kept (-0 for small
    negatives); NaN stays NaN."""
    values, codes = positive_grid(fmt)
    v = np.asarray(v, dtype=np.float64)
    mag = np.minimum(np.abs(v), values[-1])
    idx = np.clip(np.searchsorted(values, mag, side="left"), 1, len(values) - 1)
    lo, hi = values[idx - 1], values[idx]
    below, above = mag - lo, hi - mag
    pick_hi = (above < below) | ((above == below) & (codes[idx] % 2 == 0))
    q = np.where(pick_hi, hi, lo)
    q = np.where(np.isnan(v), np.nan, q)
    return np.where(np.signbit(v), -q, q)


def scaled_max(fmt: str, margin: float) -> np.float32:
    """f32(fp8_max * f32(2**-margin)) (TE: fp8_max * pow(2, -margin) in float32)."""
    with np.errstate(over="ignore"):
        return np.float32(FP8[fmt][1]) * np.float32(2.0 ** -margin)


def scale_rule(amax, fmt: str, margin: float, pow2: bool, value_for_inf) -> np.ndarray:
    """Section 7.1 steps 1-4 on float32 amax values: 1.0 for amax 0 / <0 / Inf / NaN, else
    f32(scaled_max / amax), +Inf -> value_for_inf, pow2 keeps bits & 0xFF800000."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = scaled_max(fmt, margin) / amax
    s = np.where(np.isposinf(s), np.float32(value_for_inf), s).astype(np.float32)
    s = np.where((amax > 0) & np.isfinite(amax), s, np.float32(1.0)).astype(np.float32)
    if pow2:
        s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return s


def _qdq(x, scale, fmt: str, dtype: str) -> np.ndarray:
    """Section 7.1 steps 5-6 elementwise with broadcast float32 scales: float32 (float64 for a
    float64 input) values of y = f32(q * f32(1 / scale)), q = fp8(f32(x * scale))."""
    scale = np.asarray(scale, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale_inv = np.float32(1.0) / scale
        if dtype == "float64":
            v = np.asarray(x, np.float64) * scale.astype(np.float64)
            return round_to_fp8(v, fmt) * scale_inv.astype(np.float64)
        v = np.asarray(x, np.float32) * scale
        return round_to_fp8(v, fmt).astype(np.float32) * scale_inv


def _amax(values) -> np.float32:
    """float32 max |x| (NaN if any NaN, Inf if any Inf); float64 rounded to float32, a finite
    value above FLT_MAX counting as FLT_MAX."""
    values = np.asarray(values)
    if values.size == 0:
        return np.float32(0)
    if np.isnan(values).any():
        return np.float32(np.nan)
    top = np.abs(values).max()
    if values.dtype == np.float64 and np.isfinite(top):
        top = min(top, float(FLT_MAX))
    return np.float32(top)


def _finish(y, dtype: str) -> np.ndarray:
    return np.asarray(y).astype(OUT_DTYPES[dtype]).astype(np.float64)


def tensor_reference(x, fmt: str, margin=0, pow2=False, amax=None, dtype="float32"):
    """(y as float64 values of the output dtype, scale) for per-tensor scaling: current
    (amax None: NaN/Inf anywhere -> all NaN) or delayed (amax given: NaN only at non-finite
    elements). x: the input's exact values (float32 or float64 array)."""
    x = np.asarray(x)
    if amax is None:
        a = _amax(x)
        scale = scale_rule(a, fmt, margin, pow2, FLT_MAX)
        y = _qdq(x, scale, fmt, dtype)
        if not np.isfinite(a):
            y = np.full_like(y, np.nan)
    else:
        scale = scale_rule(np.float32(amax), fmt, margin, pow2, FLT_MAX)
        y = _qdq(x, scale, fmt, dtype)
        y = np.where(np.isfinite(x), y, np.nan)
    return _finish(y, dtype), scale


def row_block_reference(x, fmt: str, axis=-1, margin=0, pow2=False, dtype="float32"):
    """(y, scales) for 1x128 blocks along `axis`: block j covers indices [128 j, 128 j + 128)
    of that axis (the last one shorter); a block with NaN/Inf is all NaN."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    n = x.shape[-1]
    nb = -(-n // 128)
    y = np.empty(x.shape, dtype=np.float64)
    scales = np.empty(x.shape[:-1] + (nb,), dtype=np.float32)
    vfi = BLOCK_VALUE_FOR_INF[dtype]
    for j in range(nb):
        cols = slice(128 * j, min(128 * j + 128, n))
        part = x[..., cols]
        amax = np.abs(part).max(axis=-1, keepdims=True)     # NaN if a NaN, Inf if an Inf
        bad = ~np.isfinite(amax)
        if dtype == "float64":
            amax = np.where(bad, amax, np.minimum(amax, float(FLT_MAX)))
        s = scale_rule(amax.astype(np.float32), fmt, margin, pow2, vfi)
        scales[..., j] = s[..., 0]
        y[..., cols] = np.where(bad, np.nan, _qdq(part, s, fmt, dtype))
    return np.moveaxis(_finish(y, dtype), -1, axis), np.moveaxis(scales, -1, axis)


def square_block_reference(x, fmt: str, margin=0, pow2=False, dtype="float32"):
    """(y, scales) for 128x128 tiles of a 2-D x: tile (i, j) covers rows [128 i, 128 i + 128)
    and columns [128 j, 128 j + 128), cut at the edges; a tile with NaN/Inf is all NaN."""
    x = np.asarray(x)
    rows, cols = x.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    y = np.empty(x.shape, dtype=np.float64)
    scales = np.empty((nr, nc), dtype=np.float32)
    vfi = BLOCK_VALUE_FOR_INF[dtype]
    for i in range(nr):
        for j in range(nc):
            tile = (slice(128 * i, min(128 * i + 128, rows)),
                    slice(128 * j, min(128 * j + 128, cols)))
            part = x[tile]
            a = _amax(part)
            s = scale_rule(a, fmt, margin, pow2, vfi)
            scales[i, j] = s
            y[tile] = _qdq(part, s, fmt, dtype) if np.isfinite(a) else np.nan
    return _finish(y, dtype), scales


def elements_via_ml_dtypes(v, fmt: str) -> np.ndarray:
    """The same element rounding through ml_dtypes, after the explicit clamp that ml_dtypes
    lacks (it sends E4M3 >= 464+ to NaN and E5M2 >= 61440 to Inf: P7, P8)."""
    fmt_max, ml_dtype = FP8[fmt][1], FP8[fmt][2]
    v = np.clip(np.asarray(v, dtype=np.float32), -fmt_max, fmt_max)
    return v.astype(ml_dtype).astype(np.float64)
