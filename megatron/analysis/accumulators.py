"""`Stats`: additive summary of one or many records (sums, counts and fixed-layout histograms).

Per-file work produces a `Stats` per record; merging is addition (max/min for extrema), so
workers can summarise any number of files and the totals do not depend on the order or on how
files were split among workers. `metrics()` turns the sums into the reported quantities.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np

from megatron.analysis.binning import bin_edges_log2
from megatron.analysis.hifp8 import REGIONS, region_counts_from_hist

SCALE_MIN, SCALE_MAX = -127, 127            # unbiased E8M0 exponents
N_SCALE = SCALE_MAX - SCALE_MIN + 1

# NVFP4 block scales: floor(log2 s) of the nonzero E4M3 scales spans 2^-9 (subnormal) .. 448.
E4M3_EXP_MIN, E4M3_EXP_MAX = -9, 8
N_E4M3_EXP = E4M3_EXP_MAX - E4M3_EXP_MIN + 1

_SUM_FIELDS = (  # merged by addition
    "records", "bytes", "from_tensors", "n", "nan", "inf", "zeros", "s1", "s2", "s4",
    "q_records", "q_n", "x2", "e2", "q_finite", "q_nonzero", "flushed", "saturated",
    "q_nonfinite", "blocks", "nan_blocks", "rec_sqnr_sum", "rec_sqnr_n", "hifp8_scaled",
    # NVFP4 blocks (defined scales) with an E4M3 scale of 0 / subnormal; FP8 and NVFP4
    # records with scales, and their blocks or tiles
    "nvfp4_blocks", "nvfp4_nan_blocks", "nvfp4_zero_blocks", "nvfp4_subnormal_blocks",
    "scaled_records", "scale_blocks",
)
_FLOAT_ARRAYS = ("regions", "grid_regions")     # counts reconstructed from manifest fractions
_ARRAY_FIELDS = ("hist", "q_hist", "scaled_hist", "scale_hist", "regions", "grid_hist",
                 "grid_regions", "cast_hist", "nvfp4_scale_hist")
# Extrema of NVFP4 / FP8 scales: per-tensor scales and nonzero block (tile) scales.
_MIN_FIELDS = ("tensor_scale_min", "block_scale_min")
_MAX_FIELDS = ("tensor_scale_max", "block_scale_max")


class Stats:
    """Additive statistics of a set of captured tensors (and of their quantized copies).

    x side: element counts, float64 sums of x, x^2, x^4 over finite x, extrema, |x| histogram.
    q side (quantized records only): over elements where x and q are both finite, sum x^2 and
    sum (q - x)^2; flushed (finite nonzero x -> 0), saturated, non-finite q; |q| histogram;
    MX: blocks, NaN blocks, shared-exponent histogram and the histogram of |x| / 2^scale.
    `regions`: HiFP8 region counts taken from manifest statistics (records without tensors);
    for records with tensors they are derived from `hist`. `grid_hist`: for HiF8 records, the
    |x| histogram of the values as the grid saw them (hp * 2^k for the `hifp8_scaled` records
    scaled per tensor, hp otherwise); `grid_regions`: the same from manifest statistics.
    `cast_hist` (records with tensors, every format): the |x| histogram as HiF8's grid would
    see it with a per-tensor scale (megatron.analysis.hifp8.add_cast_histogram).
    """

    __slots__ = _SUM_FIELDS + _ARRAY_FIELDS + _MIN_FIELDS + _MAX_FIELDS + (
        "absmax", "vmin", "vmax", "rec_sqnr_min")

    def __init__(self):
        for name in _SUM_FIELDS:
            setattr(self, name, 0)
        for name in _ARRAY_FIELDS:
            setattr(self, name, None)
        for name in _MIN_FIELDS:
            setattr(self, name, math.inf)
        for name in _MAX_FIELDS:
            setattr(self, name, -math.inf)
        self.absmax = 0.0
        self.vmin = math.inf
        self.vmax = -math.inf
        self.rec_sqnr_min = math.inf

    # -- merging --------------------------------------------------------------------------

    def merge(self, other: "Stats") -> "Stats":
        for name in _SUM_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in _ARRAY_FIELDS:
            theirs = getattr(other, name)
            if theirs is None:
                continue
            mine = getattr(self, name)
            setattr(self, name, theirs.copy() if mine is None else mine + theirs)
        for name in _MIN_FIELDS:
            setattr(self, name, min(getattr(self, name), getattr(other, name)))
        for name in _MAX_FIELDS:
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        self.absmax = max(self.absmax, other.absmax)
        self.vmin = min(self.vmin, other.vmin)
        self.vmax = max(self.vmax, other.vmax)
        self.rec_sqnr_min = min(self.rec_sqnr_min, other.rec_sqnr_min)
        return self

    def add_array(self, name: str, values: np.ndarray) -> None:
        mine = getattr(self, name)
        setattr(self, name, values.astype(np.float64 if name in _FLOAT_ARRAYS else np.int64)
                if mine is None else mine + values)

    # -- derived quantities ---------------------------------------------------------------

    def close_record(self) -> None:
        """Record this (single-record) Stats' own SQNR for the per-record mean and minimum."""
        value = sqnr_db(self.x2, self.e2) if self.quantized else None
        if value is not None and math.isfinite(value):
            self.rec_sqnr_sum += value
            self.rec_sqnr_n += 1
            self.rec_sqnr_min = min(self.rec_sqnr_min, value)

    @property
    def finite(self) -> int:
        return self.n - self.nan - self.inf

    @property
    def quantized(self) -> bool:
        return self.q_records > 0

    def region_counts(self) -> Optional[np.ndarray]:
        """HiFP8 region counts over finite nonzero x (histogram part + manifest part)."""
        return _sum_regions(self.hist, self.regions)

    def grid_region_counts(self) -> Optional[np.ndarray]:
        """The same for the values of HiF8 records as the grid saw them."""
        return _sum_regions(self.grid_hist, self.grid_regions)

    def metrics(self) -> Dict[str, object]:
        """The reported statistics of this set (see docs/analysis.md, "metrics block")."""
        finite = self.finite
        out: Dict[str, object] = {
            "records": int(self.records), "records_with_tensors": int(self.from_tensors),
            "bytes": int(self.bytes), "elements": int(self.n), "finite": int(finite),
            "nan": int(self.nan), "inf": int(self.inf),
            "zero_fraction": _ratio(self.zeros, self.n),
        }
        mean = self.s1 / finite if finite else None
        out["mean"] = mean
        if finite:
            m2 = self.s2 / finite
            var = max(m2 - mean * mean, 0.0)
            out["std"] = math.sqrt(var)
            out["rms"] = math.sqrt(m2)
            # Kurtosis about zero (E[x^4] / E[x^2]^2): 3 for a zero-mean Gaussian.
            out["kurtosis"] = (self.s4 / finite) / (m2 * m2) if m2 > 0 else None
        else:
            out.update(std=None, rms=None, kurtosis=None)
        out["absmax"] = float(self.absmax) if finite else None
        out["min"] = float(self.vmin) if finite else None
        out["max"] = float(self.vmax) if finite else None
        # Smallest nonzero magnitude to histogram resolution: its bin's lower edge.
        low = None
        if self.hist is not None and self.hist.any():
            low = float(2.0 ** bin_edges_log2()[int(np.flatnonzero(self.hist)[0])])
        out["min_abs_nonzero_bin_edge"] = low
        out["dynamic_range_binades"] = (
            math.log2(self.absmax) - math.log2(low) if low and self.absmax > 0 else None)
        out["hifp8_regions"] = _region_shares(self.region_counts())
        out["hifp8_grid_regions"] = _region_shares(self.grid_region_counts())
        out["hifp8_scaled_records"] = int(self.hifp8_scaled)
        out["hifp8_tensor_scaled_regions"] = _region_shares(_sum_regions(self.cast_hist, None))
        if not self.quantized:
            out["quantization"] = None
            return out
        out["quantization"] = self._quant_metrics()
        return out

    def _quant_metrics(self) -> Dict[str, object]:
        q: Dict[str, object] = {
            "records": int(self.q_records), "compared_elements": int(self.q_n),
            "mse": self.e2 / self.q_n if self.q_n else None,
            "sqnr_db": sqnr_db(self.x2, self.e2),
            "relative_error": math.sqrt(self.e2 / self.x2) if self.x2 > 0 else None,
            # Per-record SQNR (each record weighted equally; exact records left out).
            "mean_record_sqnr_db": (self.rec_sqnr_sum / self.rec_sqnr_n
                                    if self.rec_sqnr_n else None),
            "min_record_sqnr_db": (self.rec_sqnr_min if self.rec_sqnr_n else None),
            "flushed_fraction": _ratio(self.flushed, self.q_nonzero),
            "saturated_fraction": _ratio(self.saturated, self.q_finite),
            "nonfinite_fraction": _ratio(self.q_nonfinite, self.n),
        }
        if self.blocks or self.scale_hist is not None:
            q["blocks"] = int(self.blocks)
            q["nan_blocks"] = int(self.nan_blocks)
            q["scale_exponent"] = scale_summary(self.scale_hist)
        if self.scaled_records:
            q["scales"] = self._scales()
        if self.nvfp4_blocks or self.nvfp4_nan_blocks:
            q["nvfp4_block_scales"] = self._nvfp4_scales()
        return q

    def _scales(self) -> Dict[str, object]:
        """Ranges of the NVFP4 / FP8 scales: per-tensor scales (NVFP4 2688 / amax, FP8
        fp8_max / amax), nonzero block or tile scales."""
        def bound(value):
            return float(value) if math.isfinite(value) else None
        return {"records": int(self.scaled_records), "blocks": int(self.scale_blocks),
                "tensor_scale_min": bound(self.tensor_scale_min),
                "tensor_scale_max": bound(self.tensor_scale_max),
                "block_scale_min": bound(self.block_scale_min),
                "block_scale_max": bound(self.block_scale_max)}

    def _nvfp4_scales(self) -> Dict[str, object]:
        """NVFP4's E4M3 block scales: shares of zero (the block became 0) and subnormal
        (below 2^-6) scales over the blocks with a defined scale, and the exponent histogram
        of the nonzero ones."""
        hist = self.nvfp4_scale_hist
        exponents = None
        if hist is not None and hist.any():
            nz = np.flatnonzero(hist)
            exponents = {"min": E4M3_EXP_MIN + int(nz[0]),
                         "counts": [int(c) for c in hist[nz[0]:nz[-1] + 1]]}
        return {"blocks": int(self.nvfp4_blocks), "nan_blocks": int(self.nvfp4_nan_blocks),
                "zero_fraction": _ratio(self.nvfp4_zero_blocks, self.nvfp4_blocks),
                "subnormal_fraction": _ratio(self.nvfp4_subnormal_blocks, self.nvfp4_blocks),
                "normal_fraction": _ratio(self.nvfp4_blocks - self.nvfp4_zero_blocks
                                          - self.nvfp4_subnormal_blocks, self.nvfp4_blocks),
                "exponent_hist": exponents}


