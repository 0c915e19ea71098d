"""Per-record work: one captured tensor (and its quantized copy) -> a small `Stats`.

Everything is computed from the tensors themselves, independently of the writer's own
`quant_error` (used only for records saved without tensors, and for a consistency check).
Tensors are processed in chunks of ~128K elements so that every temporary stays in cache and
memory per worker is bounded by the record being read, not by the capture. Each chunk costs
about a dozen vectorised passes plus one bincount; the common case (no NaN/Inf) never builds
masks.

Conventions (docs/analysis.md):
- sums of x, x^2, x^4 and (q-x)^2 are accumulated in float64 (products of bf16 values are
  exact in float32; float32 tensors' products are rounded once to float32 first);
  (q-x)^2 and the matching x^2 cover elements where x and q are both finite;
- MX records are blocked along metadata `axis` (block_size from the format, zero-padded
  partial blocks, as the quantizer does); a block with a NaN/Inf element is a NaN block;
- the MX shared exponent is recomputed from the block amax with the record's scale mode
  ('floor': floor(log2 amax) - emax_elem; 'rceil': ceil(log2(amax / max_normal)); clamped to
  [-127, 127]; amax 0 -> -127); an element is saturated when |x| > max_normal * 2^scale;
- HiFP8: saturated = finite x whose |q| >= 32768 (largest finite, or Inf);
- NVFP4 and FP8: the scales are recomputed from x with the record's format options
  (metadata block_2d, tensor_amax, fp8_scaling, fp8_block, fp8_margin, fp8_pow2_scale, through
  megatron.tensor_capture.replay and .stats, the capture's own definitions); saturated =
  elements the element clamp changed (scaled |v| > 464 for E4M3, >= 61440 for E5M2, >= 7
  for NVFP4's E2M1); NVFP4 block scales add zero / subnormal counts and an E4M3 exponent
  histogram;
- flushed = finite nonzero x whose q is 0 (either sign).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from megatron.analysis import bf16path, binning
from megatron.analysis.accumulators import (
    E4M3_EXP_MAX, E4M3_EXP_MIN, N_E4M3_EXP, N_SCALE, SCALE_MAX, SCALE_MIN, Stats)
from megatron.analysis.hifp8 import regions_from_fractions
from megatron.analysis.ranges import FormatRanges
from megatron.tensor_capture.stats import SCALED_KINDS, scale_stats

CHUNK_ELEMENTS = 1 << 17
_INF_BITS = 0x7F800000
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dot(v: np.ndarray) -> float:
    """sum(v * v), accumulated in float64 (torch's dot: numpy's BLAS would start its own
    threads, which contend with the worker processes)."""
    if v.dtype != np.float64:
        v = v.astype(np.float64)
    t = torch.from_numpy(np.ascontiguousarray(v))
    return float(torch.dot(t, t))


def _as_rows(t: torch.Tensor, axis: int, width: Optional[int]) -> torch.Tensor:
    """2-D view of `t`: MX -> (rows, length of `axis`) with that axis last; else (1, numel)."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    if width is None:
        return t.reshape(1, -1)
    axis = axis % t.dim()
    if axis != t.dim() - 1:
        # One transposing copy; chunks of a strided view would convert far slower.
        t = t.movedim(axis, -1).contiguous()
    return t.reshape(-1, t.shape[-1])


def _f32(chunk: torch.Tensor) -> np.ndarray:
    """float32 numpy copy (or view) of a chunk."""
    if chunk.dtype != torch.float32:
        chunk = chunk.to(torch.float32)
    return chunk.contiguous().numpy()


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    """Zero-pad the last axis to a multiple of `width` (MX partial blocks)."""
    pad = (-a.shape[-1]) % width
    if not pad:
        return a
    return np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), dtype=a.dtype)], axis=-1)


