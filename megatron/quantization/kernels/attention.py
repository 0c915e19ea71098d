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
    P_fp32 = exp(x - m) * (1 / l)      m, l: the row's max of x and sum of exp(x - m) over all
                                       keys (first pass, online); 1 / l rounded once per row
                                       and kept for the backward
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

Kernels, and what each (query tile, key tile) pair costs them:
* the forward, per query tile: pass 1 over the key tiles for m and l, pass 2 for P and O.
  Computing QK^T twice is inherent to quantizing P: the MX blocks quantize the final P, which
  needs the row's m and l over every key, so no P @ V product can start before pass 1 ends
  (FlashAttention's running O, rescaled as m grows, would quantize P against a provisional
  m). 3 tile GEMMs.
* the dQ kernel, per query tile: a pass for delta (S and dP), then one for dQ (S, dP, dQ):
  5 tile GEMMs.
* the dK/dV kernel, per key tile, over the query tiles: S, dP, dV and dK: 4 tile GEMMs. Its
  tiles are [keys, rows] (S^T = K Q^T, dP^T = V dO^T), so that the quantizations along the
  rows run along the tiles' last axis like the others (see _mx_along_last).
That is 12 tile GEMMs where FlashAttention-2 runs 7; the kernels' time goes to the
elementwise work per score, not to the GEMMs: on sm_90 about 11 instructions per score for
the forward's pass 1, 28 for its pass 2, 16 and 35 for the dQ kernel's two passes and 53-58
for the dK/dV kernel (unmasked tiles, bf16, d = 64; benchmarks/kernel_code.py). An MX
quantization of a tile is some 12-16 of them (float arithmetic, bits.nearest_on_grid), exp
one ex2, the softmax's division one multiplication by the row's 1 / l. The backward
stays two deterministic kernels: one pass over the key tiles could add every key tile's part
of dQ with fp32 atomics, but their order varies from run to run and training must be
reproducible bit for bit (a resumed run equals the uninterrupted one); and the dQ pass must
know delta over all keys before its first dS anyway.
Causal masking: the forward and the dQ kernel first run over the key tiles that every row of
the query tile sees in full (no mask, no selects), then over the diagonal ones (and a key
tile past sk). The dK/dV kernel masks only the query tiles holding a row that does not see
every key of its key tile (some 16 of its ~70 instructions per score).
Operands are loaded in their dtype and fed to tl.dot as they are (pipelined into shared
memory on a GPU), and the roundings to bf16 are the GPU's conversion instruction.

What is exact:
* Every tile quantization is bit for bit eager fake_quantize(T, fmt, axis, scale_mode) of the
  kernel's own unquantized T (P along keys and rows, dS along keys and rows), tail blocks
  (sk or R not multiples of 32) included: the same arithmetic as the MX QDQ kernel
  (mx.mx_quantize_blocks: the block exponent from the bits, then bits.nearest_on_grid's exact
  float operations), and every rounding to bf16 is to nearest even (the
  GPU's conversion instruction; under the interpreter, whose conversion truncates, on the
  bits).
* The roundings of S, S * scale, P, dP, dx and dS to the input dtype sit where the chunked
  path has them. With bf16 and a power-of-two softmax scale (head dim 64 or 16) S * scale and
  dS are rounded once, after the scaling: the same numbers wherever they are at least 2**-126
  (bf16's normal range, where rounding commutes with a power-of-two scaling).
* The backward recomputes the forward's P bit for bit (same Q_q and K_q: the QK^T fprop
  operands must be quantized reproducibly, see `unsupported_reason`; the forward's m and 1 / l;
  and S, which is tile-shape independent, see "Tile configurations").
* The results do not depend on what autotuning picks (see "Tile configurations").
* Key tiles that the causal mask hides from every row of a query tile are skipped (not for a
  tile holding a row that sees no key). Their P and dS are exactly zero -- exp(-10000 - m)
  underflows to 0 once the row's max m is above about -9896 -- so skipping changes no bit
  for finite inputs whose every query row has a visible score above that (the chunked path's
  skipping makes the same assumption; skip_masked_tiles=False visits every tile).

What differs from the chunked path (summation order and transcendental functions only):
* fp32 accumulation order of every GEMM (tiles vs the BLAS's order), of the softmax sum
  (online over key tiles, rescaled by exp(m_old - m_new)) and of delta;
* exp(t) is 2**(t * log2(e)) (the product rounded to float32; 2**t is the GPU's approximate
  ex2, which flushes results below 2**-126 to zero, numpy's exp2 under the interpreter)
  instead of torch's exp, and the probabilities are
  multiplied by the row's 1 / l (torch's CPU softmax does the same, with its own sum; its CUDA
  softmax divides): each within an ulp or two of the exact softmax;
* dK and dV are rounded to the dtype once, after accumulating all query rows in fp32; the
  chunked path rounds each chunk's part to the dtype before summing the parts in fp32 (the
  unfused path rounds once, as here).
A last-bit difference in P_fp32 or S can flip a later rounding (to bf16, or to the MX grid), so
results agree with the chunked path to the rounding of the dtype, not bit for bit.

On a CUDA GPU bf16 operands are loaded as they are and multiplied by bf16 tl.dot (fp32
accumulation), fp32 ones with input_precision "ieee" (no TF32); under Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors) every tl.dot runs on the fp32 values (the interpreter cannot
multiply bf16), which are the same numbers. The kernels are compiled without floating-point
contraction, so no rounding step above is fused away.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from megatron.quantization.formats import canonical_format, format_info
from megatron.quantization.kernels import interpreter_enabled
from megatron.quantization.kernels.bits import (
    INTERPRETED, load_bits, round_bits_to_bf16, store_bits)
from megatron.quantization.kernels.mx import format_constants, mx_quantize_blocks

MAX_HEAD_DIM = 128  # largest d and dv (padded to a power of two in registers)
MASK_FILL = tl.constexpr(-10000.0)   # megatron's attention_mask_func fill
LOG2E = tl.constexpr(1.4426950408889634)     # log2(e), rounded to float32 where it is used
DTYPES = (torch.bfloat16, torch.float32)

