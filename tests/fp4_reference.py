"""Independent references for NVFP4, MXFP6 and stochastic rounding (test-only helper).

Nothing here imports the code under test. Element values are decoded from their bit layouts
(OCP FP4 E2M1, FP6 E2M3 / E3M2, FP8 E4M3 "fn"); rounding to nearest even is done on those
decoded grids ("nearest grid value, a tie goes to the even code"). NVFP4 follows section 6.1
of the number-formats design note step by step in numpy float32 arithmetic (every operation on
np.float32 operands rounds once to float32), with ml_dtypes' E4M3 cast after clamping at 448
(ml_dtypes does not saturate: it gives NaN from 464 up). MX follows the float64 / frexp style
of format_reference.py, generalised to any element grid.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# Decoders: the value of a code, from its bits
# ---------------------------------------------------------------------------------------------

def decode_minifloat(code: int, ebits: int, mbits: int, bias: int) -> float:
    """A sign-magnitude float with no Inf/NaN codes: S E..E M..M; exponent field 0 is
    subnormal (0.M * 2**(1 - bias))."""
    sign = -1.0 if (code >> (ebits + mbits)) & 1 else 1.0
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    if exp == 0:
        return sign * man / 2 ** mbits * 2.0 ** (1 - bias)
    return sign * (1 + man / 2 ** mbits) * 2.0 ** (exp - bias)


def decode_e2m1(code: int) -> float:
    """FP4 E2M1: S EE M, bias 1; values 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    return decode_minifloat(code, 2, 1, 1)


def decode_e2m3(code: int) -> float:
    """FP6 E2M3: S EE MMM, bias 1; max 1.875 * 2**2 = 7.5, subnormals k/8."""
    return decode_minifloat(code, 2, 3, 1)


def decode_e3m2(code: int) -> float:
    """FP6 E3M2: S EEE MM, bias 3; max 1.75 * 2**4 = 28, subnormals k/16."""
    return decode_minifloat(code, 3, 2, 3)


def decode_e4m3(code: int) -> float:
    """FP8 E4M3 "fn": S EEEE MMM, bias 7, S.1111.111 is NaN, no Inf."""
    if code & 0x7F == 0x7F:
        return math.nan
    return decode_minifloat(code, 4, 3, 7)


def decode_e5m2(code: int) -> float:
    """FP8 E5M2: S EEEEE MM, bias 15, exponent field 31 is Inf (M = 0) or NaN."""
    if (code >> 2) & 0x1F == 0x1F:
        return math.copysign(math.inf, -(code >> 7)) if code & 0x3 == 0 else math.nan
    return decode_minifloat(code, 5, 2, 15)


ELEMENTS = {
    # name: (decoder, number of codes, emax_elem, max_normal)
    "e2m1": (decode_e2m1, 16, 2, 6.0),
    "e2m3": (decode_e2m3, 64, 2, 7.5),
    "e3m2": (decode_e3m2, 64, 4, 28.0),
    "e4m3": (decode_e4m3, 256, 8, 448.0),
    "e5m2": (decode_e5m2, 256, 15, 57344.0),
}
ELEMENT_MANTISSA_BITS = {"e2m1": 1, "e2m3": 3, "e3m2": 2, "e4m3": 3, "e5m2": 2}
MX_ELEMENT = {"mxfp4": "e2m1", "mxfp6_e2m3": "e2m3", "mxfp6_e3m2": "e3m2",
              "mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2"}


def codes(elem: str):
    """[(code, value)] of every code of an element format."""
    decode, n = ELEMENTS[elem][:2]
    return [(c, decode(c)) for c in range(n)]


def positive_grid(elem: str):
    """(values, codes): the non-negative values in increasing order with their codes."""
    pairs = sorted((v, c) for c, v in codes(elem)
                   if math.isfinite(v) and (v > 0 or (v == 0 and c == 0)))
    return np.array([v for v, _ in pairs]), np.array([c for _, c in pairs])


