"""Independent test references for the number formats (test-only helper).

Nothing here imports the code under test. Element code points are decoded from their bit
layouts (OCP FP8/FP4 tables and the HiF8 Dot-prefix layout of the number-formats design
note) with Python floats, and the MX / HiF8 references are written in float64 numpy with
math.frexp-style exact exponents and ml_dtypes element casts.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

NAN = float("nan")
INF = float("inf")

MX_FORMATS = {
    # name: (decoder, number of codes, emax_elem, max_normal, ml_dtypes dtype)
    "mxfp8_e4m3": ("e4m3", 256, 8, 448.0, ml_dtypes.float8_e4m3fn),
    "mxfp8_e5m2": ("e5m2", 256, 15, 57344.0, ml_dtypes.float8_e5m2),
    "mxfp4": ("e2m1", 16, 2, 6.0, ml_dtypes.float4_e2m1fn),
}
MX_MANTISSA_BITS = {"mxfp8_e4m3": 3, "mxfp8_e5m2": 2, "mxfp4": 1}


# ---------------------------------------------------------------------------------------------
# Decoders (value of a code, from its bits)
# ---------------------------------------------------------------------------------------------

def decode_e4m3(code: int) -> float:
    """FP8 E4M3 "fn": S EEEE MMM, bias 7, no Inf, S.1111.111 = NaN, subnormals m/8 * 2**-6."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return NAN
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def decode_e5m2(code: int) -> float:
    """FP8 E5M2: S EEEEE MM, bias 15, IEEE-like Inf/NaN, subnormals m/4 * 2**-14."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 2) & 0x1F, code & 0x3
    if exp == 0x1F:
        return sign * INF if man == 0 else NAN
    if exp == 0:
        return sign * man / 4 * 2.0 ** -14
    return sign * (1 + man / 4) * 2.0 ** (exp - 15)


def decode_e2m1(code: int) -> float:
    """FP4 E2M1: S EE M, bias 1, no Inf/NaN, the only subnormal is 0.5."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    if exp == 0:
        return sign * man * 0.5
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def decode_hif8(code: int) -> float:
    """HiF8 byte S b6..b0 with the prefix-coded Dot field (design note section 2.1)."""
    sign = -1.0 if code & 0x80 else 1.0
    b = code & 0x7F
    if b >> 5 == 0b11:                      # D = 4: |E| = 8 + b3b2b1, 1 mantissa bit
        exp_sign, mag, man, mbits = (b >> 4) & 1, 8 + ((b >> 1) & 0x7), b & 0x1, 1
    elif b >> 5 == 0b10:                    # D = 3: |E| = 4 + b3b2, 2 mantissa bits
        exp_sign, mag, man, mbits = (b >> 4) & 1, 4 + ((b >> 2) & 0x3), b & 0x3, 2
    elif b >> 5 == 0b01:                    # D = 2: |E| = 2 + b3, 3 mantissa bits
        exp_sign, mag, man, mbits = (b >> 4) & 1, 2 + ((b >> 3) & 0x1), b & 0x7, 3
    elif b >> 4 == 0b001:                   # D = 1: |E| = 1, sign in b3
        exp_sign, mag, man, mbits = (b >> 3) & 1, 1, b & 0x7, 3
    elif b >> 3 == 0b0001:                  # D = 0: E = 0
        exp_sign, mag, man, mbits = 0, 0, b & 0x7, 3
    else:                                   # denormal: 2**(M - 23), M = b2b1b0
        m = b & 0x7
        if m == 0:
            return NAN if sign < 0 else 0.0  # 0x80 is NaN: HiF8 has no -0
        return sign * 2.0 ** (m - 23)
    exponent = -mag if exp_sign else mag
    if mag == 15 and exp_sign == 0 and man == 1:
        return sign * INF                   # 0x6F / 0xEF: the slot of 1.5 * 2**15
    return sign * (1 + man / 2 ** mbits) * 2.0 ** exponent


DECODERS = {"e4m3": decode_e4m3, "e5m2": decode_e5m2, "e2m1": decode_e2m1}


def mx_element_codes(fmt: str):
    """[(code, value)] for every finite code of an MX element format."""
    name, ncodes = MX_FORMATS[fmt][:2]
    decode = DECODERS[name]
    return [(c, decode(c)) for c in range(ncodes) if math.isfinite(decode(c))]


def mx_positive_grid(fmt: str):
    """Sorted [(value, code)] of the non-negative finite values (code of +0 for zero)."""
    return sorted((v, c) for c, v in mx_element_codes(fmt) if v > 0 or (v == 0 and c == 0))


