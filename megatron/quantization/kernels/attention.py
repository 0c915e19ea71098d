"""Fused attention with simulated MX QK^T and PV GEMMs: the chunked path's numerics in Triton.

The chunked path of megatron/quantization/attention.py materialises every chunk's fp32 scores,
softmax and probabilities and quantizes P and dS in torch; these kernels compute the same
arithmetic tile by tile in registers (FlashAttention's structure, without its rescaled
accumulation of P @ V: a first pass over the key tiles gives every row's softmax statistics, a
second one the exact probabilities, which are rounded and quantized as the chunked path does).

Layout (the chunked path's grouped layout): q [G, R, d], k_t [G, d, sk], v [G, sk, dv] with
G = batch * groups and R = heads_per_group * sq; row r is head r // sq at query position
r % sq. Causal masking is megatron's, aligned bottom-right: key j is hidden from query i when
j > i + sk - sq, and hidden scores are filled with -10000.0 before the softmax (a query that
sees no key at all is spread evenly over all keys, as megatron's mask_func makes it). dtype is
bf16 or fp32: the GEMM outputs are in the input dtype, as torch's matmul returns them.

Forward, per (query tile, key tile), in the chunked path's order:

    S   = Q_q @ K_q^T                  fp32 accumulation, rounded to the dtype
    x   = float(dtype(S * scale))      the product in fp32, rounded to the dtype
    x   = -10000 where the mask hides the key
    P_fp32 = exp(x - m) / l               m, l: the row's max of x and sum of exp(x - m) over all
                                       keys (first pass, online); IEEE division
    P   = dtype(P_fp32)
    P_q = MX(P) in blocks of 32 consecutive keys (PV fprop.a)
    O  += P_q @ V_q                    fp32 accumulation; O rounded to the dtype at the end

Backward (dO given), as torch's autograd differentiates the chunk:

    dP    = dtype(dO_q @ V_q^T)                   dO and V blocked along dv (PV dgrad)
    delta = sum_j P32_j * dP_j over all keys       a separate pass (NOT rowsum(dO * O), which
                                                   differs once P, V or dO are quantized)
    dx    = P_fp32 * (dP - delta), 0 where hidden     softmax and masked_fill backward, fp32
    dS    = dtype(dtype(dx) * scale)               the .float() cast's and the scale's backward
    dQ    = MX_keys(dS) @ K_q                      QK^T dgrad: dS along keys, K (outside) along keys
    dK^T  = Q_q^T @ MX_rows(dS)                    QK^T wgrad: Q (outside) and dS along the rows
    dV    = MX_rows(P)^T @ dO_q                    PV wgrad: P and dO (outside) along the rows

MX_rows blocks run over 32 consecutive rows of the grouped layout (across a head boundary when
sq is not a multiple of 32; a partial tail block at the end of R), exactly the chunked path's
blocks: query tiles hold whole blocks. dQ, dK and dV accumulate in fp32 over the whole
reduction and are rounded to the dtype once.

The operands that are whole tensors (Q, K^T, V for the forward, V and K^T along other axes, Q
and dO along the rows, dO along dv) are quantized outside the kernels, once per call, by the
caller's own quantization function (so any format it supports, tensor-scaled ones with their
whole-tensor scale; a stochastically rounded one is drawn once per call, as in the unfused
path, where the chunked path draws K and V anew at every chunk); the kernels quantize only P
and dS (four "tile slots"), with MX formats (or none), round to nearest, any MX scale rule
(floor, rceil, ceil, even).

Kernels: the forward (one program per query tile and group: pass 1 and pass 2 over the key
tiles); the backward's query kernel (per query tile: a pass for delta, a pass for dQ) and key
kernel (per key tile: dK and dV over the query tiles, reading delta). That is 12 tile GEMMs
per (query tile, key tile) pair where FlashAttention-2 runs 7: QK^T is recomputed in each of
the five passes and dO V^T in each of the three backward ones.

What is exact:
* Every tile quantization is bit for bit eager fake_quantize(T, fmt, axis, scale_mode) of the
  kernel's own unquantized T (P along keys and rows, dS along keys and rows), tail blocks
  (sk or R not multiples of 32) included: the same integer arithmetic on the float bits as the
  MX QDQ kernel (mx.mx_quantize_blocks), and every rounding to bf16 is done on the bits, to
  nearest even.
* The roundings of S, S * scale, P, dP, dx and dS to the input dtype sit where the chunked
  path has them.
* The backward recomputes the forward's P bit for bit (same code, same Q_q and K_q: the QK^T
  fprop operands must be quantized reproducibly, see `unsupported_reason`).
* Key tiles that the causal mask hides from every row of a query tile are skipped (not for a
  tile holding a row that sees no key). Their P and dS are exactly zero -- exp(-10000 - m)
  underflows to 0 once the row's max m is above about -9896 -- so skipping changes no bit
  for finite inputs whose every query row has a visible score above that (the chunked path's
  skipping makes the same assumption; skip_masked_tiles=False visits every tile).

What differs from the chunked path (summation order and transcendental functions only):
* fp32 accumulation order of every GEMM (tiles of 64 vs the BLAS's order), of the softmax sum
  (online over key tiles, rescaled by exp(m_old - m_new)) and of delta;
* exp (Triton's, an approximation on GPUs) instead of torch's;
* dK and dV are rounded to the dtype once, after accumulating all query rows in fp32; the
  chunked path rounds each chunk's part to the dtype before summing the parts in fp32 (the
  unfused path rounds once, as here).
A last-bit difference in P_fp32 or S can flip a later rounding (to bf16, or to the MX grid), so
results agree with the chunked path to the rounding of the dtype, not bit for bit.

On a CUDA GPU the bf16 GEMMs run as bf16 tl.dot (fp32 accumulation) and fp32 ones with
input_precision "ieee" (no TF32); under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)
every tl.dot runs on the fp32 values (the interpreter cannot multiply bf16), which are the
same numbers. The kernels are compiled without floating-point contraction, so no rounding step
above is fused away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from megatron.quantization.formats import canonical_format, format_info
from megatron.quantization.kernels import interpreter_enabled
from megatron.quantization.kernels.bits import load_bits, store_bits
from megatron.quantization.kernels.mx import format_constants, mx_quantize_blocks

# (query rows, keys) per tile, each a multiple of 32 so that tiles hold whole MX blocks along
# either axis; chosen for an H100 at d = 128 (the in-register MX quantization is heavy on
# registers: larger tiles spill).
FORWARD_TILE = (64, 64)
BACKWARD_QUERY_TILE = (32, 64)
BACKWARD_KEY_TILE = (32, 64)
# Under Triton's interpreter every kernel takes this one tile shape. There tl.dot is numpy's
# matmul, whose float32 summation order depends on the operands' shapes (OpenBLAS picks its
# kernels by size), so the backward kernels recompute the forward's QK^T, and so P, bit for
# bit only when all of them multiply tiles of one shape. On a GPU the reduction over the head
# dim runs in one order whatever the tile's rows and keys.
INTERPRETER_TILE = (32, 64)
NUM_WARPS = 8
MAX_HEAD_DIM = 128  # largest d and dv (padded to a power of two in registers)
MASK_FILL = tl.constexpr(-10000.0)   # megatron's attention_mask_func fill
DTYPES = (torch.bfloat16, torch.float32)

# quantize(site, gemm, name, side, tensor, axis) -> the operand as that GEMM slot quantizes
# it (the tensor itself when the slot is "none"); site "qk" or "pv", the other arguments as
# gemm.quantize_slot takes them.
OperandQuantizer = Callable[[str, str, str, str, torch.Tensor, int], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Tile building blocks
# ---------------------------------------------------------------------------------------------

@triton.jit
def _round_to_dtype(x, IS_BF16: tl.constexpr):
    """x (float32) rounded to the input dtype and kept in float32: bf16 to nearest even on the
    bits (the interpreter's float cast truncates; NaN stays NaN); float32 unchanged."""
    if IS_BF16:
        bits = x.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        rounded = ((mag + (0x7FFF + ((mag >> 16) & 1))) >> 16) << 16
        rounded = tl.where(mag > 0x7F800000, mag, rounded)
        x = (rounded | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _operand(x, DOT_BF16: tl.constexpr):
    """A tile of input-dtype values (held in float32) as a tl.dot operand: bf16 on a GPU
    (exact: the values are bf16 numbers), float32 otherwise."""
    if DOT_BF16:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _load(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols, IS_BF16: tl.constexpr):
    """float32 values of the tile [rows, cols] of a matrix at ptr (int16 view of bf16 or
    int32 view of float32 data) with the given strides; zeros outside [n_rows, n_cols)."""
    offs = rows[:, None] * row_stride + cols[None, :] * col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return load_bits(ptr, offs, mask, IS_BF16).to(tl.float32, bitcast=True)


@triton.jit
def _store(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols, x,
           IS_BF16: tl.constexpr):
    """Store the float32 tile x at [rows, cols], rounded to the dtype (nearest even)."""
    offs = rows[:, None] * row_stride + cols[None, :] * col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    store_bits(ptr, offs, mask, x.to(tl.int32, bitcast=True), IS_BF16)


@triton.jit
def _quantize_rows_of(x, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr,
                      IS_BF16: tl.constexpr):
    """x [ROWS, COLS] (input-dtype values in float32) MX quantize-dequantized in blocks of 32
    consecutive elements of each row, rounded to the dtype: eager fake_quantize along the
    last axis. FMT = (enabled, EMAX, EMIN, MBITS, TOP_SIG, BUMP_ABOVE); x itself when not
    enabled. Elements outside the tensor must be zero (they pad a short tail block)."""
    if FMT[0]:
        blocks = tl.reshape(x.to(tl.int32, bitcast=True), (ROWS * COLS // 32, 32))
        res = mx_quantize_blocks(blocks, 0, FMT[1], FMT[2], FMT[3], FMT[4], FMT[5], False)
        x = _round_to_dtype(tl.reshape(res, (ROWS, COLS)).to(tl.float32, bitcast=True),
                            IS_BF16)
    return x


@triton.jit
def _last_visible_key(rows, SQ, SK):
    """The last key each grouped-layout row sees under the causal mask (negative: none)."""
    return rows % SQ + (SK - SQ)


@triton.jit
def _key_end(last_visible, row_ok, SK, LIMIT: tl.constexpr):
    """End of the keys a query tile must visit: past the last key any of its rows sees, or all
    keys when some row sees none (its probabilities spread over every key) or not LIMIT."""
    reach = tl.max(tl.where(row_ok, last_visible + 1, 0), axis=0)
    blind = tl.max((row_ok & (last_visible < 0)).to(tl.int32), axis=0)
    return tl.where((blind == 0) & LIMIT, tl.minimum(reach, SK), SK)


@triton.jit
def _scores(q, kt, scale, cols, last_visible, SK, CAUSAL: tl.constexpr, IS_BF16: tl.constexpr,
            PRECISION: tl.constexpr):
    """x = float(dtype(dtype(Q K^T) * scale)), -10000 where the causal mask hides the key,
    -inf past the last key (not part of the softmax): [BLOCK_M, BLOCK_N] float32."""
    s = _round_to_dtype(tl.dot(q, kt, input_precision=PRECISION), IS_BF16)
    x = _round_to_dtype(s * scale, IS_BF16)
    if CAUSAL:
        x = tl.where(cols[None, :] > last_visible[:, None], MASK_FILL, x)
    return tl.where(cols[None, :] < SK, x, float("-inf"))


@triton.jit
def _probs32(x, m, l):
    """The fp32 softmax exp(x - m) / l (IEEE division), as torch computes it."""
    return tl.math.div_rn(tl.exp(x - m[:, None]), l[:, None])


@triton.jit
def _hidden(cols, last_visible, SK, CAUSAL: tl.constexpr):
    """Where the mask hides the key (and past the last key)."""
    hidden = cols[None, :] >= SK
    if CAUSAL:
        hidden = hidden | (cols[None, :] > last_visible[:, None])
    return hidden


@triton.jit
def _score_grad(p32, dp, delta, hidden, scale, IS_BF16: tl.constexpr):
    """dS from dP: softmax backward in fp32, masked_fill's backward (zero where hidden), then
    the backward of the .float() cast (round to the dtype) and of * scale (round again)."""
    dx = tl.where(hidden, 0.0, p32 * (dp - delta[:, None]))
    return _round_to_dtype(_round_to_dtype(dx, IS_BF16) * scale, IS_BF16)


@triton.jit
def _tile_needed(rows, row_ok, first_key, SQ, SK, LIMIT: tl.constexpr):
    """Whether a query tile adds to a key tile's dK and dV: unless some row sees a key of the
    tile or sees no key at all (spread over every key), its P and dS there are zero."""
    last_visible = _last_visible_key(rows, SQ, SK)
    seen = tl.max((row_ok & ((last_visible >= first_key) | (last_visible < 0))).to(tl.int32),
                  axis=0)
    return (seen > 0) | (not LIMIT)


@triton.jit
def _store_debug(ptr, rows, cols, R, SK, x, IS_BF16: tl.constexpr):
    """A [rows, keys] tile of a debug tensor [R, SK]."""
    _store(ptr, rows, cols, SK, 1, R, SK, x, IS_BF16)


@triton.jit
def _store_debug_t(ptr, rows, cols, R, SK, x_t, IS_BF16: tl.constexpr):
    """A transposed [keys, rows] tile of a debug tensor [R, SK]."""
    _store(ptr, cols, rows, 1, SK, SK, R, x_t, IS_BF16)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _forward_kernel(q_ptr, kt_ptr, v_ptr, out_ptr, m_ptr, l_ptr, p_dbg, pq_dbg, scale,
                    R, SQ, SK, D, DV,
                    P_FMT: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
                    IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, PRECISION: tl.constexpr,
                    DEBUG: tl.constexpr, BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per query tile: out = MX_keys(P) @ V and the rows' softmax statistics m and l."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M_ + tl.arange(0, BLOCK_M_)
    row_ok = rows < R
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_ptr += g * R * D
    kt_ptr += g * D * SK
    v_ptr += g * SK * DV
    q = _operand(_load(q_ptr, rows, dims, D, 1, R, D, IS_BF16), DOT_BF16)
    last_visible = _last_visible_key(rows, SQ, SK)
    end = _key_end(last_visible, row_ok, SK, SKIP)

    # Pass 1: each row's max of x and sum of exp(x - max) over the keys it may see.
    m = tl.full((BLOCK_M_,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M_,), tl.float32)
    for n0 in range(0, end, BLOCK_N_):
        cols = n0 + tl.arange(0, BLOCK_N_)
        kt = _operand(_load(kt_ptr, dims, cols, SK, 1, D, SK, IS_BF16), DOT_BF16)
        x = _scores(q, kt, scale, cols, last_visible, SK, CAUSAL, IS_BF16, PRECISION)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new

    # Pass 2: the exact probabilities, rounded and quantized, times V.
    acc = tl.zeros((BLOCK_M_, BLOCK_DV), tl.float32)
    for n0 in range(0, end, BLOCK_N_):
        cols = n0 + tl.arange(0, BLOCK_N_)
        kt = _operand(_load(kt_ptr, dims, cols, SK, 1, D, SK, IS_BF16), DOT_BF16)
        x = _scores(q, kt, scale, cols, last_visible, SK, CAUSAL, IS_BF16, PRECISION)
        p = _round_to_dtype(_probs32(x, m, l), IS_BF16)
        pq = _quantize_rows_of(p, BLOCK_M_, BLOCK_N_, P_FMT, IS_BF16)
        v = _operand(_load(v_ptr, cols, vdims, DV, 1, SK, DV, IS_BF16), DOT_BF16)
        acc = tl.dot(_operand(pq, DOT_BF16), v, acc, input_precision=PRECISION)
        if DEBUG:
            _store_debug(p_dbg + g * R * SK, rows, cols, R, SK, p, IS_BF16)
            _store_debug(pq_dbg + g * R * SK, rows, cols, R, SK, pq, IS_BF16)

    _store(out_ptr + g * R * DV, rows, vdims, DV, 1, R, DV, acc, IS_BF16)
    tl.store(m_ptr + g * R + rows, m, mask=row_ok)
    tl.store(l_ptr + g * R + rows, l, mask=row_ok)


@triton.jit
def _backward_query_kernel(q_ptr, kt_ptr, kd_ptr, vd_ptr, do_ptr, m_ptr, l_ptr, delta_ptr,
                           dq_ptr, ds_dbg, dsq_dbg, scale, R, SQ, SK, D, DV,
                           DS_FMT: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
                           IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
                           PRECISION: tl.constexpr, DEBUG: tl.constexpr,
                           BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per query tile: delta over all keys, then dQ = MX_keys(dS) @ K."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M_ + tl.arange(0, BLOCK_M_)
    row_ok = rows < R
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    kt_ptr += g * D * SK
    kd_ptr += g * D * SK
    vd_ptr += g * SK * DV
    q = _operand(_load(q_ptr + g * R * D, rows, dims, D, 1, R, D, IS_BF16), DOT_BF16)
    do = _operand(_load(do_ptr + g * R * DV, rows, vdims, DV, 1, R, DV, IS_BF16), DOT_BF16)
    m = tl.load(m_ptr + g * R + rows, mask=row_ok, other=0.0)
    l = tl.load(l_ptr + g * R + rows, mask=row_ok, other=1.0)
    last_visible = _last_visible_key(rows, SQ, SK)
    end = _key_end(last_visible, row_ok, SK, SKIP)

    delta = tl.zeros((BLOCK_M_,), tl.float32)
    for n0 in range(0, end, BLOCK_N_):
        cols = n0 + tl.arange(0, BLOCK_N_)
        kt = _operand(_load(kt_ptr, dims, cols, SK, 1, D, SK, IS_BF16), DOT_BF16)
        x = _scores(q, kt, scale, cols, last_visible, SK, CAUSAL, IS_BF16, PRECISION)
        vt = _operand(_load(vd_ptr, vdims, cols, 1, DV, DV, SK, IS_BF16), DOT_BF16)
        dp = _round_to_dtype(tl.dot(do, vt, input_precision=PRECISION), IS_BF16)
        delta += tl.sum(_probs32(x, m, l) * dp, axis=1)

    dq = tl.zeros((BLOCK_M_, BLOCK_D), tl.float32)
    for n0 in range(0, end, BLOCK_N_):
        cols = n0 + tl.arange(0, BLOCK_N_)
        kt = _operand(_load(kt_ptr, dims, cols, SK, 1, D, SK, IS_BF16), DOT_BF16)
        x = _scores(q, kt, scale, cols, last_visible, SK, CAUSAL, IS_BF16, PRECISION)
        vt = _operand(_load(vd_ptr, vdims, cols, 1, DV, DV, SK, IS_BF16), DOT_BF16)
        dp = _round_to_dtype(tl.dot(do, vt, input_precision=PRECISION), IS_BF16)
        ds = _score_grad(_probs32(x, m, l), dp, delta, _hidden(cols, last_visible, SK, CAUSAL),
                         scale, IS_BF16)
        dsq = _quantize_rows_of(ds, BLOCK_M_, BLOCK_N_, DS_FMT, IS_BF16)
        k = _operand(_load(kd_ptr, cols, dims, 1, SK, SK, D, IS_BF16), DOT_BF16)
        dq = tl.dot(_operand(dsq, DOT_BF16), k, dq, input_precision=PRECISION)
        if DEBUG:
            _store_debug(ds_dbg + g * R * SK, rows, cols, R, SK, ds, IS_BF16)
            _store_debug(dsq_dbg + g * R * SK, rows, cols, R, SK, dsq, IS_BF16)

    _store(dq_ptr + g * R * D, rows, dims, D, 1, R, D, dq, IS_BF16)
    tl.store(delta_ptr + g * R + rows, delta, mask=row_ok)


@triton.jit
def _backward_key_kernel(q_ptr, qw_ptr, kt_ptr, vd_ptr, do_ptr, dow_ptr, m_ptr, l_ptr,
                         delta_ptr, dkt_ptr, dv_ptr, p_dbg, pq_dbg, ds_dbg, dsq_dbg, scale,
                         R, SQ, SK, D, DV,
                         P_FMT: tl.constexpr, DS_FMT: tl.constexpr, CAUSAL: tl.constexpr,
                         SKIP: tl.constexpr, IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
                         PRECISION: tl.constexpr, DEBUG: tl.constexpr,
                         BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per key tile: dV = MX_rows(P)^T @ dO_q and dK = MX_rows(dS)^T @ Q_q over all rows."""
    g = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N_ + tl.arange(0, BLOCK_N_)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_ptr += g * R * D
    qw_ptr += g * R * D
    do_ptr += g * R * DV
    dow_ptr += g * R * DV
    kt = _operand(_load(kt_ptr + g * D * SK, dims, cols, SK, 1, D, SK, IS_BF16), DOT_BF16)
    vt = _operand(_load(vd_ptr + g * SK * DV, vdims, cols, 1, DV, DV, SK, IS_BF16), DOT_BF16)
    first_key = tl.program_id(0) * BLOCK_N_

    dk = tl.zeros((BLOCK_N_, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N_, BLOCK_DV), tl.float32)
    for m0 in range(0, R, BLOCK_M_):
        rows = m0 + tl.arange(0, BLOCK_M_)
        row_ok = rows < R
        last_visible = _last_visible_key(rows, SQ, SK)
        if _tile_needed(rows, row_ok, first_key, SQ, SK, SKIP):
            q = _operand(_load(q_ptr, rows, dims, D, 1, R, D, IS_BF16), DOT_BF16)
            do = _operand(_load(do_ptr, rows, vdims, DV, 1, R, DV, IS_BF16), DOT_BF16)
            m = tl.load(m_ptr + g * R + rows, mask=row_ok, other=0.0)
            l = tl.load(l_ptr + g * R + rows, mask=row_ok, other=1.0)
            delta = tl.load(delta_ptr + g * R + rows, mask=row_ok, other=0.0)
            x = _scores(q, kt, scale, cols, last_visible, SK, CAUSAL, IS_BF16, PRECISION)
            p32 = tl.where(row_ok[:, None], _probs32(x, m, l), 0.0)
            p = _round_to_dtype(p32, IS_BF16)
            dp = _round_to_dtype(tl.dot(do, vt, input_precision=PRECISION), IS_BF16)
            ds = _score_grad(p32, dp, delta, _hidden(cols, last_visible, SK, CAUSAL), scale,
                             IS_BF16)
            # Row-blocked quantizations of the transposed tiles: [keys, rows].
            pq_t = _quantize_rows_of(p.T, BLOCK_N_, BLOCK_M_, P_FMT, IS_BF16)
            dsq_t = _quantize_rows_of(ds.T, BLOCK_N_, BLOCK_M_, DS_FMT, IS_BF16)
            dow = _operand(_load(dow_ptr, rows, vdims, DV, 1, R, DV, IS_BF16), DOT_BF16)
            qw = _operand(_load(qw_ptr, rows, dims, D, 1, R, D, IS_BF16), DOT_BF16)
            dv = tl.dot(_operand(pq_t, DOT_BF16), dow, dv, input_precision=PRECISION)
            dk = tl.dot(_operand(dsq_t, DOT_BF16), qw, dk, input_precision=PRECISION)
            if DEBUG:
                _store_debug(p_dbg + g * R * SK, rows, cols, R, SK, p, IS_BF16)
                _store_debug(ds_dbg + g * R * SK, rows, cols, R, SK, ds, IS_BF16)
                _store_debug_t(pq_dbg + g * R * SK, rows, cols, R, SK, pq_t, IS_BF16)
                _store_debug_t(dsq_dbg + g * R * SK, rows, cols, R, SK, dsq_t, IS_BF16)

    # dK^T [D, SK] is the transpose of the dK tile [keys, D].
    _store(dkt_ptr + g * D * SK, cols, dims, 1, SK, SK, D, dk, IS_BF16)
    _store(dv_ptr + g * SK * DV, cols, vdims, DV, 1, SK, DV, dv, IS_BF16)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileFormats:
    """Formats of the four operand slots quantized inside the kernels ("none": not quantized)
    and the MX scale rule of each site."""

    probs: str = "none"             # P in PV's fprop (slot fprop.a): blocks along the keys
    probs_rows: str = "none"        # P in PV's wgrad (wgrad.a): blocks along the query rows
    score_grad: str = "none"        # dS in QK^T's dgrad (dgrad.a): blocks along the keys
    score_grad_rows: str = "none"   # dS in QK^T's wgrad (wgrad.b): blocks along the rows
    qk_scale_mode: str = "floor"
    pv_scale_mode: str = "floor"

    def __post_init__(self):
        for name in ("probs", "probs_rows", "score_grad", "score_grad_rows"):
            object.__setattr__(self, name, canonical_format(getattr(self, name)))

    @classmethod
    def of(cls, qk_config, pv_config) -> "TileFormats":
        """The tile slots of a QK^T and a PV site's MatmulQuantConfig."""
        return cls(probs=pv_config.fprop.a, probs_rows=pv_config.wgrad.a,
                   score_grad=qk_config.dgrad.a, score_grad_rows=qk_config.wgrad.b,
                   qk_scale_mode=qk_config.mx.scale_mode, pv_scale_mode=pv_config.mx.scale_mode)


def _slot_constants(fmt: str, scale_mode: str) -> tuple:
    """The FMT constexpr of _quantize_rows_of."""
    if fmt == "none":
        return (False, 0, 0, 0, 0, 0)
    c = format_constants(fmt, scale_mode)
    return (True, c["EMAX"], c["EMIN"], c["MBITS"], c["TOP_SIG"], c["BUMP_ABOVE"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view the kernels read and write (int16 for bf16, int32 for float32)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def launch_tile(tile: tuple) -> tuple:
    """The (query rows, keys) tile a kernel launches with: `tile` on a GPU, INTERPRETER_TILE
    under the interpreter."""
    return INTERPRETER_TILE if interpreter_enabled() else tile


def _launch_options(dtype: torch.dtype, head_dim: int, value_dim: int, tile) -> dict:
    """The constexprs and compile options of a launch with (query rows, keys) tiles."""
    dot_bf16 = dtype == torch.bfloat16 and not interpreter_enabled()
    options = dict(IS_BF16=dtype == torch.bfloat16, DOT_BF16=dot_bf16,
                   PRECISION=None if dot_bf16 else "ieee", BLOCK_M_=tile[0], BLOCK_N_=tile[1],
                   BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                   BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
                   num_warps=NUM_WARPS, enable_fp_fusion=False)
    if dtype == torch.float32:
        options["num_stages"] = 1      # fp32 tiles: pipelined loads would overflow shared memory
    return options


def operands(sq: int, **tensors) -> list:
    """The operands, contiguous (the kernels address them as such), after checking them."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise TypeError(f"the attention kernels take bf16 or float32 operands of one dtype, got "
                        f"{ {k: t.dtype for k, t in tensors.items()} }")
    if any(t.dim() != 3 for t in tensors.values()):
        raise ValueError("the attention kernels take 3-D operands (the grouped layout)")
    if tensors["q"].size(1) % sq:
        raise ValueError(f"q has {tensors['q'].size(1)} rows, not a multiple of sq={sq}")
    return [t.contiguous() for t in tensors.values()]


class ForwardResult(NamedTuple):
    out: torch.Tensor               # [G, R, dv], the input dtype
    row_max: torch.Tensor           # [G, R] float32: max_j x_ij
    row_sum: torch.Tensor           # [G, R] float32: sum_j exp(x_ij - max)
    debug: Dict[str, torch.Tensor]  # debug=True: "probs" (P), "probs_q" (quantized along keys)


class BackwardResult(NamedTuple):
    grad_q: torch.Tensor            # [G, R, d]
    grad_k_t: torch.Tensor          # [G, d, sk]
    grad_v: torch.Tensor            # [G, sk, dv]
    delta: torch.Tensor             # [G, R] float32: sum_j P32_ij dP_ij
    debug: Dict[str, torch.Tensor]


def _debug_tensors(names, like: torch.Tensor, rows: int, keys: int, debug: bool) -> dict:
    """Zero-filled [G, R, sk] tensors the kernels write their tiles into (tiles they skip stay
    zero, which is what they hold); 1-element placeholders without debug."""
    shape = (like.size(0), rows, keys) if debug else (1,)
    return {name: torch.zeros(shape, dtype=like.dtype, device=like.device) for name in names}


def attention_forward(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor,
                      formats: TileFormats, softmax_scale: float, causal: bool, sq: int,
                      skip_masked_tiles: bool = True, debug: bool = False) -> ForwardResult:
    """out = MX(softmax(mask(scale * Q K^T))) @ V on operands quantized by the caller: q [G, R, d]
    (the QK^T fprop a operand), k_t [G, d, sk] (fprop b), v [G, sk, dv] (PV fprop b); R is a
    multiple of sq. P is quantized along the keys in `formats.probs`. debug also returns P and
    its quantization as [G, R, sk] tensors."""
    q, k_t, v = operands(sq, q=q, k_t=k_t, v=v)
    g, rows, d = q.shape
    sk, dv = k_t.size(2), v.size(2)
    out = torch.empty(g, rows, dv, dtype=q.dtype, device=q.device)
    row_max = torch.empty(g, rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    dbg = _debug_tensors(("probs", "probs_q"), q, rows, sk, debug)
    tile = launch_tile(FORWARD_TILE)
    _forward_kernel[(triton.cdiv(rows, tile[0]), g)](
        _bits(q), _bits(k_t), _bits(v), _bits(out), row_max, row_sum,
        _bits(dbg["probs"]), _bits(dbg["probs_q"]), float(softmax_scale), rows, sq, sk, d, dv,
        P_FMT=_slot_constants(formats.probs, formats.pv_scale_mode), CAUSAL=bool(causal),
        SKIP=bool(causal and skip_masked_tiles), DEBUG=debug,
        **_launch_options(q.dtype, d, dv, tile))
    return ForwardResult(out, row_max, row_sum, dbg if debug else {})


def attention_backward(grad_out_dgrad: torch.Tensor, grad_out_wgrad: torch.Tensor,
                       q: torch.Tensor, q_wgrad: torch.Tensor, k_t: torch.Tensor,
                       k_t_dgrad: torch.Tensor, v_dgrad: torch.Tensor, row_max: torch.Tensor,
                       row_sum: torch.Tensor, formats: TileFormats, softmax_scale: float,
                       causal: bool, sq: int, skip_masked_tiles: bool = True,
                       debug: bool = False) -> BackwardResult:
    """dQ, dK^T, dV of attention_forward from the output gradient, on operands quantized by
    the caller: grad_out_dgrad (dO for PV's dgrad, along dv), grad_out_wgrad (dO for PV's wgrad,
    along the rows), q and k_t (the forward's QK^T fprop operands, to recompute P), q_wgrad (Q
    for QK^T's wgrad, along the rows), k_t_dgrad (K^T for QK^T's dgrad, along the keys),
    v_dgrad (V for PV's dgrad, along dv); row_max and row_sum from the forward.

    debug also returns [G, R, sk] tensors: "score_grad" (dS) and "score_grad_q" (along the
    keys) from the dQ kernel; "probs", "score_grad_2" (P and dS as the dK/dV kernel recomputes
    them), "probs_rows_q" and "score_grad_rows_q" (quantized along the rows) from the dK/dV
    kernel."""
    (q, k_t, q_wgrad, k_t_dgrad, v_dgrad, grad_out_dgrad, grad_out_wgrad) = operands(
        sq, q=q, k_t=k_t, q_wgrad=q_wgrad, k_t_dgrad=k_t_dgrad, v_dgrad=v_dgrad,
        grad_out_dgrad=grad_out_dgrad, grad_out_wgrad=grad_out_wgrad)
    g, rows, d = q.shape
    sk, dv = k_t.size(2), v_dgrad.size(2)
    common = dict(CAUSAL=bool(causal), SKIP=bool(causal and skip_masked_tiles), DEBUG=debug)
    ds_keys = _slot_constants(formats.score_grad, formats.qk_scale_mode)
    ds_rows = _slot_constants(formats.score_grad_rows, formats.qk_scale_mode)
    p_rows = _slot_constants(formats.probs_rows, formats.pv_scale_mode)
    scale = float(softmax_scale)
    delta = torch.empty(g, rows, dtype=torch.float32, device=q.device)
    grad_q = torch.empty_like(q)
    grad_k_t = torch.empty_like(k_t)
    grad_v = torch.empty_like(v_dgrad)
    dbg = _debug_tensors(("score_grad", "score_grad_q", "probs", "score_grad_2", "probs_rows_q",
                          "score_grad_rows_q"), q, rows, sk, debug)
    query_tile, key_tile = launch_tile(BACKWARD_QUERY_TILE), launch_tile(BACKWARD_KEY_TILE)
    _backward_query_kernel[(triton.cdiv(rows, query_tile[0]), g)](
        _bits(q), _bits(k_t), _bits(k_t_dgrad), _bits(v_dgrad), _bits(grad_out_dgrad),
        row_max, row_sum, delta, _bits(grad_q), _bits(dbg["score_grad"]),
        _bits(dbg["score_grad_q"]), scale, rows, sq, sk, d, dv, DS_FMT=ds_keys, **common,
        **_launch_options(q.dtype, d, dv, query_tile))
    _backward_key_kernel[(triton.cdiv(sk, key_tile[1]), g)](
        _bits(q), _bits(q_wgrad), _bits(k_t), _bits(v_dgrad), _bits(grad_out_dgrad),
        _bits(grad_out_wgrad), row_max, row_sum, delta, _bits(grad_k_t), _bits(grad_v),
        _bits(dbg["probs"]), _bits(dbg["probs_rows_q"]), _bits(dbg["score_grad_2"]),
        _bits(dbg["score_grad_rows_q"]), scale, rows, sq, sk, d, dv, P_FMT=p_rows,
        DS_FMT=ds_rows, **common, **_launch_options(q.dtype, d, dv, key_tile))
    return BackwardResult(grad_q, grad_k_t, grad_v, delta, dbg if debug else {})


# ---------------------------------------------------------------------------------------------
# Autograd and dispatch
# ---------------------------------------------------------------------------------------------

class TritonQuantizedAttention(torch.autograd.Function):
    """out = attention(q, k_t, v) in the grouped layout with the QK^T and PV GEMMs quantized:
    the whole-tensor operands by `quantize` (the caller's single definition of its GEMM slots),
    P and dS inside the kernels in `formats`.

    apply(q, k_t, v, quantize, formats, softmax_scale, causal, sq, skip_masked_tiles=True)

    Saves the high-precision q, k_t, v and the softmax row statistics; backward quantizes the
    operands its GEMMs need (again, for the forward's Q and K^T: their slots must be
    reproducible) and runs the two backward kernels."""

    @staticmethod
    def forward(ctx, q, k_t, v, quantize: OperandQuantizer, formats: TileFormats,
                softmax_scale: float, causal: bool, sq: int, skip_masked_tiles: bool = True):
        q_f, k_f = _fprop_scores_operands(quantize, q, k_t)
        v_f = quantize("pv", "fprop", "b", "b", v, 1)
        result = attention_forward(q_f, k_f, v_f, formats, softmax_scale, causal, sq,
                                   skip_masked_tiles)
        ctx.save_for_backward(q, k_t, v, result.row_max, result.row_sum)
        ctx.quantize, ctx.formats = quantize, formats
        ctx.settings = (softmax_scale, causal, sq, skip_masked_tiles)
        return result.out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_t, v, row_max, row_sum = ctx.saved_tensors
        quantize = ctx.quantize
        q_f, k_f = _fprop_scores_operands(quantize, q, k_t)
        grads = attention_backward(
            quantize("pv", "dgrad", "grad_output", "a", grad_out, 2),
            quantize("pv", "wgrad", "grad_output", "b", grad_out, 1),
            q_f, quantize("qk", "wgrad", "a", "a", q, 1), k_f,
            quantize("qk", "dgrad", "b", "b", k_t, 2), quantize("pv", "dgrad", "b", "b", v, 2),
            row_max, row_sum, ctx.formats, *ctx.settings)
        return grads.grad_q, grads.grad_k_t, grads.grad_v, None, None, None, None, None, None


def _fprop_scores_operands(quantize: OperandQuantizer, q, k_t):
    """Q and K^T as QK^T's fprop quantizes them (Q along d, K^T along d)."""
    return quantize("qk", "fprop", "a", "a", q, 2), quantize("qk", "fprop", "b", "b", k_t, 1)


def _tile_slot_reason(config, gemm: str, side: str) -> Optional[str]:
    fmt = getattr(getattr(config, gemm), side)
    if fmt == "none":
        return None
    if format_info(fmt).kind != "mx":
        return f"{gemm}.{side} format {fmt!r} (the kernels quantize P and dS in MX formats only)"
    if config.stochastic_slot(gemm, side, fmt):
        return f"stochastic rounding of {gemm}.{side} (P and dS are rounded to nearest)"
    if config.tensor_scaled(fmt):
        return f"{gemm}.{side} format {fmt!r} is tensor-scaled"
    return None


def unsupported_reason(qk_config, pv_config, dtype: torch.dtype, head_dim: int, value_dim: int,
                       *, mask_tensor: bool = False, observed: bool = False,
                       softmax_in_fp32: bool = True) -> Optional[str]:
    """Why the kernels cannot serve a chunked-path call (None when they can).

    qk_config, pv_config: the sites' MatmulQuantConfig. mask_tensor: an explicit attention
    mask is given (the kernels take the implicit causal mask or none). observed: an observer
    watches either site (it would need the operands). softmax_in_fp32: the softmax runs in
    fp32 (always for float32; for bf16 megatron's attention_softmax_in_fp32).

    The whole-tensor operands are the caller's to quantize, in any format; but the QK^T fprop
    operands are quantized again in backward to recompute P, so they must be reproducible
    (round to nearest and not delayed-scaled), and the PV fprop b operand is used once. The
    tile slots (P: PV fprop.a and wgrad.a; dS: QK^T dgrad.a and wgrad.b) take an MX format
    or none, round to nearest."""
    if observed:
        return "an observer watches the attention GEMMs (it needs whole operands)"
    if mask_tensor:
        return "an explicit attention mask (the kernels take the causal mask or none)"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels take bf16 and float32)"
    if dtype != torch.float32 and not softmax_in_fp32:
        return "softmax in bf16 (the kernels compute it in fp32)"
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= value_dim <= MAX_HEAD_DIM):
        return f"head dims {head_dim}, {value_dim} (the kernels take up to {MAX_HEAD_DIM})"
    if qk_config.rht.gemms or pv_config.rht.gemms:
        return "the random Hadamard transform (linear layers only)"
    if qk_config.gemm.accumulation_bits is not None or \
            pv_config.gemm.accumulation_bits is not None:
        return "a limited-precision accumulator (--quant-accumulation-bits; tl.dot sums in fp32)"
    for side in ("a", "b"):
        if not qk_config.reusable("fprop", side, getattr(qk_config.fprop, side)):
            return (f"QK^T fprop.{side} is not reproducible (stochastic or delayed scaling): "
                    f"backward recomputes P from it")
    for config, gemm, side in ((pv_config, "fprop", "a"), (pv_config, "wgrad", "a"),
                               (qk_config, "dgrad", "a"), (qk_config, "wgrad", "b")):
        reason = _tile_slot_reason(config, gemm, side)
        if reason is not None:
            return reason
    return None


def supported(qk_config, pv_config, dtype: torch.dtype, head_dim: int, value_dim: int,
              **conditions) -> bool:
    """Whether the kernels can serve the call (see unsupported_reason)."""
    return unsupported_reason(qk_config, pv_config, dtype, head_dim, value_dim,
                              **conditions) is None
