"""Exact building blocks of the Triton kernels: float32 bits in, float32 bits out.

They give the same bits on a GPU and under Triton's CPU interpreter. Rounding to nearest on an
element grid is float arithmetic whose every operation is exact but the one rounding wanted
(nearest_on_grid; the kernels are compiled without contraction, and Triton keeps subnormals).
Stochastic rounding compares a remainder with the noise, in integers on the bit patterns: a
value is read as sig * 2**lsb with a 24-bit integer sig, rounded to q * 2**s with a small
integer q, which `pack` turns back into float32 bits.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from megatron.quantization.formats.common import FORMAT_INFO
from megatron.quantization.kernels.environment import interpreter_enabled

# Whether the kernels run in Triton's interpreter (read once, as Triton itself reads it): its
# float -> bf16 conversion truncates, so there the stores round the bits themselves.
INTERPRETED = tl.constexpr(interpreter_enabled())


# How a program's blocks along the quantized axis lie in memory (tensor seen as [outer, length,
# inner]); axis_layout picks one per call. The loads run along contiguous memory in every one,
# so that the compiler can issue 16-byte vector loads and stores.
ROWS = 0        # inner == 1 with a short last block: blocks along rows, tails masked
FLAT = 1        # inner == 1, length a multiple of the block: the blocks tile the memory
COLUMNS = 2     # inner > 1: a program takes one block-row of GROUP_ consecutive columns


@triton.jit
def block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_: tl.constexpr,
                  SIZE: tl.constexpr, LAYOUT: tl.constexpr):
    """(offsets, mask) of this program's GROUP_ blocks of SIZE elements along the quantized
    axis, read in place whatever the axis: [GROUP_, SIZE] (one block per row) for ROWS and
    FLAT, [SIZE, GROUP_] (one block per column, consecutive columns adjacent in memory) for
    COLUMNS; as_blocks turns a loaded tile to one block per row."""
    if LAYOUT == 2:
        col_groups = (inner + GROUP_ - 1) // GROUP_
        pid = tl.program_id(0).to(tl.int64)
        row = pid // col_groups                          # (outer, block number) pair
        n = (row % blocks_per_row) * SIZE + tl.arange(0, SIZE)
        cols = (pid % col_groups) * GROUP_ + tl.arange(0, GROUP_)
        offs = ((row // blocks_per_row) * length + n)[:, None] * inner + cols[None, :]
        mask = (n < length)[:, None] & (cols < inner)[None, :]
    elif LAYOUT == 1:
        block = tl.program_id(0).to(tl.int64) * GROUP_ + tl.arange(0, GROUP_)
        offs = block[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
        mask = tl.broadcast_to((block < n_blocks)[:, None], (GROUP_, SIZE))
    else:
        block = tl.program_id(0).to(tl.int64) * GROUP_ + tl.arange(0, GROUP_)
        nb = block % blocks_per_row
        n = nb[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
        mask = (block < n_blocks)[:, None] & (n < length)
        offs = (block // blocks_per_row)[:, None] * length + n
    return offs, mask


@triton.jit
def as_blocks(tile, LAYOUT: tl.constexpr):
    """A tile loaded at block_offsets with one block per row (its own inverse)."""
    if LAYOUT == 2:
        tile = tl.trans(tile)
    return tile


@triton.jit
def tile_offsets(n_tiles, rows, cols, tiles_per_row, GROUP_: tl.constexpr, TILE: tl.constexpr):
    """(offsets, mask), each [GROUP_, TILE * TILE]: this program's GROUP_ square tiles of a
    row-major 2-D [rows, cols] tensor (tiles numbered along the rows; partial edge tiles
    masked), one tile per row of the result."""
    tile = tl.program_id(0).to(tl.int64) * GROUP_ + tl.arange(0, GROUP_)
    i = tl.arange(0, TILE * TILE)
    r = (tile // tiles_per_row)[:, None] * TILE + (i // TILE)[None, :]
    c = (tile % tiles_per_row)[:, None] * TILE + (i % TILE)[None, :]
    mask = (tile < n_tiles)[:, None] & (r < rows) & (c < cols)
    return r * cols + c, mask


@triton.jit
def load_bits(ptr, offs, mask, IS_BF16: tl.constexpr):
    """float32 bit patterns (int32) of the float32 or bf16 values at offs (bf16: its 16 bits
    are the high half). The tensors are passed as they are: the bits are read in the kernel,
    so the launch needs no reinterpreting views."""
    if IS_BF16:
        v = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        u = v.to(tl.int32) << 16
    else:
        u = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    return u


@triton.jit
def load_noise(ptr, offs, mask, STOCHASTIC: tl.constexpr):
    """The float32 bits (int32) of the uniform [0, 1) numbers of stochastic rounding at offs
    (1.0, which never rounds up, where masked); 0 for round to nearest."""
    if STOCHASTIC:
        noise = tl.load(ptr + offs, mask=mask, other=1.0).to(tl.int32, bitcast=True)
    else:
        noise = 0
    return noise


@triton.jit
def round_bits_to_bf16(bits):
    """float32 bits rounded to the nearest bf16 (ties to even; NaN stays NaN), as float32
    bits."""
    mag = bits & 0x7FFFFFFF
    rounded = ((mag + (0x7FFF + ((mag >> 16) & 1))) >> 16) << 16
    rounded = tl.where(mag > 0x7F800000, mag | 0x400000, rounded)
    return rounded | (bits & -2147483648)


@triton.jit
def store_bits(ptr, offs, mask, bits, IS_BF16: tl.constexpr):
    """Store float32 bits as float32, or rounded to bf16 (nearest even; NaN stays NaN): on a
    GPU by its conversion instruction (two values at a time, where the integer rounding takes
    some five instructions per value), under the interpreter on the bits."""
    if IS_BF16:
        if INTERPRETED:
            half = (round_bits_to_bf16(bits) >> 16).to(tl.int16)
            tl.store(ptr + offs, half.to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr + offs, bits.to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def floor_log2(mag):
    """floor(log2 |x|) of nonzero magnitudes (float32 bits without sign); subnormals read it
    from their leading bit (an exact int -> float conversion of the 23-bit mantissa)."""
    bexp = mag >> 23
    mant = mag & 0x7FFFFF
    lead = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 276
    return tl.where(bexp == 0, lead, bexp - 127)


@triton.jit
def nearest_on_grid(v, EMIN: tl.constexpr, MBITS: tl.constexpr, TOP_SIG: tl.constexpr,
                    EMAX: tl.constexpr):
    """float32 v >= 0 (Inf included; NaN gives an unspecified value the callers replace)
    rounded to nearest, ties to even, on the grid of an element format, saturated at
    max_normal = TOP_SIG * 2**(EMAX - MBITS): three float operations, exact but for the one
    rounding wanted.

    Saturating first gives the same result (max_normal is on the grid) and bounds v. The grid
    spacing at v is 2**s, s = max(floor(log2 v), EMIN) - MBITS (read from v's exponent bits; an
    fp32 subnormal reads EMIN). C = 2**(s + 23) is a normal float32 whose neighbours above are
    2**s apart, and v < 2**(s + MBITS + 1) <= C: so v + C rounds v to nearest even on the grid
    (C is an even multiple of 2**s) and (v + C) - C is exact. Needs IEEE arithmetic keeping
    subnormals (no .ftz): what Triton emits, and numpy's under the interpreter."""
    v = tl.minimum(v, TOP_SIG * 2.0 ** (EMAX - MBITS))
    exponent = tl.maximum(v.to(tl.int32, bitcast=True) >> 23, EMIN + 127)
    c = ((exponent + (23 - MBITS)) << 23).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def stochastic_round_to_grid(mag, e, noise, EMIN: tl.constexpr, MBITS: tl.constexpr,
                             TOP_SIG: tl.constexpr, EMAX: tl.constexpr):
    """Stochastically round |x| (finite float32 bits `mag`, or Inf) on the grid of an element
    format scaled by 2**e: (q, s) with the result q * 2**s (`pack`).

    The spacing at |x| is 2**s, s = max(floor(log2|x|), EMIN + e) - MBITS. |x| is saturated at
    max_normal * 2**e = TOP_SIG * 2**(EMAX - MBITS + e) first, then rounded up where
    noise < frac, frac = the distance to the lower neighbour in units of the spacing, as
    float32 -- the comparison eager stochastic rounding makes on its float32 x * 2**-e.
    `noise` holds the float32 bits (int32) of the uniform [0, 1) numbers: non-negative floats
    order like their bit patterns, so the comparison is an integer one (no float compare that
    a GPU could flush). Where x * 2**-e is an fp32 subnormal, eager rounds it (to 0 at or
    below 2**-150) and frac is below any positive uniform number that torch draws (at least
    2**-33): only a zero noise rounds up there, and only if the rounded product is not 0.
    """
    bexp = mag >> 23
    sig = tl.where(bexp == 0, mag & 0x7FFFFF, (mag & 0x7FFFFF) | 0x800000)
    lsb = tl.maximum(bexp, 1) - 150
    xexp = floor_log2(mag)
    s = tl.maximum(xexp, EMIN + e) - MBITS
    top = (EMAX - MBITS) + e
    # shift >= 25 leaves less than half of the spacing: q = 0.
    shift = tl.minimum(tl.maximum(s - lsb, 1), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    true_shift = s - lsb
    rem_bits = rem.to(tl.float32).to(tl.int32, bitcast=True)
    frac_exp = (rem_bits >> 23) - 127 - true_shift
    frac_bits = rem_bits - tl.minimum(true_shift, 200) * 8388608
    up = (rem > 0) & (noise < frac_bits)
    t = e - 150 - lsb
    nonzero = (t < 0) | ((t < 24) & (sig > (1 << tl.minimum(tl.maximum(t, 0), 23))))
    up = tl.where(frac_exp >= -126, up, (noise == 0) & nonzero & (rem > 0))
    q += up.to(tl.int32)
    clamp = (xexp > EMAX + e) | ((xexp == EMAX + e) & (sig > (TOP_SIG << (23 - MBITS))))
    q = tl.where(clamp, TOP_SIG, q)
    s = tl.where(clamp, top, s)
    return q, s


@triton.jit
def pack(q, s):
    """float32 bits of q * 2**s (0 <= q < 2**24): a subnormal where it is one, Inf above the
    float32 range (the exact value of a product that a float32 multiplication would give)."""
    qbits = q.to(tl.float32).to(tl.int32, bitcast=True)
    rexp = (qbits >> 23) - 127 + s
    normal = qbits + s * 8388608
    sub = q << tl.minimum(tl.maximum(s + 149, 0), 31)
    res = tl.where(rexp >= -126, normal, sub)
    res = tl.where(rexp > 127, 0x7F800000, res)
    return tl.where(q == 0, 0, res)


def axis_blocks(shape, axis: int, size: int):
    """(n_blocks, length, inner, blocks_per_row) of blocks of `size` along `axis` of a
    contiguous tensor of `shape` viewed as [outer, length, inner] (block_offsets' arguments)."""
    length = shape[axis]
    inner = math.prod(shape[axis + 1:])
    blocks_per_row = -(-length // size)
    return math.prod(shape[:axis]) * blocks_per_row * inner, length, inner, blocks_per_row


def axis_layout(shape, axis: int, size: int, group: int):
    """(block_offsets' arguments, LAYOUT, number of programs) for blocks of `size` along `axis`
    and `group` blocks per program."""
    args = axis_blocks(shape, axis, size)
    n_blocks, length, inner, _ = args
    if inner > 1:
        return args, COLUMNS, (n_blocks // inner) * -(-inner // group)
    return args, FLAT if length % size == 0 else ROWS, -(-n_blocks // group)


def square_tiles(shape, size: int):
    """(n_tiles, rows, cols, tiles_per_row) of size x size tiles of a 2-D tensor of `shape`
    (tile_offsets' arguments)."""
    rows, cols = shape
    tiles_per_row = -(-cols // size)
    return -(-rows // size) * tiles_per_row, rows, cols, tiles_per_row


def element_constants(fmt: str) -> dict:
    """The grid roundings' constexprs of a canonical element format: EMAX, EMIN, MBITS and
    TOP_SIG (max_normal = TOP_SIG * 2**(EMAX - MBITS))."""
    info = FORMAT_INFO[fmt]
    top_sig = info.max_normal / 2.0 ** (info.emax_elem - info.mantissa_bits)
    assert top_sig == int(top_sig), fmt
    return dict(EMAX=info.emax_elem, EMIN=info.emin_elem, MBITS=info.mantissa_bits,
                TOP_SIG=int(top_sig))