# ---------------------------------------------------------------------------------------------
# Rounding on a decoded grid
# ---------------------------------------------------------------------------------------------

def grid_neighbours(mag: np.ndarray, elem: str):
    """(lo, hi, code of lo) around non-negative magnitudes <= the grid maximum (float64)."""
    values, cds = positive_grid(elem)
    mag = np.asarray(mag, dtype=np.float64)
    idx = np.clip(np.searchsorted(values, mag, side="left"), 1, len(values) - 1)
    return values[idx - 1], values[idx], cds[idx - 1]


def round_to_grid(v: np.ndarray, elem: str) -> np.ndarray:
    """Round to nearest on the element grid, ties to the even code; |v| saturates at the
    maximum; the sign is kept (including on zero). NaN stays NaN. float64 result."""
    v = np.asarray(v, dtype=np.float64)
    values = positive_grid(elem)[0]
    mag = np.minimum(np.abs(np.nan_to_num(v)), values[-1])
    lo, hi, code_lo = grid_neighbours(mag, elem)
    below, above = mag - lo, hi - mag
    q = np.where(below < above, lo, np.where(below > above, hi,
                                             np.where(code_lo % 2 == 0, lo, hi)))
    return np.where(np.isnan(v), np.nan, np.copysign(q, v))


# ---------------------------------------------------------------------------------------------
# NVFP4 (section 6.1), numpy float32
# ---------------------------------------------------------------------------------------------

def _pad_to(x: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, pad)
    return np.pad(x, width)