def summarize_tensors(x: torch.Tensor, q: Optional[torch.Tensor], fmt: FormatRanges,
                      axis: int = -1, scale_mode: str = "floor",
                      options: Optional[dict] = None) -> Stats:
    """Statistics of one record's tensor `x` and (if quantized) its copy `q` in format `fmt`;
    `options` are an NVFP4 / FP8 record's format options (replay.stats_options)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    if q is not None and tuple(q.shape) != tuple(x.shape):
        raise ValueError(f"quantized shape {tuple(q.shape)} differs from tensor shape "
                         f"{tuple(x.shape)}")
    st = Stats()
    st.records = 1
    st.from_tensors = 1
    st.n = int(x.numel())
    if st.n == 0:
        return st
    mx = q is not None and fmt.kind == "mx" and bool(fmt.block_size)
    if bf16path.applies(x, q, mx):
        bf16path.summarize(st, x, q, fmt)
        _scaled(st, x, q, fmt, axis, options)
        _close(st, q)
        return st
    width = int(fmt.block_size) if mx else None
    xr = _as_rows(x, axis, width)
    qr = _as_rows(q, axis, width) if q is not None else None
    rows_per_chunk = max(1, CHUNK_ELEMENTS // xr.shape[1]) if mx else 1
    if mx or xr.shape[1] <= CHUNK_ELEMENTS:
        spans = [(r, min(r + rows_per_chunk, xr.shape[0]), None)
                 for r in range(0, xr.shape[0], rows_per_chunk)]
    else:   # one flat row: chunk along it
        spans = [(0, 1, (c, min(c + CHUNK_ELEMENTS, xr.shape[1])))
                 for c in range(0, xr.shape[1], CHUNK_ELEMENTS)]
    hist = np.zeros(binning.NBINS, dtype=np.int64)
    for r0, r1, cols in spans:
        xc = xr[r0:r1] if cols is None else xr[:, cols[0]:cols[1]]
        qc = None
        if qr is not None:
            qc = qr[r0:r1] if cols is None else qr[:, cols[0]:cols[1]]
        _chunk(st, hist, xc, qc, fmt, width, scale_mode)
    st.add_array("hist", hist)
    _scaled(st, x, q, fmt, axis, options)
    _close(st, q)
    return st


def _scaled(st: Stats, x: torch.Tensor, q: Optional[torch.Tensor], fmt: FormatRanges,
            axis: int, options: Optional[dict]) -> None:
    """Saturation and scales of an NVFP4 / FP8 record (scales recomputed from x)."""
    if q is None or fmt.kind not in SCALED_KINDS:
        return
    sc = scale_stats(x, fmt.name, axis, options, all_finite=st.nan == 0 and st.inf == 0)
    saturated, blocks, nan_blocks, zero, subnormal = (
        int(v) for v in (sc.saturated, sc.blocks, sc.nan_blocks, sc.zero_blocks,
                         sc.subnormal_blocks))
    st.saturated += saturated
    _add_scales(st, fmt, None if sc.tensor_scale is None else float(sc.tensor_scale),
                float(sc.block_min), float(sc.block_max), blocks, nan_blocks, zero, subnormal)
    if fmt.kind == "nvfp4" and sc.block_scales is not None:
        _, exponents = np.frexp(sc.block_scales[sc.valid].double().numpy())
        st.add_array("nvfp4_scale_hist", np.bincount(
            np.clip(exponents - 1, E4M3_EXP_MIN, E4M3_EXP_MAX) - E4M3_EXP_MIN,
            minlength=N_E4M3_EXP))


def _add_scales(st: Stats, fmt: FormatRanges, tensor_scale: Optional[float], block_min,
                block_max, blocks: int, nan_blocks: int, zero: int, subnormal: int) -> None:
    st.scaled_records += 1
    st.scale_blocks += blocks
    if tensor_scale is not None and math.isfinite(tensor_scale):
        st.tensor_scale_min = min(st.tensor_scale_min, tensor_scale)
        st.tensor_scale_max = max(st.tensor_scale_max, tensor_scale)
    if block_min is not None and math.isfinite(block_min):
        st.block_scale_min = min(st.block_scale_min, block_min)
    if block_max is not None and math.isfinite(block_max):
        st.block_scale_max = max(st.block_scale_max, block_max)
    if fmt.kind == "nvfp4":
        st.nvfp4_blocks += blocks - nan_blocks
        st.nvfp4_nan_blocks += nan_blocks
        st.nvfp4_zero_blocks += zero
        st.nvfp4_subnormal_blocks += subnormal


def _close(st: Stats, q: Optional[torch.Tensor]) -> None:
    if q is not None:
        st.q_records = 1
        st.q_finite = st.finite
        st.close_record()


def _chunk(st: Stats, hist: np.ndarray, xc: torch.Tensor, qc: Optional[torch.Tensor],
           fmt: FormatRanges, width: Optional[int], scale_mode: str) -> None:
    x32 = _f32(xc)
    n = x32.size
    bits = x32.view(np.int32) & np.int32(0x7FFFFFFF)
    zeros = n - int(np.count_nonzero(bits))
    lo, hi = torch.aminmax(torch.from_numpy(x32))
    lo, hi = float(lo), float(hi)
    finite = None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # rare: NaN/Inf present, mask them out of every sum
        finite = bits < _INF_BITS
        st.inf += int(np.count_nonzero(bits == _INF_BITS))
        st.nan += int(np.count_nonzero(bits > _INF_BITS))
        if finite.any():
            lo, hi = float(x32[finite].min()), float(x32[finite].max())
        else:
            lo, hi = math.inf, -math.inf
    st.zeros += zeros
    # Extrema on the unpadded chunk (zero padding would fake a 0 minimum).
    st.vmin = min(st.vmin, lo)
    st.vmax = max(st.vmax, hi)
    if math.isfinite(lo):
        st.absmax = max(st.absmax, abs(lo), abs(hi))
    s2 = _sums(st, xc, x32, finite)
    scale = None
    if qc is not None:
        _errors(st, x32, _f32(qc), bits, finite, zeros, s2, fmt, width)
    if width is not None:
        if x32.shape[-1] % width:
            x32 = _pad(x32, width)
            bits = x32.view(np.int32) & np.int32(0x7FFFFFFF)
        bits = bits.reshape(-1, width)
        scale = _mx_blocks(st, bits, fmt, scale_mode)
    _histograms(st, hist, bits, scale)


def _sums(st: Stats, xc: torch.Tensor, x32: np.ndarray, finite) -> float:
    """Add sum x, x^2, x^4 of the chunk's finite values; returns its sum x^2."""
    x64 = (xc.contiguous().numpy().astype(np.float64, copy=True) if xc.dtype == torch.float64
           else x32.astype(np.float64)).reshape(-1)
    if finite is not None:
        x64 = np.where(finite.reshape(-1), x64, 0.0)
    st.s1 += float(x64.sum())
    s2 = _dot(x64)
    st.s2 += s2
    st.s4 += _dot(x64 * x64)
    return s2


