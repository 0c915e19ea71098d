"""HiFloat8 precision regions: where values fall on HiF8's tapered grid.

HiF8 (per element, no scaling) spends its mantissa bits unevenly across binades:

    |x| in [2^-3, 2^4)                        3-bit mantissa  ("mant3", |E| <= 3)
    [2^-7, 2^-3) and [2^4, 2^8)               2-bit mantissa  ("mant2", |E| 4..7)
    [2^-15, 2^-7) and [2^8, 1.25 * 2^15)      1-bit mantissa  ("mant1", |E| 8..15)
    [2^-23, 2^-15)                            denormal powers of two 2^-22..2^-16
                                              ([2^-23, 2^-22) rounds up to 2^-22)
    below 2^-23                               underflow (rounds to 0)
    1.25 * 2^15 = 40960 and above             overflow (rounds to Inf, or saturates)

Every boundary is a bin edge of the shared histogram layout, so region shares of any set of
records come straight from its |x| histogram: for HiFP8 captures they describe the actual
quantization, for other formats they answer "how would these values sit in HiF8, unscaled".

Records of HiF8 operands quantized with a per-tensor scale carry metadata
`hifp8_scaling: "tensor"` and `hifp8_scale_exponent` k: the grid rounded hp * 2^k
(`megatron.quantization.formats.hifp8_scaled_fake_quantize`). Multiplying by 2^k moves every
magnitude by exactly k binades, i.e. 4k histogram bins, so the histogram of the values the grid
saw is the record's histogram shifted (`grid_histogram`); its regions are reported beside the
regions of the unscaled values.

The run's HiF8 scaling (`--hifp8-scaling`, as the HiF8 records carry it) decides how every
HiF8 view of the report reads the values: HiF8 operands as the grid saw them, and the "if cast
to HiF8" views of other runs' tensors with the same rule (`cast_histogram`: a per-tensor
scale from each record's amax, exactly as training picks it) when the HiF8 runs scaled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron.analysis.binning import SUB, bin_index_of_value
from megatron.quantization.formats import HIFP8_DEFAULT_TARGET_EXPONENT

# HiFP8 precision regions, in the order of Stats.regions.
REGIONS = ("underflow", "denormal", "mant1", "mant2", "mant3", "overflow")

OVERFLOW = 1.25 * 2.0 ** 15
UNDERFLOW = 2.0 ** -23
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -127, 127

# The run's HiF8 scaling, per scheme with HiF8 operands (`scheme_scalings`).
UNSCALED, TENSOR, MIXED = "none", "tensor", "mixed"

# (label, lower bound, upper bound, mantissa bits or None) from small to large magnitude;
# the two sides of the tapered layout are kept apart for plots.
SIDED_REGIONS: List[Tuple[str, float, float, object]] = [
    ("underflow", 0.0, UNDERFLOW, None),
    ("denormal", UNDERFLOW, 2.0 ** -15, 0),
    ("mant1 (small)", 2.0 ** -15, 2.0 ** -7, 1),
    ("mant2 (small)", 2.0 ** -7, 2.0 ** -3, 2),
    ("mant3", 2.0 ** -3, 2.0 ** 4, 3),
    ("mant2 (large)", 2.0 ** 4, 2.0 ** 8, 2),
    ("mant1 (large)", 2.0 ** 8, OVERFLOW, 1),
    ("overflow", OVERFLOW, float("inf"), None),
]
# Sided region -> the six regions of the capture format's `hifp8_regions`.
_SIDED_TO_REGION = ["underflow", "denormal", "mant1", "mant2", "mant3", "mant2", "mant1",
                    "overflow"]


def sided_counts_from_hist(hist: np.ndarray) -> np.ndarray:
    """Counts of binned (finite nonzero) magnitudes in each of the 8 SIDED_REGIONS."""
    cuts = [0] + [bin_index_of_value(hi) for _, _, hi, _ in SIDED_REGIONS[:-1]] + [hist.size]
    return np.array([hist[a:b].sum() for a, b in zip(cuts[:-1], cuts[1:])], dtype=np.int64)


def region_counts_from_hist(hist: np.ndarray) -> np.ndarray:
    """Counts in the six capture-format regions (underflow, denormal, mant1..3, overflow)."""
    sided = sided_counts_from_hist(hist)
    out = np.zeros(len(REGIONS), dtype=np.int64)
    for count, name in zip(sided, _SIDED_TO_REGION):
        out[REGIONS.index(name)] += count
    return out


def regions_from_fractions(fractions: dict, nonzero: float) -> np.ndarray:
    """Region counts from a manifest's `hifp8_regions` fractions (records without tensors)."""
    return np.array([float(fractions.get(name) or 0.0) * nonzero for name in REGIONS])


