"""Independent references for the NVFP4 variants: 4/6 (TransformerEngine's nvfp4_4over6) and
row scaling (row_scaled_activation), written from TE's kernel description, one block at a
time with numpy float32 scalars (every operation one IEEE float32 rounding).

The E4M3 and E2M1 roundings are the grid searches of fp4_reference (decoded from the bit
layouts), not the formats package.
"""

from __future__ import annotations

import numpy as np

import fp4_reference as ref

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def _e4m3(v: F32) -> F32:
    """cvt.rn.satfinite.e4m3 of a non-negative float32 scalar."""
    return F32(ref.e4m3_rne_saturating(np.array([v], dtype=np.float32))[0])


def _e2m1(v: F32) -> F32:
    """cvt.rn.satfinite.e2m1: nearest even on the E2M1 grid, clamped to +-6."""
    c = F32(min(max(v, F32(-6)), F32(6)))
    return F32(ref.round_to_grid(np.array([c], dtype=np.float64), "e2m1")[0])


def _tensor_encode_scale(amax: F32, bound: int) -> F32:
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(min(F32(6 * bound) / amax, FLT_MAX))
    return F32(1) if amax == 0 or s_enc == 0 else s_enc


def _candidate(block: np.ndarray, sf: F32, s_dec: F32, amax: F32, bound: int):
    """(codes, the per-element error terms d) of one candidate scale."""
    with np.errstate(divide="ignore", over="ignore"):
        enc = F32(min(F32(1) / F32(sf * s_dec), FLT_MAX))
    q = np.array([_e2m1(F32(v * enc)) for v in block], dtype=np.float32)
    val = np.array([F32(F32(F32(c * sf) * amax) / F32(6 * bound)) for c in q], dtype=np.float32)
    return q, np.array([F32(a - b) for a, b in zip(val, block)], dtype=np.float32)


def _ordered_sum(terms) -> F32:
    acc = F32(0)
    for t in terms:
        acc = F32(acc + t)
    return acc


def _error(d: np.ndarray, mode: str, tile_lines: bool) -> F32:
    """The block's error: 1-D in element order; a tile given as 16 lines along the block
    axis: each line in order, then the 16 sums as a tree (i, i + 8), (i, i + 4), ..."""
    terms = np.abs(d) if mode == "mae" else np.array([F32(v * v) for v in d.ravel()],
                                                    dtype=np.float32).reshape(d.shape)
    if not tile_lines:
        return _ordered_sum(terms.ravel())
    sums = [_ordered_sum(line) for line in terms]
    while len(sums) > 1:
        half = len(sums) // 2
        sums = [F32(sums[i] + sums[i + half]) for i in range(half)]
    return sums[0]


def four_over_six_block(block: np.ndarray, amax: F32, mode: str, bound: int,
                        tile_lines: bool = False):
    """(dequantized block, chosen E4M3 scale, picked 4?) of one block (1-D, 16 values) or
    tile (16 lines of 16 values along the block axis) under 4/6 with tensor amax `amax`."""
    s_enc = _tensor_encode_scale(amax, bound)
    s_dec = F32(F32(1) / s_enc)
    bamax = F32(np.abs(block).max())
    base = F32(F32(bamax / F32(6)) * s_enc)
    sf6 = _e4m3(F32(min(base, F32(448))))
    sf4 = _e4m3(F32(min(F32(base * F32(1.5)), F32(448))))
    q6, d6 = _candidate(block.ravel(), sf6, s_dec, amax, bound)
    q4, d4 = _candidate(block.ravel(), sf4, s_dec, amax, bound)
    err6 = _error(d6.reshape(block.shape), mode, tile_lines)
    err4 = _error(d4.reshape(block.shape), mode, tile_lines)
    pick4 = bool(err4 < err6)
    q, sf = (q4, sf4) if pick4 else (q6, sf6)
    dec = F32(F32(sf * amax) * F32(1.0 / (6 * bound)))
    y = np.array([F32(c * dec) for c in q], dtype=np.float32).reshape(block.shape)
    return y, sf, pick4


def four_over_six_reference(x: np.ndarray, mode: str, bound: int = 448, block_2d: bool = False,
                            axis: int = -1, amax=None):
    """4/6 NVFP4 quantize-dequantize of float32 x (no NaN/Inf): (y, chosen scales, picked-4
    mask). 1-D blocks of 16 along `axis` (a short tail zero-padded), or 16x16 tiles of a 2-D
    x (sides multiples of 16) summed along `axis` first."""
    x = np.asarray(x, dtype=np.float32)
    t_amax = F32(np.abs(x).max()) if amax is None else F32(amax)
    y = np.zeros_like(x)
    if block_2d:
        r, c = x.shape[0] // 16, x.shape[1] // 16
        scales, picks = np.zeros((r, c), np.float32), np.zeros((r, c), bool)
        for i in range(r):
            for j in range(c):
                tile = x[16 * i:16 * i + 16, 16 * j:16 * j + 16]
                lines = tile if axis in (1, -1) else tile.T
                yt, scales[i, j], picks[i, j] = four_over_six_block(lines, t_amax, mode, bound,
                                                                    tile_lines=True)
                y[16 * i:16 * i + 16, 16 * j:16 * j + 16] = yt if axis in (1, -1) else yt.T
        return y, scales, picks
    n = x.shape[axis]
    moved = ref._pad_to(np.moveaxis(x, axis, -1), -1, 16)    # zeros: no amax, no error
    out = np.zeros_like(moved)
    lead = moved.shape[:-1]
    nb = moved.shape[-1] // 16
    scales, picks = np.zeros(lead + (nb,), np.float32), np.zeros(lead + (nb,), bool)
    for idx in np.ndindex(*lead):
        for b in range(nb):
            block = moved[idx][16 * b:16 * b + 16]
            yb, scales[idx + (b,)], picks[idx + (b,)] = four_over_six_block(block, t_amax, mode,
                                                                            bound)
            out[idx][16 * b:16 * b + 16] = yb
    return np.moveaxis(out[..., :n], -1, axis), scales, picks


def row_scaled_reference(x: np.ndarray, axis: int = -1, four_over_six=None, bound: int = 448):
    """Row-scaled NVFP4 of float32 x: every line along `axis` quantized with its own amax (by
    the plain float32 sequence of fp4_reference.nvfp4_reference, or by 4/6)."""
    x = np.asarray(x, dtype=np.float32)
    moved = np.moveaxis(x, axis, -1)
    out = np.empty_like(moved)
    for idx in np.ndindex(*moved.shape[:-1]):
        line = moved[idx][None, :]
        if four_over_six is None:
            out[idx] = ref.nvfp4_reference(line)["y"][0]
        else:
            out[idx] = four_over_six_reference(line, four_over_six, bound)[0][0]
    return np.moveaxis(out, -1, axis)