def _errors(st: Stats, x32, q32, bits, finite, zeros_x, s2, fmt: FormatRanges, width) -> None:
    """Error sums, flushed, non-finite q and (non-MX) saturation of one chunk."""
    n = x32.size
    qb = q32.view(np.int32)
    q_zeros = n - int(np.count_nonzero(qb << 1))     # << 1 drops the sign: -0 is zero too
    # q - x is exact in float32 for bf16/fp16 captures (both on nearby grids).
    with np.errstate(invalid="ignore"):           # inf - inf: handled by the masks below
        d = (q32 - x32).reshape(-1)
    e2 = _dot(d)
    if finite is None and math.isfinite(e2):
        # Fast path: x and q all finite; a zero x always quantizes to zero.
        st.q_n += n
        st.x2 += s2
        st.e2 += e2
        st.q_nonzero += n - zeros_x
        st.flushed += q_zeros - zeros_x
    else:
        qabs = qb & np.int32(0x7FFFFFFF)
        q_fin = qabs < _INF_BITS
        st.q_nonfinite += int(q_fin.size - np.count_nonzero(q_fin))
        both = q_fin if finite is None else q_fin & finite
        dm = np.where(both.reshape(-1), d, 0.0)
        xm = np.where(both, x32, 0.0).reshape(-1).astype(np.float64)
        st.q_n += int(np.count_nonzero(both))
        st.x2 += (_dot(xm))
        st.e2 += (_dot(dm))
        nonzero = (bits != 0) if finite is None else (bits != 0) & finite
        st.q_nonzero += int(np.count_nonzero(nonzero))
        st.flushed += int(np.count_nonzero(nonzero & (qabs == 0)))
    if width is not None:
        return      # MX saturation needs the block scales (_mx_blocks)
    if fmt.kind == "hifp8":
        limit = int(np.float32(fmt.max_normal or 32768.0).view(np.int32))
        qabs = qb & np.int32(0x7FFFFFFF)
        if int(qabs.max()) >= limit:
            sat = qabs >= limit
            st.saturated += int(np.count_nonzero(sat if finite is None else sat & finite))
    elif fmt.max_normal and fmt.kind not in SCALED_KINDS:   # scaled formats: _scaled
        limit = int(np.float32(fmt.max_normal).view(np.int32))
        sat = bits > limit
        st.saturated += int(np.count_nonzero(sat if finite is None else sat & finite))


