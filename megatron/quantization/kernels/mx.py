"""MX quantize-dequantize in one Triton kernel (exact arithmetic on the float bits).

A tensor is seen as [outer, length, inner] with the block axis in the middle (no copy: any
axis of a contiguous tensor). A program takes a group of blocks of 32 elements laid out so that
its loads and stores are contiguous in memory whatever the axis (bits.block_offsets); how
many, and its warps, are tuned on the GPU (kernels/tuning.py). Per block, on the float32
bits (a bf16 value is its high 16 bits):

    amax     the largest |x| bit pattern (it orders like the magnitudes; NaN > Inf > finite;
             the zero padding of a short tail never wins), as in the eager path;
    e        biased exponent of amax - 127 - emax_elem (floor), one more when amax's mantissa
             field exceeds the rule's threshold (scale_rule_threshold: rceil, ceil, even);
             -127 for a zero or subnormal amax; clamped to [-127, 127]; a block holding NaN
             or Inf comes out all NaN;
    element  round to nearest: float operations on |x| (_scaled_nearest: scale by 2**-e,
             saturate, round on the grid by adding and subtracting a power of two whose
             float32 spacing is the grid's, scale back), each exact or the one rounding
             wanted; stochastic rounding in integers: x = sig * 2**lsb exactly, the grid
             spacing at x is 2**S with S = max(floor(log2|x|), emin_elem + e) - mbits (fp32
             subnormals read their exponent from their leading bit), |x| is saturated,
             then rounded up where eager's uniform number (read from the noise tensor) is
             below the fraction (bits.stochastic_round_to_grid), and q * 2**S written back
             as float32 bits;
             either way a subnormal where the result is one, Inf where it exceeds float32
             (the rceil overflow of pitfall P12), with x's sign (so -0 and tiny negatives
             give -0, as eager does);
    bf16     the exact float32 result is rounded once to bf16, to nearest even.

This is the value the eager path defines (scale exactly, round once, dequantize exactly).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from megatron.quantization.formats.common import FORMAT_INFO, MX_BLOCK_SIZE
from megatron.quantization.kernels.bits import (
    as_blocks, block_offsets, element_constants, load_bits, load_noise, nearest_on_grid, pack,
    stochastic_round_to_grid, store_bits)
from megatron.quantization.kernels.hadamard import hadamard_launch, rotate
from megatron.quantization.kernels.tuning import axis_launch, launch


@triton.jit
def mx_quantize_blocks(u, noise, EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                       TOP_SIG: tl.constexpr, BUMP_ABOVE: tl.constexpr,
                       STOCHASTIC: tl.constexpr):
    """float32 bits of the MX quantize-dequantize of blocks [n, 32] (blocks along axis 1) given
    as float32 bits u (int32): the exact value, before any rounding to bf16. Zeros padding a
    short block never change its amax. Shared by the QDQ kernel and kernels that quantize
    tiles in registers."""
    mag = u & 0x7FFFFFFF

    # Shared exponent e per block.
    amax = tl.max(mag, axis=1)
    e = (amax >> 23) - (127 + EMAX) + ((amax & 0x7FFFFF) > BUMP_ABOVE).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)     # a zero or subnormal amax: -127
    bad = amax >= 0x7F800000

    if STOCHASTIC:
        q, s = stochastic_round_to_grid(mag, e[:, None], noise, EMIN, MBITS, TOP_SIG, EMAX)
        res = pack(q, s)
    else:
        res = _scaled_nearest(mag, e, EMIN, MBITS, TOP_SIG, EMAX)
    res = res | (u & -2147483648)                    # x's sign (-0 for negatives that vanish)
    return tl.where(bad[:, None], 0x7FC00000, res)


@triton.jit
def _scaled_nearest(mag, e, EMIN: tl.constexpr, MBITS: tl.constexpr, TOP_SIG: tl.constexpr,
                    EMAX: tl.constexpr):
    """float32 bits of |x| (finite bits `mag`, blocks [n, 32]) rounded to nearest even on the
    element grid scaled by 2**e (e per block, in [-127, 127]), saturated at max_normal * 2**e:

        y = |x| * 2**-e     exact where y is normal; where it is an fp32 subnormal (y < 2**-126)
                            y and its rounding are both far below half the format's smallest
                            spacing (2**-17, E5M2), so both round to 0
        r = nearest_on_grid(y)
        r * 2**e            exact: r's lowest bit is at least 2**(EMIN - MBITS) and 2**e at
                            least 2**-127, so a subnormal product keeps every bit (E5M2:
                            2**-143); above float32's range it is Inf (the rceil overflow)

    Only a block holding Inf or NaN (whose result the caller replaces) has e = 127: 2**-e is
    then 0."""
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = tl.where(e > -127, (127 + e) << 23, 0x400000).to(tl.float32, bitcast=True)
    r = nearest_on_grid(mag.to(tl.float32, bitcast=True) * down[:, None], EMIN, MBITS, TOP_SIG,
                        EMAX)
    return (r * up[:, None]).to(tl.int32, bitcast=True)


@triton.jit
def mx_qdq_kernel(x_ptr, noise_ptr, y_ptr, signs_ptr, n_blocks, length, inner, blocks_per_row,
                  EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                  TOP_SIG: tl.constexpr, BUMP_ABOVE: tl.constexpr,
                  STOCHASTIC: tl.constexpr, IS_BF16: tl.constexpr, RHT: tl.constexpr,
                  INV_SQRT: tl.constexpr, WIDTH: tl.constexpr, LAYOUT: tl.constexpr,
                  GROUP_: tl.constexpr):
    # GROUP_ runs of WIDTH elements along the axis: one MX block, or (RHT) whole transform
    # blocks holding whole MX blocks (or two MX halves of one 32-block for RHT 16).
    offs, mask = block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, WIDTH, LAYOUT)
    u = as_blocks(load_bits(x_ptr, offs, mask, IS_BF16), LAYOUT)
    if RHT > 0:
        u = rotate(u, signs_ptr, GROUP_, WIDTH, RHT, INV_SQRT, IS_BF16)
    noise = load_noise(noise_ptr, offs, mask, STOCHASTIC)
    if STOCHASTIC:
        noise = tl.reshape(as_blocks(noise, LAYOUT), [GROUP_ * WIDTH // 32, 32])
    res = mx_quantize_blocks(tl.reshape(u, [GROUP_ * WIDTH // 32, 32]), noise, EMAX, EMIN,
                             MBITS, TOP_SIG, BUMP_ABOVE, STOCHASTIC)
    store_bits(y_ptr, offs, mask, as_blocks(tl.reshape(res, [GROUP_, WIDTH]), LAYOUT),
               IS_BF16)


def scale_rule_threshold(fmt: str, scale_mode: str) -> int:
    """The float32 mantissa field of a block's amax above which its shared exponent is one
    more than the floor rule's (formats.mx._block_scales states the rules by value):
    floor never (the field never exceeds 2**23 - 1), rceil above max_normal's field, ceil
    above 0, even from the field of 2 - 2**-(mbits + 1) on."""
    info = FORMAT_INFO[fmt]
    if scale_mode == "floor":
        return (1 << 23) - 1
    if scale_mode == "ceil":
        return 0
    if scale_mode == "rceil":
        mant, _ = math.frexp(info.max_normal)          # max_normal = 1.n * 2**emax_elem
        return int(round((2 * mant - 1) * 2 ** 23))
    if scale_mode == "even":
        return (1 << 23) - (1 << (22 - info.mantissa_bits)) - 1
    raise ValueError(f"unknown MX scale_mode {scale_mode!r}")


def format_constants(fmt: str, scale_mode: str):
    """The constexprs of mx_quantize_blocks for a canonical MX format and scale rule."""
    return dict(element_constants(fmt), BUMP_ABOVE=scale_rule_threshold(fmt, scale_mode))


def mx_fake_quantize_triton(x: torch.Tensor, fmt: str, axis: int, scale_mode: str,
                            noise: Optional[torch.Tensor] = None,
                            rht: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """fake_quantize(x, fmt, axis, scale_mode, rht=rht) for an MX format, by the Triton kernel.

    x: float32 or bf16, any shape (made contiguous if it is not); fmt canonical; axis
    normalised (0 <= axis < x.dim()). noise: None (round to nearest) or the uniform [0, 1)
    float32 numbers of x's shape that eager stochastic rounding draws (rounding.uniform_noise),
    so that both give the same bits. rht: None, or (block, seed) to quantize the random
    Hadamard transform of x along the axis (x.shape[axis] a multiple of block), computed in
    the kernel. Returns a new tensor of x's shape and dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the MX Triton kernel takes float32 or bfloat16, got {x.dtype}")
    if noise is not None and (noise.shape != x.shape or noise.dtype != torch.float32):
        raise ValueError("noise must be float32 of x's shape")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    rotation = hadamard_launch(rht, x.device)
    width = max(MX_BLOCK_SIZE, rotation["RHT"])
    args, layout, groups, programs = axis_launch(x.shape, axis, width)
    launch(mx_qdq_kernel, "GROUP_", groups, programs,
           (x, x if noise is None else noise.contiguous(), y, rotation.pop("signs"), *args),
           key=("n_blocks", "inner", "LAYOUT", "WIDTH", "STOCHASTIC"),
           STOCHASTIC=noise is not None, IS_BF16=x.dtype == torch.bfloat16, WIDTH=width,
           LAYOUT=layout, enable_fp_fusion=False, **rotation,
           **format_constants(fmt, scale_mode))
    return y