def sqnr_db(x2: float, e2: float):
    """10 log10(sum x^2 / sum (q-x)^2): inf when exact, None when x is all zero."""
    if x2 <= 0:
        return None
    if e2 <= 0:
        return math.inf
    return 10.0 * math.log10(x2 / e2)


def scale_summary(hist: Optional[np.ndarray]):
    """min / max / mean / std and the nonzero range of an E8M0 exponent histogram."""
    if hist is None or hist.sum() == 0:
        return None
    exps = np.arange(SCALE_MIN, SCALE_MAX + 1)
    nz = np.flatnonzero(hist)
    total = hist.sum()
    mean = float((hist * exps).sum() / total)
    std = float(math.sqrt(max((hist * (exps - mean) ** 2).sum() / total, 0.0)))
    lo, hi = int(exps[nz[0]]), int(exps[nz[-1]])
    return {"min": lo, "max": hi, "mean": mean, "std": std,
            "hist": {"min": lo, "counts": [int(c) for c in hist[nz[0]:nz[-1] + 1]]}}


def _sum_regions(hist: Optional[np.ndarray], counts: Optional[np.ndarray]):
    total = None if hist is None else region_counts_from_hist(hist).astype(np.float64)
    if counts is not None:
        total = counts.copy() if total is None else total + counts
    return total


def _region_shares(counts: Optional[np.ndarray]):
    if counts is None or counts.sum() <= 0:
        return None
    return {name: float(c / counts.sum()) for name, c in zip(REGIONS, counts)}


def _ratio(num, den):
    return float(num) / float(den) if den else None