def _mx_blocks(st: Stats, blocks: np.ndarray, fmt: FormatRanges,
               scale_mode: str) -> np.ndarray:
    """Block scales, NaN blocks and saturation of an MX chunk; returns the scales (NaN: -1000)."""
    amax_bits = torch.from_numpy(blocks).amax(dim=1).numpy()
    ok = amax_bits < _INF_BITS
    st.blocks += int(amax_bits.size)
    bad = int(amax_bits.size - np.count_nonzero(ok))
    st.nan_blocks += bad
    amax = np.where(ok, amax_bits, 0).view(np.float32)
    scale = shared_exponents(amax, fmt, scale_mode)
    st.add_array("scale_hist", np.bincount((scale - SCALE_MIN)[ok] if bad else
                                           scale - SCALE_MIN, minlength=N_SCALE))
    threshold = np.ldexp(np.float32(fmt.max_normal), scale).astype(np.float32).view(np.int32)
    if bad:
        threshold = np.where(ok, threshold, np.int32(0x7FFFFFFF))
        scale = np.where(ok, scale, -1000)
    # Only blocks whose amax exceeds the threshold can hold saturated elements.
    over = amax_bits > threshold
    if bad:
        over &= ok
    if over.any():
        sub = blocks[over]
        st.saturated += int(np.count_nonzero(sub > threshold[over][:, None]))
    return scale


def _histograms(st: Stats, hist: np.ndarray, bits: np.ndarray,
                scale: Optional[np.ndarray]) -> None:
    """|x| histogram, and for MX the histogram of |x| / 2^scale, from one bincount."""
    if scale is None:
        hist += binning.histogram(bits)[0]
        return
    keep = scale > -1000
    if not keep.all():
        # NaN blocks: their finite elements still count in the |x| histogram.
        hist += binning.histogram(bits[~keep])[0]
        bits, scale = bits[keep], scale[keep]
    if bits.size == 0:
        return
    joint = binning.joint_histogram(bits, scale)
    hist += joint.plain
    st.add_array("scaled_hist", joint.scaled)


def shared_exponents(amax: np.ndarray, fmt: FormatRanges, scale_mode: str) -> np.ndarray:
    """Unbiased E8M0 exponents of blocks with finite amax (exact, via frexp, never log2)."""
    amax = amax.astype(np.float64)
    if scale_mode == "rceil":
        mant, exp = np.frexp(amax / float(fmt.max_normal))
        scale = np.where(mant == 0.5, exp - 1, exp)          # ceil(log2 r)
    else:
        mant, exp = np.frexp(amax)
        scale = (exp - 1) - int(fmt.emax_elem)                # floor(log2 amax) - emax
    scale = np.where(amax == 0, SCALE_MIN, scale)
    return np.clip(scale, SCALE_MIN, SCALE_MAX).astype(np.int64)


