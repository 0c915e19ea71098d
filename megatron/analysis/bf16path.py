"""Fast path for bf16 records without MX blocks (unquantized tensors and HiFP8 operands).

A bf16 tensor holds at most 65536 distinct values, so one bincount of its 16-bit patterns is
an exact multiset of its values: element counts, zeros, NaN/Inf, the float64 sums of x, x^2,
x^4, the extrema and the |x| histogram all follow from 65536 counts instead of a dozen passes
over the data. Only the quantization error, which pairs x with q, still needs a pass over both
tensors (in chunks, as in summarize.py). Results equal the general path's.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from megatron.analysis import binning
from megatron.analysis.accumulators import Stats
from megatron.analysis.ranges import FormatRanges

COUNT_CHUNK = 1 << 20       # elements per bincount (its int64 copy stays at 8 MB)
ERROR_CHUNK = 1 << 16       # elements per error chunk (float64 temporaries stay in cache)


class _Tables:
    """Per-pattern value, class and histogram bin of all 65536 bf16 bit patterns."""

    def __init__(self):
        patterns = np.arange(65536, dtype=np.uint32)
        bits32 = (patterns << 16).astype(np.uint32)
        with np.errstate(invalid="ignore"):      # NaN patterns stay NaN
            values = bits32.view(np.float32).astype(np.float64)
        self.values = values
        self.finite = np.isfinite(values)
        self.nan = np.isnan(values)
        self.inf = np.isinf(values)
        self.zero = values == 0
        mag = np.where(self.finite, np.abs(values), 0.0)
        self.sq = mag * mag
        self.quad = self.sq * self.sq
        abs_bits = (bits32 & 0x7FFFFFFF).astype(np.int32)
        bins = (abs_bits >> 21) + binning.RAW_OFFSET
        sub = (abs_bits != 0) & (abs_bits < 0x00800000)
        bins[sub] = binning.subnormal_index(abs_bits[sub])
        self.bins = np.where(self.finite & ~self.zero, np.clip(bins, 0, binning.NBINS - 1), -1)


@lru_cache(maxsize=1)
def tables() -> _Tables:
    return _Tables()


def applies(x: torch.Tensor, q: Optional[torch.Tensor], mx: bool) -> bool:
    return (not mx and x.dtype == torch.bfloat16
            and (q is None or q.dtype == torch.bfloat16))


def _u16(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a bf16 tensor as a flat uint16 array (a view when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def summarize(st: Stats, x: torch.Tensor, q: Optional[torch.Tensor],
              fmt: FormatRanges) -> None:
    """Fill `st` (already holding records/n) from a bf16 tensor and its bf16 copy `q`."""
    tab = tables()
    xu = _u16(x)
    counts = np.zeros(65536, dtype=np.int64)
    for c0 in range(0, xu.size, COUNT_CHUNK):
        counts += np.bincount(xu[c0:c0 + COUNT_CHUNK], minlength=65536)
    present = counts > 0
    st.nan = int(counts[tab.nan].sum())
    st.inf = int(counts[tab.inf].sum())
    st.zeros = int(counts[tab.zero].sum())
    fin = present & tab.finite
    c = counts[fin].astype(np.float64)
    st.s1 = float(np.dot(c, tab.values[fin]))
    st.s2 = float(np.dot(c, tab.sq[fin]))
    st.s4 = float(np.dot(c, tab.quad[fin]))
    if fin.any():
        vals = tab.values[fin]
        st.vmin, st.vmax = float(vals.min()), float(vals.max())
        st.absmax = max(abs(st.vmin), abs(st.vmax))
    binned = present & (tab.bins >= 0)
    hist = np.bincount(tab.bins[binned], weights=counts[binned], minlength=binning.NBINS)
    st.add_array("hist", hist.astype(np.int64))
    if q is None:
        return
    _errors(st, x, xu, _u16(q), fmt, counts, tab)


def _errors(st: Stats, x: torch.Tensor, xu: np.ndarray, qu: np.ndarray, fmt: FormatRanges,
            counts: np.ndarray, tab: _Tables) -> None:
    """Error sums, flushed, saturated and non-finite q, chunk by chunk."""
    x_finite = st.nan == 0 and st.inf == 0
    xf = x.detach().contiguous().reshape(-1)
    q16 = torch.from_numpy(qu.view(np.int16)).view(torch.bfloat16)
    limit16 = None
    if fmt.kind == "hifp8":
        limit16 = int(np.float32(fmt.max_normal or 32768.0).view(np.int32)) >> 16
    excluded_x2 = 0.0    # x^2 of elements left out of the error sums (non-finite q)
    x2_masked = 0.0
    for c0 in range(0, xu.size, ERROR_CHUNK):
        c1 = min(c0 + ERROR_CHUNK, xu.size)
        x32 = xf[c0:c1].float().numpy()
        q32 = q16[c0:c1].float().numpy()
        qc = qu[c0:c1]
        xc = xu[c0:c1]
        n = c1 - c0
        with np.errstate(invalid="ignore"):       # inf - inf: handled by the masks below
            d = (q32 - x32).astype(np.float64)
        e2 = _dot(d)
        q_zero = n - int(np.count_nonzero(qc << 1))    # << 1 drops the sign: -0 is zero
        x_zero = n - int(np.count_nonzero(xc << 1))
        if x_finite and math.isfinite(e2):
            st.e2 += e2
            st.q_n += n
            st.flushed += q_zero - x_zero                # a zero x always quantizes to zero
        else:
            x_ok = tab.finite[xc]
            q_ok = tab.finite[qc]
            both = x_ok & q_ok
            st.q_nonfinite += int(n - np.count_nonzero(q_ok))
            dm = np.where(both, d, 0.0)
            st.e2 += _dot(dm)
            st.q_n += int(np.count_nonzero(both))
            x64 = x32.astype(np.float64)
            if x_finite:
                excluded_x2 += _dot(np.where(both, 0.0, x64))
            else:
                x2_masked += _dot(np.where(both, x64, 0.0))
            st.flushed += int(np.count_nonzero(x_ok & ((xc << 1) != 0) & ((qc << 1) == 0)))
        if limit16 is not None:
            qa = qc & np.uint16(0x7FFF)
            if int(qa.max()) >= limit16:
                sat = qa >= limit16
                if not x_finite:
                    sat &= tab.finite[xc]
                st.saturated += int(np.count_nonzero(sat))
    st.x2 = (st.s2 - excluded_x2) if x_finite else x2_masked
    st.q_nonzero = st.finite - st.zeros
    if limit16 is None and fmt.max_normal and fmt.kind not in ("nvfp4", "fp8"):
        # (NVFP4 / FP8 saturation depends on their scales: summarize.py adds it)
        over = tab.finite & (np.abs(tab.values) > fmt.max_normal)
        st.saturated += int(counts[over].sum())


def _dot(v: np.ndarray) -> float:
    t = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64))
    return float(torch.dot(t, t))