def e4m3_rne_saturating(s: np.ndarray) -> np.ndarray:
    """cvt.rn.satfinite.e4m3 of non-negative float32: clamp at 448, then ml_dtypes' RNE cast
    (which keeps subnormals but would give NaN from 464 up)."""
    return np.minimum(s, F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def nvfp4_reference(x, axis: int = -1, block_2d: bool = False, amax=None):
    """NVFP4 quantize-dequantize of float32 `x` exactly as section 6.1 (float32 steps).

    Returns a dict: y (float32, x's shape), s (E4M3 block scales as float32, blocks on the
    last axis, or [R/16, C/16] tiles), amax (float32), v (the clamped scaled values before
    element rounding, x's shape), dec (the step-7 factor per element, x's shape).
    """
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        finite = bool(np.isfinite(x).all())
        t_amax = F32(np.abs(x).max()) if amax is None else F32(amax)
        finite = finite and bool(np.isfinite(t_amax))
        # Steps 2-3.
        s_enc = F32(1.0) if t_amax == 0 else min(F32(2688) / t_amax, FLT_MAX)
        if s_enc == 0:
            s_enc = F32(1.0)
        s_dec = F32(1) / s_enc
        # Blocks as the last axis (1-D), or 16x16 tiles.
        if block_2d:
            p = _pad_to(_pad_to(x, 0, 16), 1, 16)
            r, c = p.shape[0] // 16, p.shape[1] // 16
            tiles = p.reshape(r, 16, c, 16).transpose(0, 2, 1, 3).reshape(r, c, 256)
            amax_b = np.abs(tiles).max(axis=-1)
        else:
            moved = np.moveaxis(x, axis, -1)
            p = _pad_to(moved, -1, 16)
            blocks = p.reshape(p.shape[:-1] + (p.shape[-1] // 16, 16))
            amax_b = np.abs(blocks).max(axis=-1)
        # Step 4: the float32 constant 1/6, E4M3 RNE with saturation and subnormals.
        S = amax_b.astype(np.float32) * (s_enc * (F32(1) / F32(6)))
        s = e4m3_rne_saturating(S)
        # Step 5.
        enc = np.minimum(F32(1) / (s * s_dec), FLT_MAX)
        dec = (s * t_amax) * (F32(1) / F32(2688))
        # Spread the per-block numbers back to element positions.
        if block_2d:
            enc_e = np.repeat(np.repeat(enc, 16, 0), 16, 1)[:x.shape[0], :x.shape[1]]
            dec_e = np.repeat(np.repeat(dec, 16, 0), 16, 1)[:x.shape[0], :x.shape[1]]
        else:
            n = moved.shape[-1]
            enc_e = np.moveaxis(np.repeat(enc, 16, -1)[..., :n], -1, axis)
            dec_e = np.moveaxis(np.repeat(dec, 16, -1)[..., :n], -1, axis)
        # Step 6: scale, clamp to +-6 BEFORE rounding, E2M1 RNE.
        v = np.clip(x * enc_e, F32(-6), F32(6)).astype(np.float32)
        q = round_to_grid(v, "e2m1").astype(np.float32)
        # Step 7.
        y = (q * dec_e).astype(np.float32)
    if not finite:
        y = np.full_like(y, np.nan)
        s = np.full_like(s, np.nan)
    return {"y": y, "s": s, "amax": t_amax, "v": v, "dec": dec_e.astype(np.float32), "q": q}


# ---------------------------------------------------------------------------------------------
# MX with any element grid (float64, exact exponents)
# ---------------------------------------------------------------------------------------------

def mx_exponents(x: np.ndarray, elem: str, scale_mode: str) -> np.ndarray:
    """Shared exponents of 32-blocks along the last axis (zero-padded), from frexp (exact):
    floor: floor(log2 amax) - emax; rceil: the smallest e with max_normal * 2**e >= amax;
    ceil: ceil(log2 amax) - emax; even: floor(log2 r) - emax with r = amax rounded half up
    to the element's mantissa bits. Clamped to [-127, 127]; -127 for amax 0; 128 for blocks
    holding NaN/Inf."""
    emax, max_normal = ELEMENTS[elem][2], ELEMENTS[elem][3]
    x = _pad_to(np.asarray(x, dtype=np.float64), -1, 32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    bad = ~np.isfinite(blocks).all(axis=-1)
    amax = np.where(bad, 1.0, np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=-1))
    mant, k = np.frexp(amax)                         # amax = mant * 2**k, mant in [0.5, 1)
    if scale_mode == "floor":
        e = k.astype(np.int64) - 1 - emax
    elif scale_mode == "ceil":
        e = k.astype(np.int64) - (mant == 0.5) - emax   # log2 amax is an integer iff mant = 1/2
    elif scale_mode == "even":
        ulp = np.ldexp(1.0, k - 1 - ELEMENT_MANTISSA_BITS[elem])
        _, k_rounded = np.frexp(np.floor(amax / ulp + 0.5) * ulp)
        e = k_rounded.astype(np.int64) - 1 - emax
    else:
        e = (k - math.frexp(max_normal)[1]).astype(np.int64)
        for _ in range(3):   # max_normal * 2**e is exact in float64: settle on the smallest fit
            e = np.where(np.ldexp(max_normal, e) < amax, e + 1, e)
            e = np.where(np.ldexp(max_normal, e - 1) >= amax, e - 1, e)
    e = np.where(amax == 0, -127, np.clip(e, -127, 127))
    return np.where(bad, 128, e)


def mx_reference(x: np.ndarray, elem: str, scale_mode: str = "floor"):
    """(MX quantize-dequantize along the last axis in float64, exponents, scaled values v
    clamped to +-max_normal)."""
    max_normal = ELEMENTS[elem][3]
    x = np.asarray(x, dtype=np.float64)
    e = mx_exponents(x, elem, scale_mode)
    e_full = np.repeat(e, 32, axis=-1)[..., :x.shape[-1]]
    scale = np.ldexp(1.0, np.where(e_full == 128, 0, e_full))
    with np.errstate(invalid="ignore"):
        v = np.clip(x / scale, -max_normal, max_normal)
    out = round_to_grid(v, elem) * scale
    return np.where(e_full == 128, np.nan, out), e, v
