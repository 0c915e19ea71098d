"""Fixed log2-magnitude histogram layout shared by every record, so per-file counts just add.

A value's bin is its binade E = floor(log2|x|) and the quarter of the binade its significand
falls in: bin (E, k) holds |x| in [2^E * (1 + k/4), 2^E * (1 + (k+1)/4)), k = 0..3. These are
exactly the top two significand bits of the float32 encoding, so binning is one shift of the
float bits and a bincount. The edges 1, 1.25, 1.5, 1.75 are also grid points of every element
format, so counts near format boundaries are not smeared across them.

Binades E_MIN..E_MAX are kept; values outside land in the first/last bin. Zeros and non-finite
values are counted separately, never binned. Tensors are binned as float32 (every captured
dtype except float64 converts exactly).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

E_MIN = -160          # below FP32's smallest subnormal (2^-149), room for MX-scaled values
E_MAX = 143
SUB = 4               # bins per binade
NBINS = (E_MAX - E_MIN + 1) * SUB
# For a normal float32, (abs bits >> 21) = biased_exponent * 4 + quarter; biased 127 is E = 0.
RAW_OFFSET = (-127 - E_MIN) * SUB
_EXP_ONE = 0x00800000     # smallest normal float32, as bits
_INF_BITS = 0x7F800000


@lru_cache(maxsize=1)
def bin_edges_log2() -> np.ndarray:
    """Left edges of every bin plus the final right edge, in log2 units (length NBINS + 1)."""
    exps = np.repeat(np.arange(E_MIN, E_MAX + 1, dtype=np.float64), SUB)
    quarters = np.tile(np.arange(SUB, dtype=np.float64), E_MAX - E_MIN + 1)
    left = exps + np.log2(1.0 + quarters / SUB)
    return np.append(left, E_MAX + 1.0)


def bin_index_of_value(value: float) -> int:
    """Bin of one positive finite magnitude (used for region boundaries and tests)."""
    mant, exp = np.frexp(np.float64(value))
    e = int(exp) - 1
    quarter = int((2.0 * float(mant) - 1.0) * SUB)
    return int(np.clip((e - E_MIN) * SUB + quarter, 0, NBINS - 1))


def abs_bits(x32: np.ndarray) -> np.ndarray:
    """float32 magnitudes as int32 bit patterns (order-preserving for non-negative floats)."""
    return (x32.view(np.int32) & np.int32(0x7FFFFFFF))


def subnormal_index(bits: np.ndarray) -> np.ndarray:
    """Exact bin index of float32 subnormal magnitudes (rare, so float64 frexp is fine)."""
    values = bits.view(np.float32).astype(np.float64)
    mant, exp = np.frexp(values)
    e = exp.astype(np.int64) - 1
    quarter = np.floor((2.0 * mant - 1.0) * SUB).astype(np.int64)
    return (e - E_MIN) * SUB + quarter


def _place_raw(counts: np.ndarray, raw: np.ndarray, shift: int = 0) -> None:
    """Add raw float32 bins 4..1019 (normal magnitudes) to `counts`, `shift` binades down."""
    lo = RAW_OFFSET - SUB * shift + SUB          # layout index of raw bin 4
    src = raw[SUB:1020]
    idx = np.arange(lo, lo + src.size)
    inside = (idx >= 0) & (idx < NBINS)
    if inside.all():
        counts[lo:lo + src.size] += src
        return
    counts[idx[inside]] += src[inside]
    counts[0] += src[idx < 0].sum()              # out-of-range values go to the end bins
    counts[NBINS - 1] += src[idx >= NBINS].sum()


def _raw_counts(bits: np.ndarray, offsets: np.ndarray | None = None, rows: int = 1):
    """bincount of (bits >> 21) [+ per-row offsets], as int64 without an intermediate copy."""
    raw = np.right_shift(bits, 21, dtype=np.int64)
    if offsets is not None:
        raw += offsets[:, None]
    return np.bincount(raw.ravel(), minlength=1024 * rows)


def _subnormal_counts(bits: np.ndarray, shift: np.ndarray | None = None) -> np.ndarray:
    mask = (bits != 0) & (bits < _EXP_ONE)
    idx = subnormal_index(bits[mask])
    if shift is not None:
        idx = idx - SUB * np.broadcast_to(shift[:, None], bits.shape)[mask]
    return np.bincount(np.clip(idx, 0, NBINS - 1), minlength=NBINS)


def histogram(bits: np.ndarray, zeros: int | None = None):
    """(counts[NBINS], zeros, nonfinite, has_subnormal) of magnitudes given as abs float32 bits.

    One shift and one bincount over the bits; float32 subnormals (raw bins 0..3, shared with
    zero) are re-binned exactly only when present.
    """
    raw = _raw_counts(bits)
    if zeros is None:
        zeros = int(bits.size - np.count_nonzero(bits))
    nonfinite = int(raw[1020:].sum())
    counts = np.zeros(NBINS, dtype=np.int64)
    _place_raw(counts, raw)
    has_subnormal = bool(raw[:SUB].sum() > zeros)
    if has_subnormal:
        counts += _subnormal_counts(bits)
    return counts, zeros, nonfinite, has_subnormal


class JointCounts:
    """|x| histogram (`plain`) and |x| / 2^shift histogram (`scaled`) from one bincount."""

    __slots__ = ("plain", "scaled")

    def __init__(self, plain: np.ndarray, scaled: np.ndarray):
        self.plain = plain
        self.scaled = scaled


def joint_histogram(bits2d: np.ndarray, shift: np.ndarray) -> JointCounts:
    """Histograms of finite blocks (rows of abs float32 bits) with per-row shifts (MX scales).

    Counts (shift row, raw bin) pairs with one bincount; summing the rows gives the plain
    histogram, placing each row at its shift gives the scaled one. Zeros are not counted.
    """
    plain = np.zeros(NBINS, dtype=np.int64)
    scaled = np.zeros(NBINS, dtype=np.int64)
    shift = shift.astype(np.int64)
    lo, hi = int(shift.min()), int(shift.max())
    nrows = hi - lo + 1
    raw = _raw_counts(bits2d, (shift - lo) * 1024, nrows).reshape(nrows, 1024)
    _place_raw(plain, raw.sum(axis=0))
    for r in np.flatnonzero(raw[:, SUB:1020].any(axis=1)):
        _place_raw(scaled, raw[r], lo + int(r))
    zeros = int(bits2d.size - np.count_nonzero(bits2d))
    if raw[:, :SUB].sum() > zeros:          # float32 subnormals present: bin them exactly
        plain += _subnormal_counts(bits2d)
        scaled += _subnormal_counts(bits2d, shift)
    return JointCounts(plain, scaled)