def zones_log2():
    """(lo, hi, label, mantissa bits) of each sided region in log2|x| units, for plot bands."""
    out = []
    for label, lo, hi, bits in SIDED_REGIONS:
        lo2 = np.log2(lo) if lo > 0 else -np.inf
        hi2 = np.log2(hi) if np.isfinite(hi) else np.inf
        out.append((lo2, hi2, label, bits))
    return out


def hifp8_scale_exponent(metadata: dict) -> Optional[int]:
    """k of a record scaled per tensor before rounding to HiF8 (hp * 2^k), None if unscaled
    (records without the keys are unscaled)."""
    if metadata.get("hifp8_scaling") != "tensor":
        return None
    return int(metadata["hifp8_scale_exponent"])


def hifp8_seen_by_grid(fmt, k: Optional[int]):
    """The format limits in the record's own (unscaled) units: the grid saturates hp * 2^k at
    max_normal, i.e. hp at max_normal * 2^-k. Other formats are returned unchanged."""
    if not k or fmt.kind != "hifp8" or not fmt.max_normal:
        return fmt
    return dataclasses.replace(fmt, max_normal=float(fmt.max_normal) * 2.0 ** -k)


def grid_histogram(hist: np.ndarray, k: int) -> np.ndarray:
    """Histogram of |x| * 2^k from that of |x| (exact: a shift by 4k bins; magnitudes pushed
    past either end of the layout land in the end bins, as the layout does for all values)."""
    shift = SUB * int(k)
    out = np.zeros_like(hist)
    idx = np.clip(np.arange(hist.size) + shift, 0, hist.size - 1)
    np.add.at(out, idx, hist)
    return out


def add_grid_histogram(stats, fmt, k: Optional[int]) -> None:
    """For a HiF8 record: the histogram of the values as HiF8's grid saw them (`grid_hist`)
    and whether the record was scaled (`hifp8_scaled`)."""
    if fmt.kind != "hifp8" or stats.hist is None:
        return
    stats.add_array("grid_hist", stats.hist if k is None else grid_histogram(stats.hist, k))
    stats.hifp8_scaled += int(k is not None)


def tensor_scale_exponent(amax: float, finite: bool = True,
                          target_exponent: int = HIFP8_DEFAULT_TARGET_EXPONENT) -> int:
    """k that per-tensor HiF8 scaling picks for a tensor with this amax: amax * 2^k lands in
    [2^target, 2^(target + 1)), k clamped to [-127, 127]; 0 for an all-zero tensor or one
    holding NaN/Inf (`finite` False), which training quantizes unscaled."""
    if not finite or not math.isfinite(amax) or amax <= 0:
        return 0
    _, e = math.frexp(amax)                       # amax = m * 2^e, m in [0.5, 1)
    return int(min(max(target_exponent + 1 - e, MIN_SCALE_EXPONENT), MAX_SCALE_EXPONENT))


def add_cast_histogram(stats, fmt, k: Optional[int]) -> None:
    """`cast_hist`: the |x| histogram as HiF8's grid would see the record under per-tensor
    scaling: shifted by the record's own k for a HiF8 record scaled in training, else by the k
    the rule picks from its amax (`tensor_scale_exponent`)."""
    if stats.hist is None:
        return
    if fmt.kind != "hifp8" or k is None:
        k = tensor_scale_exponent(stats.absmax, finite=not (stats.nan or stats.inf))
    stats.add_array("cast_hist", grid_histogram(stats.hist, k))


def scheme_scalings(groups) -> Dict[str, str]:
    """The HiF8 scaling of each scheme with HiF8 operands, from its records: TENSOR when they
    were scaled per tensor, UNSCALED when none was, MIXED otherwise."""
    counts: Dict[str, List[int]] = {}
    for key, stats in groups.items():
        if key.format == "hifp8":
            scaled_total = counts.setdefault(key.quant_scheme, [0, 0])
            scaled_total[0] += int(stats.hifp8_scaled)
            scaled_total[1] += int(stats.records)
    return {scheme: TENSOR if scaled == total else UNSCALED if scaled == 0 else MIXED
            for scheme, (scaled, total) in sorted(counts.items())}


def cast_views(scalings: Dict[str, str]) -> List[str]:
    """How to show other runs' tensors "if cast to HiF8": with the scalings the HiF8 runs
    used (UNSCALED and/or TENSOR), unscaled when no run used HiF8."""
    used = set(scalings.values())
    views = []
    if not used or used & {UNSCALED, MIXED}:
        views.append(UNSCALED)
    if used & {TENSOR, MIXED}:
        views.append(TENSOR)
    return views


def run_scaled(scalings: Dict[str, str]) -> bool:
    """Whether any HiF8 run scaled its operands per tensor."""
    return bool(set(scalings.values()) & {TENSOR, MIXED})