# quantize(site, gemm, name, side, tensor, axis) -> the operand as that GEMM slot quantizes
# it (the tensor itself when the slot is "none"); site "qk" or "pv", the other arguments as
# gemm.quantize_slot takes them.
OperandQuantizer = Callable[[str, str, str, str, torch.Tensor, int], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------------------------
# On a GPU the kernels are autotuned (triton.autotune, once per head dims, dtype and
# constexprs) among the configurations below. Autotuning picks by timing, and another process
# (a resumed run) may time them differently, so it may only choose among configurations that
# give the same bits. What depends on the configuration:
# * S = Q K^T of one (row, key) is a dot product over the head dim: fp32 FMAs in k order
#   (fp32) or tensor-core steps of 16 along k (bf16), whatever the tile's rows and keys, as
#   long as one instruction family runs them: the first operand of every bf16 tl.dot has 64
#   or 128 rows and warps come in fours, so on Hopper every one is a wgmma (Ampere:
#   mma.sync). So is dP = dO V^T. The accumulations over whole rows or keys (O and dQ over
#   the keys, dK and dV over the rows) chain their k-steps in place in ascending order,
#   whatever the tile; a skipped tile would have added exact zeros.
# * m, a maximum, is exact in any order. l is not: it is summed online, rescaled at every key
#   tile, each tile's part summed by tl.sum in an order set by the register layout; so it
#   depends on the forward's key tile width and its layout (tile shape and warps). Likewise
#   delta (a tl.sum per key tile) in the dQ kernel.
# * The backward reads m and 1 / l from the forward and computes P = exp(x - m) * (1 / l)
#   element by element: the forward's P bit for bit, whatever the backward's tiles.
# So the forward and the dQ kernel take one tile shape and warp count per GPU generation and
# dtype (timed: only their pipeline stages, which move loads, not arithmetic, and a register
# cap, which moves values between registers and memory); the dK/dV kernel, which sums nothing
# but its tl.dot chains, is timed over tile shapes, warps and a register cap.
# Under Triton's interpreter (the CPU tests) nothing is timed: each kernel takes its
# INTERPRETER_TILES entry. There tl.dot is numpy's matmul, whose float32 summation order
# depends on the operands' shapes and layouts (OpenBLAS picks its kernels by size), so by
# default the three kernels multiply tiles of one shape, and the dK/dV kernel computes S and
# dP in the forward's orientation: then they recompute the forward's S, and P, bit for bit.
INTERPRETER_TILES = dict.fromkeys(("forward", "query", "key"), (64, 64))  # (rows, keys)


class TileConfig(NamedTuple):
    block_m: int        # query rows per tile (a multiple of 32: whole MX row blocks)
    block_n: int        # keys per tile (a multiple of 32)
    warps: int
    stages: int
    registers: Optional[int] = None     # a cap on registers per thread (ptxas maxnreg)

    def triton(self) -> "triton.Config":
        cap = {"maxnreg": self.registers} if self.registers else {}
        return triton.Config({"BLOCK_M_": self.block_m, "BLOCK_N_": self.block_n},
                             num_warps=self.warps, num_stages=self.stages, **cap)

    @classmethod
    def of(cls, config: "triton.Config") -> "TileConfig":
        return cls(config.kwargs["BLOCK_M_"], config.kwargs["BLOCK_N_"], config.num_warps,
                   config.num_stages, getattr(config, "maxnreg", None))


# The figures below are sm_90 compilations (ptxas registers and spills, SASS instructions
# per tile element) at d = 64 and 128, causal, MXFP8.
# (rows, keys, warps) of the forward and the dQ kernel by (compute capability major, dtype),
# major 0 for any other GPU. Hopper: 128 x 64 with 8 warps, each warp 16 whole rows (row
# reductions stay in a warp; 64-row tiles on 8 warps would hold every element twice) and 32
# elements per thread: 170-250 registers, no spill. fp32 multiplies with FMAs and spills
# whatever the tile: small tiles, 8 warps.
ROW_TILES = MappingProxyType({
    (9, torch.bfloat16): (128, 64, 8),
    (0, torch.bfloat16): (64, 64, 4),
    (0, torch.float32): (64, 64, 8),
})
ROW_STAGES = MappingProxyType({torch.bfloat16: (2, 3), torch.float32: (1,)})
# (rows, keys, warps) the dK/dV kernel is timed over, by dtype and head dim (up to 64 or
# 128): its tiles are [keys, rows], 128 keys for 8 warps (each warp 16 whole keys), and it
# holds dK and dV besides, so fewer rows: 53-63 instructions per score (70-80 on masked tiles),
# 148-245 registers, no spill (4 warps leave room for three blocks per SM, 8 warps for one, two
# under the cap below; at d = 128 the 4-warp tile spills, so it is no candidate there).
# Its loads sit in a conditional (the skipped tiles) and are not pipelined: one stage.
KEY_TILES = MappingProxyType({
    (torch.bfloat16, 64): ((32, 64, 4), (32, 128, 8), (64, 128, 8)),
    (torch.bfloat16, 128): ((32, 128, 8),),
    (torch.float32, 64): ((32, 64, 8),),
    (torch.float32, 128): ((32, 64, 8),),
})


# Tiles also timed with a cap of 128 registers per thread on Hopper at d <= 64, where the cap
# costs no spill (the compile test checks it): two blocks per SM, 16 warps instead of 8, to
# hide the latency of the conversions and exponentials. A cap changes the register
# allocation, never the arithmetic. (The dQ kernel and the other tiles spill under it.)
TWO_BLOCKS_PER_SM = MappingProxyType({"forward": (128, 64, 8), "key": (32, 128, 8)})
CAN_CAP_REGISTERS = "maxnreg" in inspect.signature(triton.Config).parameters  # Triton >= 3.0


def tile_configs(kernel: str, capability: Tuple[int, int], dtype: torch.dtype,
                 head_dim: int) -> List[TileConfig]:
    """The configurations `kernel` ("forward", "query" or "key") is timed over on a GPU of
    compute capability `capability`, for operands of `dtype` and the larger head dim."""
    if kernel in ("forward", "query"):
        major = capability[0] if (capability[0], dtype) in ROW_TILES else 0
        configs = [TileConfig(*ROW_TILES[(major, dtype)], s) for s in ROW_STAGES[dtype]]
    else:
        configs = [TileConfig(*tile, 1)
                   for tile in KEY_TILES[(dtype, 64 if head_dim <= 64 else 128)]]
    if capability[0] == 9 and dtype == torch.bfloat16 and head_dim <= 64 and CAN_CAP_REGISTERS:
        configs += [c._replace(registers=128) for c in configs
                    if c[:3] == TWO_BLOCKS_PER_SM.get(kernel)]
    return configs


def _autotuned(kernel, name: str, formats: Tuple[str, ...]):
    """kernel autotuned among tile_configs(name, ...) of the launch's device, dtype and head
    dims; the kernel itself under the interpreter (launched with INTERPRETER_TILES)."""
    if interpreter_enabled():
        return kernel
    every = {c: None for (major, dtype) in ROW_TILES for head_dim in (64, 128)
             for c in tile_configs(name, (major, 0), dtype, head_dim)}

    def prune(configs, named_args, **kwargs):
        q = named_args["q_ptr"]
        wanted = tile_configs(name, torch.cuda.get_device_capability(q.device), q.dtype,
                              max(kwargs["BLOCK_D"], kwargs["BLOCK_DV"]))
        return [c for c in configs if TileConfig.of(c) in wanted]

    return triton.autotune([c.triton() for c in every],
                           key=["D", "DV", "CAUSAL", "SKIP", "IS_BF16", "POW2_SCALE", "DEBUG",
                                *formats],
                           prune_configs_by={"early_config_prune": prune})(kernel)


# ---------------------------------------------------------------------------------------------
# Tile building blocks
# ---------------------------------------------------------------------------------------------

@triton.jit
def _round_to_dtype(x, IS_BF16: tl.constexpr):
    """x (float32) rounded to the input dtype to nearest even and kept in float32 (float32: x
    itself). On a GPU the conversion instruction; the interpreter's conversion truncates, so
    there the bits are rounded (NaN stays NaN)."""
    if IS_BF16:
        if INTERPRETED:
            x = round_bits_to_bf16(x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _operand(x, IS_BF16: tl.constexpr):
    """x (float32) rounded to the input dtype as a tl.dot operand: on a GPU in that dtype (one
    conversion), under the interpreter in float32 (it cannot multiply bf16)."""
    if IS_BF16 and not INTERPRETED:
        x = x.to(tl.bfloat16)
    else:
        x = _round_to_dtype(x, IS_BF16)
    return x


@triton.jit
def _load(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols, IS_BF16: tl.constexpr):
    """The tile [rows, cols] of a matrix at ptr with the given strides, in its dtype (zeros
    outside [n_rows, n_cols)): a tl.dot operand as it is on a GPU (loaded straight into shared
    memory, pipelined); under the interpreter widened to float32 (exact)."""
    offs = rows[:, None] * row_stride + cols[None, :] * col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if INTERPRETED:     # read as bits: the interpreter's conversions mishandle subnormals
        x = load_bits(ptr, offs, mask, IS_BF16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _store(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols, x, IS_BF16: tl.constexpr):
    """Store the float32 tile x at [rows, cols], rounded to the tensor's dtype (nearest even:
    the store's conversion on a GPU, the bits under the interpreter)."""
    offs = rows[:, None] * row_stride + cols[None, :] * col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if INTERPRETED:
        store_bits(ptr, offs, mask, x.to(tl.int32, bitcast=True), IS_BF16)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _mx_along_last(x, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr):
    """x [ROWS, COLS] (input-dtype values in float32) MX quantize-dequantized in blocks of 32
    consecutive elements along the last axis: eager fake_quantize along that axis before its
    rounding to the dtype (the caller's _operand or _round_to_dtype). FMT = (enabled, EMAX,
    EMIN, MBITS, TOP_SIG, BUMP_ABOVE); x itself when not enabled. Elements outside the tensor
    must be zero (they pad a short tail block).

    The blocks run along the last axis of a tl.dot result, in which a GPU thread holds 2
    adjacent elements of every 8 and the 4 threads of a quad share a row: a block is 8
    registers in each of 4 threads, its maximum 7 register maxima and 2 shuffles, and the
    reshapes relabel registers (no data moves). Along the first axis a block of 32 would
    span two warps (16 rows each) and its maximum go through shared memory: so the dK/dV
    kernel computes its tiles as [keys, rows]."""
    if FMT[0]:
        blocks = tl.reshape(x.to(tl.int32, bitcast=True), (ROWS * COLS // 32, 32))
        res = mx_quantize_blocks(blocks, 0, FMT[1], FMT[2], FMT[3], FMT[4], FMT[5], False)
        x = tl.reshape(res, (ROWS, COLS)).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _scaled_scores(s, scale, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr):
    """x = float(dtype(dtype(S) * scale)) from the fp32 products S; see _scaled_once."""
    return _scaled_once(s, scale, IS_BF16, POW2_SCALE)


@triton.jit
def _scaled_once(t, scale, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr):
    """dtype(dtype(t) * scale) in float32. With a power-of-two scale (POW2_SCALE) one rounding,
    dtype(t * scale): the same number wherever |t * scale| >= 2**-126 (bf16's normal range,
    the same as float32's, in which rounding commutes with scaling by a power of two and
    dtype(t) * scale is a bf16 value) and dtype(t) is finite; below, where bf16 is subnormal,
    the two roundings may differ in the last bit of a number under 2**-126. One conversion
    less per score."""
    if POW2_SCALE:
        t = _round_to_dtype(t * scale, IS_BF16)
    else:
        t = _round_to_dtype(_round_to_dtype(t, IS_BF16) * scale, IS_BF16)
    return t


@triton.jit
def _exp(t):
    """exp(t) in float32 as 2**(t * log2(e)): on a GPU the approximate ex2 instruction,
    flushing results below 2**-126 to zero (ex2.approx.ftz: one instruction, where the
    subnormal-preserving variant takes five; a probability below 2**-126 adds nothing to l
    beside its largest term, 1, and less than 2**-126 * |V| to any output)."""
    return tl.math.exp2(t * LOG2E)


@triton.jit
def _reciprocal(l):
    """1 / l, rounded to nearest (IEEE division, once per row)."""
    return tl.math.div_rn(tl.full(l.shape, 1.0, tl.float32), l)


@triton.jit
def _probs32(x, m, inv_l):
    """The fp32 softmax exp(x - m) * (1 / l): one multiplication per element, where a division
    costs some ten instructions; m and 1 / l broadcast like x."""
    return _exp(x - m) * inv_l


@triton.jit
def _score_grad(dx, scale, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr):
    """dS from the softmax backward's fp32 dx (zero where hidden): the backward of the
    .float() cast (round to the dtype) and of * scale (round again); see _scaled_once."""
    return _scaled_once(dx, scale, IS_BF16, POW2_SCALE)


@triton.jit
def _last_key_seen_by_all(last_visible, row_ok, SK):
    """The last key that every row of a query tile sees (rows past R see them all)."""
    return tl.min(tl.where(row_ok, last_visible, SK), axis=0)


@triton.jit
def _key_ranges(rows, last_visible, R, SK, BLOCK_N_: tl.constexpr, CAUSAL: tl.constexpr,
                SKIP: tl.constexpr):
    """(full, end) for a query tile: the key tiles below `full` lie inside sk and every row
    of the tile sees all their keys (no masking); those from `full` to `end` are masked.
    `end` is past the last key any row sees, or sk when some row sees none (its
    probabilities spread over every key) or when not SKIP."""
    row_ok = rows < R
    if CAUSAL:
        seen_by_all = _last_key_seen_by_all(last_visible, row_ok, SK) + 1
        full = tl.minimum(tl.maximum(seen_by_all, 0), SK) // BLOCK_N_ * BLOCK_N_
        reach = tl.max(tl.where(row_ok, last_visible + 1, 0), axis=0)
        blind = tl.max((row_ok & (last_visible < 0)).to(tl.int32), axis=0)
        end = tl.where((blind == 0) & SKIP, tl.minimum(reach, SK), SK)
    else:
        full = SK // BLOCK_N_ * BLOCK_N_
        end = SK
    return full, end


@triton.jit
def _key_tile_scores(q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED: tl.constexpr,
                     CAUSAL: tl.constexpr, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_N_: tl.constexpr):
    """(cols, x): the keys n0 .. n0 + BLOCK_N_ - 1 and x [rows, keys] of the query tile q with
    that key tile of K^T (see _scaled_scores); MASKED: -10000 where the causal mask hides the
    key, -inf past the last key (outside the softmax)."""
    cols = n0 + tl.arange(0, BLOCK_N_)
    kt = _load(kt_ptr, dims, cols, SK, 1, D, SK, IS_BF16)
    x = _scaled_scores(tl.dot(q, kt, input_precision=PRECISION), scale, IS_BF16, POW2_SCALE)
    if MASKED:
        if CAUSAL:
            x = tl.where(cols[None, :] > last_visible[:, None], MASK_FILL, x)
        x = tl.where(cols[None, :] < SK, x, float("-inf"))
    return cols, x


@triton.jit
def _row_hidden(cols, last_visible, SK, CAUSAL: tl.constexpr):
    """[rows, keys]: where the mask hides the key, or it is past the last key."""
    hidden = cols[None, :] >= SK
    if CAUSAL:
        hidden = hidden | (cols[None, :] > last_visible[:, None])
    return hidden


@triton.jit
def _positions(m0, SQ, BLOCK_M_: tl.constexpr):
    """rows % sq of the rows m0 .. m0 + BLOCK_M_ - 1: one scalar remainder and a select per row
    when the tile spans at most two heads (a remainder is some 20 instructions, and the tiles
    of the dK/dV kernel would take one per row of each thread's part of the tile)."""
    pos = m0 % SQ + tl.arange(0, BLOCK_M_)
    if SQ >= BLOCK_M_:
        pos = tl.where(pos >= SQ, pos - SQ, pos)
    else:
        pos = pos % SQ
    return pos


@triton.jit
def _tile_needed(last_visible, row_ok, first_key, LIMIT: tl.constexpr):
    """Whether a query tile adds to a key tile's dK and dV: unless some row sees a key of the
    tile or sees no key at all (spread over every key), its P and dS there are zero."""
    seen = tl.max((row_ok & ((last_visible >= first_key) | (last_visible < 0))).to(tl.int32),
                  axis=0)
    return (seen > 0) | (not LIMIT)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _stats_step(m, l, q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_N_: tl.constexpr):
    """The forward's pass 1 over one key tile: m and l updated (online)."""
    cols, x = _key_tile_scores(q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED, CAUSAL,
                               IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    m_new = tl.maximum(m, tl.max(x, axis=1))
    l = l * _exp(m - m_new) + tl.sum(_exp(x - m_new[:, None]), axis=1)
    return m_new, l


@triton.jit
def _output_step(acc, q, kt_ptr, v_ptr, p_dbg, pq_dbg, n0, rows, dims, vdims, last_visible, m,
                 inv_l, scale, R, SK, D, DV, P_FMT: tl.constexpr, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr,
                 PRECISION: tl.constexpr, DEBUG: tl.constexpr, BLOCK_M_: tl.constexpr,
                 BLOCK_N_: tl.constexpr):
    """The forward's pass 2 over one key tile: acc += MX_keys(P) @ V."""
    cols, x = _key_tile_scores(q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED, CAUSAL,
                               IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    p = _round_to_dtype(_probs32(x, m[:, None], inv_l[:, None]), IS_BF16)
    pq = _mx_along_last(p, BLOCK_M_, BLOCK_N_, P_FMT)
    v = _load(v_ptr, cols, vdims, DV, 1, SK, DV, IS_BF16)
    acc = tl.dot(_operand(pq, IS_BF16), v, acc, input_precision=PRECISION)
    if DEBUG:
        _store(p_dbg, rows, cols, SK, 1, R, SK, p, IS_BF16)
        _store(pq_dbg, rows, cols, SK, 1, R, SK, pq, IS_BF16)
    return acc


@triton.jit
def _forward_kernel(q_ptr, kt_ptr, v_ptr, out_ptr, m_ptr, inv_l_ptr, p_dbg, pq_dbg, scale, R, SQ,
                    SK, D, DV, P_FMT: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
                    IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                    DEBUG: tl.constexpr, BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per query tile: out = MX_keys(P) @ V and the rows' softmax statistics m and 1 / l."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M_ + tl.arange(0, BLOCK_M_)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    kt_ptr += g * D * SK
    v_ptr += g * SK * DV
    p_dbg += g * R * SK
    pq_dbg += g * R * SK
    q = _load(q_ptr + g * R * D, rows, dims, D, 1, R, D, IS_BF16)
    last_visible = rows % SQ + (SK - SQ)        # the last key each row sees (negative: none)
    full, end = _key_ranges(rows, last_visible, R, SK, BLOCK_N_, CAUSAL, SKIP)

    # Pass 1: each row's max of x and sum of exp(x - max) over the keys it may see.
    m = tl.full((BLOCK_M_,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M_,), tl.float32)
    for n0 in range(0, full, BLOCK_N_):
        m, l = _stats_step(m, l, q, kt_ptr, n0, dims, last_visible, scale, SK, D, False, CAUSAL,
                           IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    for n0 in range(full, end, BLOCK_N_):
        m, l = _stats_step(m, l, q, kt_ptr, n0, dims, last_visible, scale, SK, D, True, CAUSAL,
                           IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)

    # Pass 2: the exact probabilities, rounded and quantized, times V.
    inv_l = _reciprocal(l)
    acc = tl.zeros((BLOCK_M_, BLOCK_DV), tl.float32)
    for n0 in range(0, full, BLOCK_N_):
        acc = _output_step(acc, q, kt_ptr, v_ptr, p_dbg, pq_dbg, n0, rows, dims, vdims,
                           last_visible, m, inv_l, scale, R, SK, D, DV, P_FMT, False, CAUSAL,
                           IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_, BLOCK_N_)
    for n0 in range(full, end, BLOCK_N_):
        acc = _output_step(acc, q, kt_ptr, v_ptr, p_dbg, pq_dbg, n0, rows, dims, vdims,
                           last_visible, m, inv_l, scale, R, SK, D, DV, P_FMT, True, CAUSAL,
                           IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_, BLOCK_N_)

    _store(out_ptr + g * R * DV, rows, vdims, DV, 1, R, DV, acc, IS_BF16)
    row_ok = rows < R
    tl.store(m_ptr + g * R + rows, m, mask=row_ok)
    tl.store(inv_l_ptr + g * R + rows, inv_l, mask=row_ok)


@triton.jit
def _delta_step(q, do, kt_ptr, vd_ptr, n0, dims, vdims, last_visible, m, inv_l, scale, SK, D, DV,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, IS_BF16: tl.constexpr,
                POW2_SCALE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N_: tl.constexpr):
    """One key tile's part of delta = sum_j P32_j * dP_j."""
    cols, x = _key_tile_scores(q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED, CAUSAL,
                               IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    vt = _load(vd_ptr, vdims, cols, 1, DV, DV, SK, IS_BF16)
    dp = _round_to_dtype(tl.dot(do, vt, input_precision=PRECISION), IS_BF16)
    return tl.sum(_probs32(x, m[:, None], inv_l[:, None]) * dp, axis=1)


@triton.jit
def _query_grad_step(dq, q, do, kt_ptr, kd_ptr, vd_ptr, ds_dbg, dsq_dbg, n0, rows, dims, vdims,
                     last_visible, m, inv_l, delta, scale, R, SK, D, DV, DS_FMT: tl.constexpr,
                     MASKED: tl.constexpr, CAUSAL: tl.constexpr, IS_BF16: tl.constexpr,
                     POW2_SCALE: tl.constexpr, PRECISION: tl.constexpr, DEBUG: tl.constexpr,
                     BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr):
    """One key tile's part of dQ: dq += MX_keys(dS) @ K."""
    cols, x = _key_tile_scores(q, kt_ptr, n0, dims, last_visible, scale, SK, D, MASKED, CAUSAL,
                               IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    vt = _load(vd_ptr, vdims, cols, 1, DV, DV, SK, IS_BF16)
    dp = _round_to_dtype(tl.dot(do, vt, input_precision=PRECISION), IS_BF16)
    dx = _probs32(x, m[:, None], inv_l[:, None]) * (dp - delta[:, None])
    if MASKED:
        dx = tl.where(_row_hidden(cols, last_visible, SK, CAUSAL), 0.0, dx)
    ds = _score_grad(dx, scale, IS_BF16, POW2_SCALE)
    dsq = _mx_along_last(ds, BLOCK_M_, BLOCK_N_, DS_FMT)
    k = _load(kd_ptr, cols, dims, 1, SK, SK, D, IS_BF16)
    dq = tl.dot(_operand(dsq, IS_BF16), k, dq, input_precision=PRECISION)
    if DEBUG:
        _store(ds_dbg, rows, cols, SK, 1, R, SK, ds, IS_BF16)
        _store(dsq_dbg, rows, cols, SK, 1, R, SK, dsq, IS_BF16)
    return dq


@triton.jit
def _backward_query_kernel(q_ptr, kt_ptr, kd_ptr, vd_ptr, do_ptr, m_ptr, inv_l_ptr, delta_ptr,
                           dq_ptr, ds_dbg, dsq_dbg, scale, R, SQ, SK, D, DV, DS_FMT: tl.constexpr,
                           CAUSAL: tl.constexpr, SKIP: tl.constexpr, IS_BF16: tl.constexpr,
                           POW2_SCALE: tl.constexpr, PRECISION: tl.constexpr, DEBUG: tl.constexpr,
                           BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr):
    """Per query tile: delta over all keys, then dQ = MX_keys(dS) @ K."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M_ + tl.arange(0, BLOCK_M_)
    row_ok = rows < R
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    kt_ptr += g * D * SK
    kd_ptr += g * D * SK
    vd_ptr += g * SK * DV
    ds_dbg += g * R * SK
    dsq_dbg += g * R * SK
    q = _load(q_ptr + g * R * D, rows, dims, D, 1, R, D, IS_BF16)
    do = _load(do_ptr + g * R * DV, rows, vdims, DV, 1, R, DV, IS_BF16)
    m = tl.load(m_ptr + g * R + rows, mask=row_ok, other=0.0)
    inv_l = tl.load(inv_l_ptr + g * R + rows, mask=row_ok, other=1.0)
    last_visible = rows % SQ + (SK - SQ)
    full, end = _key_ranges(rows, last_visible, R, SK, BLOCK_N_, CAUSAL, SKIP)

    delta = tl.zeros((BLOCK_M_,), tl.float32)
    for n0 in range(0, full, BLOCK_N_):
        delta += _delta_step(q, do, kt_ptr, vd_ptr, n0, dims, vdims, last_visible, m, inv_l, scale,
                             SK, D, DV, False, CAUSAL, IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)
    for n0 in range(full, end, BLOCK_N_):
        delta += _delta_step(q, do, kt_ptr, vd_ptr, n0, dims, vdims, last_visible, m, inv_l, scale,
                             SK, D, DV, True, CAUSAL, IS_BF16, POW2_SCALE, PRECISION, BLOCK_N_)

    dq = tl.zeros((BLOCK_M_, BLOCK_D), tl.float32)
    for n0 in range(0, full, BLOCK_N_):
        dq = _query_grad_step(dq, q, do, kt_ptr, kd_ptr, vd_ptr, ds_dbg, dsq_dbg, n0, rows, dims,
                              vdims, last_visible, m, inv_l, delta, scale, R, SK, D, DV, DS_FMT,
                              False, CAUSAL, IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_,
                              BLOCK_N_)
    for n0 in range(full, end, BLOCK_N_):
        dq = _query_grad_step(dq, q, do, kt_ptr, kd_ptr, vd_ptr, ds_dbg, dsq_dbg, n0, rows, dims,
                              vdims, last_visible, m, inv_l, delta, scale, R, SK, D, DV, DS_FMT,
                              True, CAUSAL, IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_,
                              BLOCK_N_)

    _store(dq_ptr + g * R * D, rows, dims, D, 1, R, D, dq, IS_BF16)
    tl.store(delta_ptr + g * R + rows, delta, mask=row_ok)


@triton.jit
def _key_step(dk, dv, k_tile, v_tile, q_ptr, qw_ptr, do_ptr, dow_ptr, m_ptr, inv_l_ptr, delta_ptr,
              p_dbg, pq_dbg, ds_dbg, dsq_dbg, rows, cols, last_visible, dims, vdims, scale, R, SK,
              D, DV, P_FMT: tl.constexpr, DS_FMT: tl.constexpr, MASKED: tl.constexpr,
              IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr, PRECISION: tl.constexpr,
              DEBUG: tl.constexpr, BLOCK_M_: tl.constexpr, BLOCK_N_: tl.constexpr):
    """One query tile's part of dV = MX_rows(P)^T @ dO and dK = MX_rows(dS)^T @ Q, with the
    tiles as [keys, rows] (k_tile, v_tile: K and V as [keys, d] on a GPU, K^T and V^T as
    [d, keys] under the interpreter). MASKED: the causal mask hides some key from some row."""
    row_ok = rows < R
    q = _load(q_ptr, rows, dims, D, 1, R, D, IS_BF16)
    # Rows past R get m = +inf: P, and so dS, is exactly zero there, the padding their row
    # blocks need, without a select per element.
    m = tl.load(m_ptr + rows, mask=row_ok, other=float("inf"))
    inv_l = tl.load(inv_l_ptr + rows, mask=row_ok, other=1.0)
    if INTERPRETED:
        s_t = tl.trans(tl.dot(q, k_tile, input_precision=PRECISION))
    else:
        s_t = tl.dot(k_tile, tl.trans(q), input_precision=PRECISION)
    x_t = _scaled_scores(s_t, scale, IS_BF16, POW2_SCALE)
    if MASKED:
        hidden_t = cols[:, None] > last_visible[None, :]
        x_t = tl.where(hidden_t, MASK_FILL, x_t)
    # Keys past sk need no mask here: their rows of the [keys, rows] tiles are never stored.
    p32_t = _probs32(x_t, m[None, :], inv_l[None, :])
    # dV before dP: fewer [keys, rows] tiles live at once (registers).
    p_t = _round_to_dtype(p32_t, IS_BF16)
    pq_t = _mx_along_last(p_t, BLOCK_N_, BLOCK_M_, P_FMT)
    dow = _load(dow_ptr, rows, vdims, DV, 1, R, DV, IS_BF16)
    dv = tl.dot(_operand(pq_t, IS_BF16), dow, dv, input_precision=PRECISION)

    do = _load(do_ptr, rows, vdims, DV, 1, R, DV, IS_BF16)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    if INTERPRETED:
        dp_t = tl.trans(tl.dot(do, v_tile, input_precision=PRECISION))
    else:
        dp_t = tl.dot(v_tile, tl.trans(do), input_precision=PRECISION)
    dx_t = p32_t * (_round_to_dtype(dp_t, IS_BF16) - delta[None, :])
    if MASKED:
        dx_t = tl.where(hidden_t, 0.0, dx_t)
    ds_t = _score_grad(dx_t, scale, IS_BF16, POW2_SCALE)
    dsq_t = _mx_along_last(ds_t, BLOCK_N_, BLOCK_M_, DS_FMT)
    qw = _load(qw_ptr, rows, dims, D, 1, R, D, IS_BF16)
    dk = tl.dot(_operand(dsq_t, IS_BF16), qw, dk, input_precision=PRECISION)
    if DEBUG:       # [keys, rows] tiles of [R, SK] tensors
        _store(p_dbg, cols, rows, 1, SK, SK, R, p_t, IS_BF16)
        _store(ds_dbg, cols, rows, 1, SK, SK, R, ds_t, IS_BF16)
        _store(pq_dbg, cols, rows, 1, SK, SK, R, pq_t, IS_BF16)
        _store(dsq_dbg, cols, rows, 1, SK, SK, R, dsq_t, IS_BF16)
    return dk, dv


@triton.jit
def _backward_key_kernel(q_ptr, qw_ptr, kt_ptr, vd_ptr, do_ptr, dow_ptr, m_ptr, inv_l_ptr,
                         delta_ptr, dkt_ptr, dv_ptr, p_dbg, pq_dbg, ds_dbg, dsq_dbg, scale, R, SQ,
                         SK, D, DV, P_FMT: tl.constexpr, DS_FMT: tl.constexpr, CAUSAL: tl.constexpr,
                         SKIP: tl.constexpr, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr,
                         PRECISION: tl.constexpr, DEBUG: tl.constexpr, BLOCK_M_: tl.constexpr,
                         BLOCK_N_: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per key tile: dV = MX_rows(P)^T @ dO_q and dK = MX_rows(dS)^T @ Q_q over all rows."""
    g = tl.program_id(1).to(tl.int64)
    first_key = tl.program_id(0) * BLOCK_N_
    cols = first_key + tl.arange(0, BLOCK_N_)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_ptr += g * R * D
    qw_ptr += g * R * D
    do_ptr += g * R * DV
    dow_ptr += g * R * DV
    m_ptr += g * R
    inv_l_ptr += g * R
    delta_ptr += g * R
    p_dbg += g * R * SK
    pq_dbg += g * R * SK
    ds_dbg += g * R * SK
    dsq_dbg += g * R * SK
    if INTERPRETED:     # the forward's K^T [d, keys] and the dQ kernel's V^T [dv, keys] tiles
        k_tile = _load(kt_ptr + g * D * SK, dims, cols, SK, 1, D, SK, IS_BF16)
        v_tile = _load(vd_ptr + g * SK * DV, vdims, cols, 1, DV, DV, SK, IS_BF16)
    else:               # K [keys, d] and V [keys, dv]: S^T and dP^T come out as [keys, rows]
        k_tile = _load(kt_ptr + g * D * SK, cols, dims, 1, SK, SK, D, IS_BF16)
        v_tile = _load(vd_ptr + g * SK * DV, cols, vdims, DV, 1, SK, DV, IS_BF16)

    dk = tl.zeros((BLOCK_N_, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N_, BLOCK_DV), tl.float32)
    for m0 in range(0, R, BLOCK_M_):
        rows = m0 + tl.arange(0, BLOCK_M_)
        last_visible = _positions(m0, SQ, BLOCK_M_) + (SK - SQ)
        if CAUSAL and _last_key_seen_by_all(last_visible, rows < R, SK) >= first_key + BLOCK_N_ - 1:
            dk, dv = _key_step(dk, dv, k_tile, v_tile, q_ptr, qw_ptr, do_ptr, dow_ptr, m_ptr,
                               inv_l_ptr, delta_ptr, p_dbg, pq_dbg, ds_dbg, dsq_dbg, rows, cols,
                               last_visible, dims, vdims, scale, R, SK, D, DV, P_FMT, DS_FMT, False,
                               IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_, BLOCK_N_)
        elif _tile_needed(last_visible, rows < R, first_key, SKIP):
            dk, dv = _key_step(dk, dv, k_tile, v_tile, q_ptr, qw_ptr, do_ptr, dow_ptr, m_ptr,
                               inv_l_ptr, delta_ptr, p_dbg, pq_dbg, ds_dbg, dsq_dbg, rows, cols,
                               last_visible, dims, vdims, scale, R, SK, D, DV, P_FMT, DS_FMT,
                               CAUSAL, IS_BF16, POW2_SCALE, PRECISION, DEBUG, BLOCK_M_, BLOCK_N_)

    # dK^T [D, SK] is the transpose of the dK tile [keys, D].
    _store(dkt_ptr + g * D * SK, cols, dims, 1, SK, SK, D, dk, IS_BF16)
    _store(dv_ptr + g * SK * DV, cols, vdims, DV, 1, SK, DV, dv, IS_BF16)


_forward_kernel = _autotuned(_forward_kernel, "forward", ("P_FMT",))
_backward_query_kernel = _autotuned(_backward_query_kernel, "query", ("DS_FMT",))
_backward_key_kernel = _autotuned(_backward_key_kernel, "key", ("P_FMT", "DS_FMT"))


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
    """The FMT constexpr of _mx_along_last."""
    if fmt == "none":
        return (False, 0, 0, 0, 0, 0)
    c = format_constants(fmt, scale_mode)
    return (True, c["EMAX"], c["EMIN"], c["MBITS"], c["TOP_SIG"], c["BUMP_ABOVE"])


def _launch_options(dtype: torch.dtype, head_dim: int, value_dim: int, scale: float) -> dict:
    """The constexprs and compile options every launch takes (the tile comes from the
    configuration). POW2_SCALE: bf16 with a power-of-two softmax scale (d = 64: 1/8), whose
    scores are rounded once after scaling (_scaled_once)."""
    return dict(IS_BF16=dtype == torch.bfloat16,
                POW2_SCALE=dtype == torch.bfloat16 and scale > 0 and math.frexp(scale)[0] == 0.5,
                PRECISION=None if dtype == torch.bfloat16 and not INTERPRETED else "ieee",
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), enable_fp_fusion=False)


def specialisation(name: str, config: TileConfig, head_dim: int,
                   dtype: torch.dtype = torch.bfloat16, causal: bool = True,
                   fmt: Tuple[str, str] = ("mxfp8_e4m3", "rceil")) -> tuple:
    """(kernel, constexprs, argument types, compile options) of a launch of the kernel `name`
    ("forward", "query" or "key") with tile configuration `config`, d = dv = head_dim, the
    softmax scale 1/sqrt(head_dim) and every tile slot in MX format `fmt` (format, scale
    rule), as training launches it: what kernels/offline.py compiles for a GPU that is not
    here."""
    slot = _slot_constants(*fmt)
    kernel, slots = {"forward": (_forward_kernel, {"P_FMT": slot}),
                     "query": (_backward_query_kernel, {"DS_FMT": slot}),
                     "key": (_backward_key_kernel, {"P_FMT": slot, "DS_FMT": slot})}[name]
    constants = _launch_options(dtype, head_dim, head_dim, head_dim ** -0.5)
    options = dict(num_warps=config.warps, num_stages=config.stages,
                   enable_fp_fusion=constants.pop("enable_fp_fusion"))
    if config.registers:
        options["maxnreg"] = config.registers
    constants.update(slots, CAUSAL=causal, SKIP=causal, DEBUG=False, BLOCK_M_=config.block_m,
                     BLOCK_N_=config.block_n)
    types = {"*_ptr": "*bf16" if dtype == torch.bfloat16 else "*fp32", "m_ptr": "*fp32",
             "inv_l_ptr": "*fp32", "delta_ptr": "*fp32", "scale": "fp32"}
    return kernel, constants, types, options


def _launch(kernel, name: str, grid: Callable[[int, int], tuple], args: list, constexprs: dict):
    """kernel[grid(rows per tile, keys per tile)](*args): autotuned on a GPU, with
    INTERPRETER_TILES[name] under the interpreter."""
    if interpreter_enabled():
        block_m, block_n = INTERPRETER_TILES[name]
        kernel[grid(block_m, block_n)](*args, **constexprs, BLOCK_M_=block_m, BLOCK_N_=block_n)
    else:
        kernel[lambda meta: grid(meta["BLOCK_M_"], meta["BLOCK_N_"])](*args, **constexprs)


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
    inv_row_sum: torch.Tensor       # [G, R] float32: 1 / sum_j exp(x_ij - max)
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
    inv_row_sum = torch.empty_like(row_max)
    dbg = _debug_tensors(("probs", "probs_q"), q, rows, sk, debug)
    _launch(_forward_kernel, "forward", lambda block_m, _: (triton.cdiv(rows, block_m), g),
            [q, k_t, v, out, row_max, inv_row_sum, dbg["probs"], dbg["probs_q"],
             float(softmax_scale), rows, sq, sk, d, dv],
            dict(P_FMT=_slot_constants(formats.probs, formats.pv_scale_mode),
                 CAUSAL=bool(causal), SKIP=bool(causal and skip_masked_tiles), DEBUG=debug,
                 **_launch_options(q.dtype, d, dv, float(softmax_scale))))
    return ForwardResult(out, row_max, inv_row_sum, dbg if debug else {})


def attention_backward(grad_out_dgrad: torch.Tensor, grad_out_wgrad: torch.Tensor,
                       q: torch.Tensor, q_wgrad: torch.Tensor, k_t: torch.Tensor,
                       k_t_dgrad: torch.Tensor, v_dgrad: torch.Tensor, row_max: torch.Tensor,
                       inv_row_sum: torch.Tensor, formats: TileFormats, softmax_scale: float,
                       causal: bool, sq: int, skip_masked_tiles: bool = True,
                       debug: bool = False) -> BackwardResult:
    """dQ, dK^T, dV of attention_forward from the output gradient, on operands quantized by
    the caller: grad_out_dgrad (dO for PV's dgrad, along dv), grad_out_wgrad (dO for PV's wgrad,
    along the rows), q and k_t (the forward's QK^T fprop operands, to recompute P), q_wgrad (Q
    for QK^T's wgrad, along the rows), k_t_dgrad (K^T for QK^T's dgrad, along the keys),
    v_dgrad (V for PV's dgrad, along dv); row_max and inv_row_sum from the forward.

    debug also returns [G, R, sk] tensors: "score_grad" (dS) and "score_grad_q" (along the
    keys) from the dQ kernel; "probs", "score_grad_2" (P and dS as the dK/dV kernel recomputes
    them), "probs_rows_q" and "score_grad_rows_q" (quantized along the rows) from the dK/dV
    kernel."""
    (q, k_t, q_wgrad, k_t_dgrad, v_dgrad, grad_out_dgrad, grad_out_wgrad) = operands(
        sq, q=q, k_t=k_t, q_wgrad=q_wgrad, k_t_dgrad=k_t_dgrad, v_dgrad=v_dgrad,
        grad_out_dgrad=grad_out_dgrad, grad_out_wgrad=grad_out_wgrad)
    g, rows, d = q.shape
    sk, dv = k_t.size(2), v_dgrad.size(2)
    scale = float(softmax_scale)
    common = dict(CAUSAL=bool(causal), SKIP=bool(causal and skip_masked_tiles), DEBUG=debug,
                  **_launch_options(q.dtype, d, dv, scale))
    delta = torch.empty(g, rows, dtype=torch.float32, device=q.device)
    grad_q = torch.empty_like(q)
    grad_k_t = torch.empty_like(k_t)
    grad_v = torch.empty_like(v_dgrad)
    dbg = _debug_tensors(("score_grad", "score_grad_q", "probs", "score_grad_2", "probs_rows_q",
                          "score_grad_rows_q"), q, rows, sk, debug)
    _launch(_backward_query_kernel, "query", lambda block_m, _: (triton.cdiv(rows, block_m), g),
            [q, k_t, k_t_dgrad, v_dgrad, grad_out_dgrad, row_max, inv_row_sum, delta, grad_q,
             dbg["score_grad"], dbg["score_grad_q"], scale, rows, sq, sk, d, dv],
            dict(DS_FMT=_slot_constants(formats.score_grad, formats.qk_scale_mode), **common))
    _launch(_backward_key_kernel, "key", lambda _, block_n: (triton.cdiv(sk, block_n), g),
            [q, q_wgrad, k_t, v_dgrad, grad_out_dgrad, grad_out_wgrad, row_max, inv_row_sum,
             delta, grad_k_t, grad_v, dbg["probs"], dbg["probs_rows_q"], dbg["score_grad_2"],
             dbg["score_grad_rows_q"], scale, rows, sq, sk, d, dv],
            dict(P_FMT=_slot_constants(formats.probs_rows, formats.pv_scale_mode),
                 DS_FMT=_slot_constants(formats.score_grad_rows, formats.qk_scale_mode),
                 **common))
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
        ctx.save_for_backward(q, k_t, v, result.row_max, result.inv_row_sum)
        ctx.quantize, ctx.formats = quantize, formats
        ctx.settings = (softmax_scale, causal, sq, skip_masked_tiles)
        return result.out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_t, v, row_max, inv_row_sum = ctx.saved_tensors
        quantize = ctx.quantize
        q_f, k_f = _fprop_scores_operands(quantize, q, k_t)
        grads = attention_backward(
            quantize("pv", "dgrad", "grad_output", "a", grad_out, 2),
            quantize("pv", "wgrad", "grad_output", "b", grad_out, 1),
            q_f, quantize("qk", "wgrad", "a", "a", q, 1), k_f,
            quantize("qk", "dgrad", "b", "b", k_t, 2), quantize("pv", "dgrad", "b", "b", v, 2),
            row_max, inv_row_sum, ctx.formats, *ctx.settings)
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