def hif8_values():
    """All 256 decoded HiF8 values."""
    return [decode_hif8(c) for c in range(256)]


def hif8_positive_grid():
    """Sorted non-negative finite HiF8 values."""
    return sorted({v for v in hif8_values() if math.isfinite(v) and v >= 0})


# ---------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------

def _ceil_log2_ratio(amax: np.ndarray, max_normal: float) -> np.ndarray:
    """Exact ceil(log2(amax / max_normal)): the smallest e with max_normal * 2**e >= amax."""
    _, k = np.frexp(amax)
    _, kn = math.frexp(max_normal)
    e = (k - kn).astype(np.int64)
    # max_normal * 2**e is exact in float64; nudge the guess until it is the smallest fit.
    for _ in range(3):
        e = np.where(np.ldexp(max_normal, e) < amax, e + 1, e)
        e = np.where(np.ldexp(max_normal, e - 1) >= amax, e - 1, e)
    return e


def mx_reference_exponents(x: np.ndarray, fmt: str, scale_mode: str = "floor") -> np.ndarray:
    """Shared exponents of blocks of 32 along the last axis (zero-padded); 128 for NaN/Inf."""
    emax, max_normal = MX_FORMATS[fmt][2], MX_FORMATS[fmt][3]
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    nb = -(-n // 32)
    padded = np.zeros(x.shape[:-1] + (nb * 32,))
    padded[..., :n] = x
    blocks = padded.reshape(x.shape[:-1] + (nb, 32))
    bad = ~np.isfinite(blocks).all(axis=-1)
    amax = np.where(bad, 1.0, np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=-1))
    mant, k = np.frexp(amax)                         # amax = mant * 2**k, mant in [0.5, 1)
    if scale_mode == "floor":
        e = k.astype(np.int64) - 1 - emax
    elif scale_mode == "ceil":                       # ceil(log2 amax) - emax
        e = k.astype(np.int64) - (mant == 0.5) - emax
    elif scale_mode == "even":                       # floor of amax rounded half up to mbits
        ulp = np.ldexp(1.0, k - 1 - MX_MANTISSA_BITS[fmt])
        _, k_rounded = np.frexp(np.floor(amax / ulp + 0.5) * ulp)
        e = k_rounded.astype(np.int64) - 1 - emax
    else:
        e = _ceil_log2_ratio(amax, max_normal)
    e = np.clip(e, -127, 127)
    e = np.where(amax == 0, -127, e)
    return np.where(bad, 128, e)


def mx_reference(x: np.ndarray, fmt: str, scale_mode: str = "floor") -> np.ndarray:
    """MX quantize-dequantize along the last axis in float64 (elements through ml_dtypes)."""
    max_normal, ml_dtype = MX_FORMATS[fmt][3], MX_FORMATS[fmt][4]
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    e = mx_reference_exponents(x, fmt, scale_mode)
    e_full = np.repeat(e, 32, axis=-1)[..., :n]
    scale = np.ldexp(1.0, np.where(e_full == 128, 0, e_full))
    scaled = np.clip(x / scale, -max_normal, max_normal)       # saturate, then cast in range
    with np.errstate(invalid="ignore"):
        elems = scaled.astype(np.float32).astype(ml_dtype).astype(np.float64)
    out = elems * scale
    return np.where(e_full == 128, np.nan, out)


def hif8_reference(x: np.ndarray, saturate: bool = False) -> np.ndarray:
    """HiF8 rounding on the decoded grid: nearest, ties away from zero, |x| >= 40960 -> Inf."""
    x = np.asarray(x, dtype=np.float64)
    grid = np.array(hif8_positive_grid() + [49152.0])      # 49152: the slot of the Inf code
    mag = np.abs(x)
    with np.errstate(invalid="ignore"):
        idx = np.clip(np.searchsorted(grid, mag, side="left"), 1, len(grid) - 1)
        lo, hi = grid[idx - 1], grid[idx]
        q = np.where(mag - lo < hi - mag, lo, hi)             # a tie goes up: away from zero
        q = np.where(mag >= grid[-1], grid[-1], q)
        q = np.where(q == 49152.0, 32768.0 if saturate else np.inf, q)
        q = np.where(np.isnan(x), np.nan, q)
    return np.where(x < 0, -q, q) + 0.0                       # no -0 in HiF8


def exact_f32(values) -> np.ndarray:
    """float32 array of values that must be exactly representable."""
    arr = np.asarray(values, dtype=np.float64)
    out = arr.astype(np.float32)
    finite = np.isfinite(arr)
    assert np.array_equal(out[finite].astype(np.float64), arr[finite]), "value not float32"
    return out