def summarize_manifest_only(tensor_info: dict, quant_error: Optional[dict],
                            fmt: FormatRanges, hifp8_scaled: bool = False) -> Stats:
    """Approximate `Stats` of a record saved without tensors, from its manifest statistics.

    Sums are reconstructed from mean/std (population std) and the error sums from mse and
    sqnr_db; value histograms are unavailable (E8M0 exponents and HiF8 regions are taken from
    the manifest when present). For HiF8 records the writer's `hifp8_regions` are those the
    grid saw; of a record scaled per tensor (`hifp8_scaled`), `hifp8_regions_unscaled` are
    those of the unscaled values.
    """
    st = Stats()
    st.records = 1
    n = int(tensor_info.get("numel") or 0)
    st.n = n
    st.nan = int(tensor_info.get("nan_count") or 0)
    st.inf = int(tensor_info.get("inf_count") or 0)
    finite = st.finite
    st.zeros = int(round(float(tensor_info.get("zero_fraction") or 0.0) * n))
    mean = _num(tensor_info.get("mean"))
    std = _num(tensor_info.get("std"))
    if mean is not None and std is not None and finite:
        st.s1 = mean * finite
        st.s2 = (std * std + mean * mean) * finite
    absmax = _num(tensor_info.get("absmax"))
    if absmax is not None:
        st.absmax = absmax
    for attr, key in (("vmin", "min"), ("vmax", "max")):
        value = _num(tensor_info.get(key))
        if value is not None:
            setattr(st, attr, value)
    nonzero = max(finite - st.zeros, 0)
    if quant_error:
        st.q_records = 1
        st.q_n = finite
        st.q_finite = finite
        st.q_nonzero = nonzero
        mse = _num(quant_error.get("mse"))
        sqnr = _num(quant_error.get("sqnr_db"))
        st.e2 = (mse or 0.0) * finite
        if sqnr is not None and math.isfinite(sqnr) and st.e2 > 0:
            st.x2 = st.e2 * 10.0 ** (sqnr / 10.0)
        else:
            st.x2 = st.s2
        st.flushed = int(round((_num(quant_error.get("flushed_fraction")) or 0.0) * nonzero))
        st.saturated = int(round((_num(quant_error.get("saturated_fraction")) or 0.0) * finite))
        st.q_nonfinite = int(round((_num(quant_error.get("nonfinite_fraction")) or 0.0) * n))
        hist = quant_error.get("scale_exponent_hist")
        if hist and hist.get("counts") is not None:
            st.add_array("scale_hist", scale_hist_from_manifest(hist))
            st.nan_blocks = int(quant_error.get("nan_blocks") or 0)
            st.blocks = int(sum(hist["counts"])) + st.nan_blocks
        if fmt.kind in SCALED_KINDS:
            _scaled_from_manifest(st, fmt, quant_error)
        grid = quant_error.get("hifp8_regions")
        unscaled = quant_error.get("hifp8_regions_unscaled") if hifp8_scaled else grid
        if unscaled:
            st.add_array("regions", regions_from_fractions(unscaled, nonzero))
        if grid and fmt.kind == "hifp8":
            st.add_array("grid_regions", regions_from_fractions(grid, nonzero))
            st.hifp8_scaled = int(hifp8_scaled)
        st.close_record()
    return st


def _scaled_from_manifest(st: Stats, fmt: FormatRanges, quant_error: dict) -> None:
    """NVFP4 / FP8 scales of a record saved without tensors, from its quant_error."""
    blocks = int(quant_error.get("blocks") or 0)
    nan_blocks = int(quant_error.get("nan_blocks") or 0) if blocks else 0
    defined = max(blocks - nan_blocks, 0)
    fraction = lambda key: _num(quant_error.get(key)) or 0.0  # noqa: E731
    _add_scales(st, fmt, _num(quant_error.get("tensor_scale")),
                _num(quant_error.get("block_scale_min")),
                _num(quant_error.get("block_scale_max")), blocks, nan_blocks,
                int(round(fraction("block_scale_zero_fraction") * defined)),
                int(round(fraction("block_scale_subnormal_fraction") * defined)))
    hist = quant_error.get("block_scale_hist")
    if fmt.kind == "nvfp4" and hist and hist.get("min") is not None:
        out = np.zeros(N_E4M3_EXP, dtype=np.int64)
        for i, count in enumerate(hist.get("counts") or []):
            e = min(max(int(hist["min"]) + i, E4M3_EXP_MIN), E4M3_EXP_MAX)
            out[e - E4M3_EXP_MIN] += int(count)
        st.add_array("nvfp4_scale_hist", out)


def scale_hist_from_manifest(hist: dict) -> np.ndarray:
    """The capture format's {"min", "counts"} exponent histogram in the fixed E8M0 layout."""
    out = np.zeros(N_SCALE, dtype=np.int64)
    if hist.get("min") is None:
        return out
    lo = int(hist["min"])
    for i, count in enumerate(hist.get("counts") or []):
        e = min(max(lo + i, SCALE_MIN), SCALE_MAX)
        out[e - SCALE_MIN] += int(count)
    return out


def _num(value):
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if not math.isnan(out) else None
