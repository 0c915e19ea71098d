"""NVFP4: E2M1 elements in blocks of 16 with an E4M3 block scale and a float32 tensor scale.

The numbers are those of TransformerEngine's NVFP4 kernels (design note section 6.1): every step
is one float32 operation, rounded to nearest even, in this order:

    1. amax  = max |x| over the tensor (or the caller's imposed amax)
    2. s_enc = min(f32(2688 / amax), FLT_MAX); 1 when amax == 0          (2688 = 448 * 6)
    3. s_dec = f32(1 / s_enc)
    4. per block, with amax_b = max |x_i| over its 16 (or 16x16) elements:
       S = f32(amax_b * f32(s_enc * f32(1/6)))  -- the float32 constant 1/6, never a division
       s = E4M3(S): nearest even, E4M3 subnormals (k * 2**-9) kept, saturating at 448
    5. enc_b = min(f32(1 / f32(s * s_dec)), FLT_MAX)                    (s == 0 -> FLT_MAX)
    6. v = clamp(f32(x * enc_b), -6, 6); q = E2M1(v), nearest even (or stochastic)
    7. y = f32(q * f32(f32(s * amax) * f32(1/2688)))

The other conventions ("Ours" in the note): an all-zero tensor gives 0; a block whose scale
rounds to 0 gives 0 (no clamp of the scale to 2**-6); subnormal E4M3 scales are used as they
are; a length that is not a multiple of 16 is zero-padded, so the short tail is its own block;
NaN or +-Inf anywhere in the tensor (or a non-finite imposed amax) makes every output NaN,
because the tensor scale is then undefined.

"4/6" (four_over_six="mae" | "mse", TransformerEngine's nvfp4_4over6, v2.17+; arXiv
2512.02010). Every block is quantized twice, with the block scale that maps its amax to 6 and
with the one that maps it to 4, and keeps the candidate whose error against x is smaller (ties
keep 6). The operation sequence is TE's 4over6 kernel's, which differs from the one above:

    2'. s_enc = min(f32((6 * bound) / amax), FLT_MAX); 1 when amax == 0    (bound 448 or 256)
    4'. base = f32(f32(amax_b / 6) * s_enc)   -- a division here, not the constant 1/6
        s6 = E4M3(min(base, 448)), s4 = E4M3(min(f32(base * 1.5), 448))   (the clamp is 448
        for either bound)
    5'. per candidate k: enc_k = min(f32(1 / f32(s_k * s_dec)), FLT_MAX),
        q_k = E2M1(clamp(f32(x * enc_k), -6, 6))
        err_k = sum over the block of |d| (mae) or f32(d * d) (mse), d = f32(v - x) with
        v = f32(f32(f32(q_k * s_k) * amax) / f32(6 * bound)); float32 sums in element order
        from 0 (1-D blocks); in 16x16 tiles each line along the block axis is summed in
        order, then the 16 line sums pairwise as (i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1)
    6'. s = s4 where err_4 < err_6, else s6
    7'. y = f32(q * f32(f32(s * amax) * f32(1 / (6 * bound))))

bound 256 (TE's nvfp4_4over6_e4m3_use_256) leaves s4 room below 448 (at most 384); without 4/6
only 448 exists. Stochastic rounding is refused with 4/6, as TE refuses it.

Row scaling (row_scaled=True, TE's row_scaled_activation, v2.16+): the tensor amax of steps 1,
2 and 7 is taken per line along the block axis (one per token for activations quantized along
their last axis) instead of per tensor; NaN or Inf then makes only its own line NaN. With 1-D
blocks only, and with no imposed amax.

Dtypes: bf16 / fp16 inputs are upcast exactly to float32. The sequence above is defined in
float32 (it is what the hardware computes), so float64 inputs are first rounded to float32
(nearest even) and then follow the same sequence: for them NVFP4 is "NVFP4 of f32(x)". The result
is cast back to x's dtype (exact for float64, nearest even for 16-bit dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.quantization.formats.common import (
    NVFP4_BLOCK_SIZE, block_view, check_tensor, normalize_axis)
from megatron.quantization.formats.elements import round_to_grid_
from megatron.quantization.formats.rounding import stochastic_round_to_grid

FLT_MAX = float(torch.finfo(torch.float32).max)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Constants as float32 numbers, exactly as the kernels hold them.
_TENSOR_SCALE_NUMERATOR = 2688.0                                       # 448 * 6, exact
ONE_SIXTH_F32 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))   # 0.16666667163...
ONE_OVER_2688_F32 = float(torch.tensor(1.0 / 2688.0, dtype=torch.float32))
_ONE_OVER_1536_F32 = float(torch.tensor(1.0 / 1536.0, dtype=torch.float32))   # 6 * 256
FOUR_OVER_SIX_MODES = ("mae", "mse")
FOUR_OVER_SIX_BOUNDS = (448, 256)


# --------------------------------------------------------------------------------------------
# Blocking
# --------------------------------------------------------------------------------------------

def _blocked(work: torch.Tensor, axis: int, block_2d: bool):
    """(view of the zero-padded `work` with every block spread over its own dims, the dims to
    reduce over for one block).

    1-D blocks: axis -> (nblocks, 16), reduce over axis + 1. 16x16 tiles of a 2-D tensor:
    [R, C] -> [R/16, 16, C/16, 16], reduce over (1, 3); the tiles do not depend on `axis`.
    Zero padding never changes a block's amax (P14).
    """
    b = NVFP4_BLOCK_SIZE
    if block_2d:
        rows, _ = block_view(work, 0, b)             # [R/16, 16, C]
        return block_view(rows, 2, b)[0], (1, 3)     # [R/16, 16, C/16, 16]
    return block_view(work, axis, b)[0], (axis + 1,)


def _unblocked(blocks: torch.Tensor, x: torch.Tensor, axis: int, block_2d: bool):
    """The inverse of _blocked: back to the padded layout, cropped to x's shape."""
    if block_2d:
        out = blocks.reshape(blocks.shape[0] * blocks.shape[1], blocks.shape[2] * blocks.shape[3])
        axes = (0, 1)
    else:
        out = blocks.flatten(axis, axis + 1)
        axes = (axis,)
    for a in axes:
        if out.shape[a] != x.shape[a]:
            out = out.narrow(a, 0, x.shape[a])
    return out


def _block_amax(blocks: torch.Tensor, dims) -> torch.Tensor:
    """max |x| per block (keepdim): NaN if the block holds a NaN, +Inf if it holds +-Inf.

    max(max, -min) takes two reductions instead of a full-size |x| temporary; both propagate
    NaN. An all-zero block can come out as max(0, -0) = -0 (the vectorised maximum does not
    order the zeros), whose reciprocal would be -inf: abs_ makes it +0."""
    return torch.maximum(blocks.amax(dims, keepdim=True),
                         blocks.amin(dims, keepdim=True).neg_()).abs_()


# --------------------------------------------------------------------------------------------
# Scales (steps 1-5 and the dequantization factor of step 7)
# --------------------------------------------------------------------------------------------

def _round_e4m3_(s: torch.Tensor) -> torch.Tensor:
    """E4M3 "fn" rounding in place of non-negative float32 values: nearest even on the E4M3
    grid (normal exponents >= -6, subnormals k * 2**-9, 3 mantissa bits), saturating at 448.

    This is `cvt.rn.satfinite.e4m3`. Values in (448, 464] round to 448 anyway; clamping after
    the grid rounding also saturates what would round to 480 (the NaN code, P7) or beyond.
    """
    return round_to_grid_(s, -6, 3).clamp_(max=E4M3_MAX)


def _tensor_scales(amax: torch.Tensor, bound: int = 448):
    """(s_enc, s_dec) from the float32 tensor amax (steps 2-3; 2' with bound 256)."""
    # A true float32 division (`2688 / tensor` would be reciprocal-then-multiply: two roundings).
    s_enc = torch.full_like(amax, 6.0 * bound).div_(amax).clamp_(max=FLT_MAX)
    # amax == 0: 2688/0 = inf was clamped to FLT_MAX; TE uses 1. (s_enc == 0 happens only for
    # amax = inf, which makes the whole output NaN anyway.)
    s_enc = torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return s_enc, torch.reciprocal(s_enc)


def _block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """The E4M3 block decode scales s (step 4), as float32 values."""
    per_unit = s_enc * ONE_SIXTH_F32            # f32(s_enc * f32(1/6))
    return _round_e4m3_(block_amax * per_unit)   # f32(amax_b * ...), then E4M3


def _scales(blocks: torch.Tensor, dims, amax: Optional[torch.Tensor], axis: int,
            form: "Nvfp4Form"):
    """(s, tensor amax, s_dec, finite) for float32 blocks: the E4M3 block scales (4/6's choice
    with form.four_over_six), the amax the tensor scale comes from (imposed, max |x|, or max |x|
    per line along the block axis with form.row_scaled: then it and `finite` keep x's dims with
    the block axis of size 1), the tensor decode scale, and a bool that is False where x holds
    NaN/Inf or the imposed amax is not finite."""
    block_amax = _block_amax(blocks, dims)
    # max |x|: NaN if any NaN, else Inf if any Inf (per line when row-scaled)
    data_amax = block_amax.amax(axis, keepdim=True) if form.row_scaled else block_amax.amax()
    amax, s_enc, s_dec, finite = tensor_scales(data_amax, amax, form.bound)
    if not form.four_over_six:
        return _block_scales(block_amax, s_enc), amax, s_dec, finite
    s = _four_over_six_scales(blocks, dims, axis, block_amax, amax, s_enc, s_dec, form)
    return s, amax, s_dec, finite


def tensor_scales(data_amax: torch.Tensor, amax: Optional[torch.Tensor], bound: int = 448):
    """(amax, s_enc, s_dec, finite) of a tensor whose max |x| is `data_amax`: the amax the
    tensor scale comes from (imposed, or the data's), its encode and decode scales (bound 448,
    or 4/6's 256), and a bool that is False when the data holds NaN/Inf or the imposed amax is
    not finite."""
    finite = torch.isfinite(data_amax)
    if amax is None:
        amax = data_amax
    else:
        amax = amax.to(torch.float32)
        finite = finite & torch.isfinite(amax)
    s_enc, s_dec = _tensor_scales(amax, bound)
    return amax, s_enc, s_dec, finite


# --------------------------------------------------------------------------------------------
# 4/6: two candidate block scales, the one with the smaller error (steps 4'-6')
# --------------------------------------------------------------------------------------------

def _four_over_six_scales(blocks, dims, axis, block_amax, amax, s_enc, s_dec, form):
    """The E4M3 block scale 4/6 keeps per block (or 16x16 tile): s4 where err_4 < err_6."""
    sixes = torch.full_like(block_amax, E2M1_MAX)
    base = block_amax.div(sixes).mul_(s_enc)                 # f32(f32(amax_b / 6) * s_enc)
    s6 = _round_e4m3_(base.clamp(max=E4M3_MAX))
    s4 = _round_e4m3_(base.mul_(1.5).clamp_(max=E4M3_MAX))
    err6 = _candidate_error(blocks, dims, axis, s6, amax, s_dec, form)
    err4 = _candidate_error(blocks, dims, axis, s4, amax, s_dec, form)
    return torch.where(err4 < err6, s4, s6)


def _candidate_error(blocks, dims, axis, s, amax, s_dec, form):
    """Each block's error with block scale s (step 5'), summed in TE's order; keepdim."""
    enc = torch.reciprocal(s * s_dec).clamp_(max=FLT_MAX)
    q = round_to_grid_((blocks * enc).clamp_(-E2M1_MAX, E2M1_MAX), 0, 1)
    v = q.mul_(s).mul_(amax)
    v.div_(torch.full_like(v, 6.0 * form.bound))              # a true division, as TE's
    d = v.sub_(blocks)
    terms = d.abs_() if form.four_over_six == "mae" else d.mul_(d)
    if len(dims) == 1:
        return _sum_in_order(terms, dims[0]).unsqueeze(dims[0])
    # A 16x16 tile [R/16, 16, C/16, 16]: its lines along the block axis in order, then a tree
    # over the 16 line sums.
    along, across = (3, 1) if axis == 1 else (1, 3)
    lines = _sum_in_order(terms, along)            # the tile's other dim is `across` or 1 less
    across = across if across < along else across - 1
    width = lines.shape[across]
    while width > 1:
        width //= 2
        lines = lines.narrow(across, 0, width) + lines.narrow(across, width, width)
    return lines.unsqueeze(along)


def _sum_in_order(terms: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 sum over `dim`, one element after the other from 0 (a fixed order: a vectorised
    or pairwise sum can round differently)."""
    acc = terms.select(dim, 0).clone()
    for i in range(1, terms.shape[dim]):
        acc.add_(terms.select(dim, i))
    return acc


# --------------------------------------------------------------------------------------------
# Quantize-dequantize
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Nvfp4Form:
    """Which NVFP4 variant a call computes: 4/6 (None, "mae" or "mse") with its E4M3 bound
    (448 or 256), row scaling. The default is plain NVFP4."""

    four_over_six: Optional[str] = None
    bound: int = 448
    row_scaled: bool = False


PLAIN = Nvfp4Form()


def nvfp4_form(four_over_six=None, four_over_six_bound=448, row_scaled=False, *,
               block_2d=False, amax=None, rounding="nearest") -> Nvfp4Form:
    """fake_quantize's NVFP4 variant options checked (one ValueError naming the bad value and
    what is valid, TransformerEngine's restrictions included) and gathered."""
    if four_over_six is not None and four_over_six not in FOUR_OVER_SIX_MODES:
        raise ValueError(f"four_over_six={four_over_six!r}: None, 'mae' or 'mse'")
    if four_over_six_bound not in FOUR_OVER_SIX_BOUNDS or isinstance(four_over_six_bound, bool):
        raise ValueError(f"four_over_six_bound={four_over_six_bound!r}: 448 or 256")
    if four_over_six is None and four_over_six_bound != 448:
        raise ValueError("four_over_six_bound=256 applies to 4/6 (four_over_six='mae' or "
                         "'mse'); plain NVFP4 takes E4M3's 448, as in TransformerEngine")
    if four_over_six is not None and rounding == "stochastic":
        raise ValueError("four_over_six with stochastic rounding: TransformerEngine's 4/6 "
                         "rounds to nearest only")
    if not isinstance(row_scaled, bool):
        raise ValueError(f"row_scaled={row_scaled!r}: True or False")
    if row_scaled and block_2d:
        raise ValueError("row_scaled with block_2d: row scaling takes 1-D blocks (activations), "
                         "16x16 tiles are for weights")
    if row_scaled and amax is not None:
        raise ValueError("row_scaled with an imposed amax: a row-scaled tensor takes one amax "
                         "per row from its own data")
    return Nvfp4Form(four_over_six, int(four_over_six_bound), row_scaled)


def nvfp4_fake_quantize(x: torch.Tensor, axis: int, block_2d: bool,
                         noise: Optional[torch.Tensor],
                         amax: Optional[torch.Tensor], form: Nvfp4Form = PLAIN) -> torch.Tensor:
    """NVFP4 quantize-dequantize of a validated float tensor (see the module docstring).

    axis: the block axis (non-negative; ignored for block_2d, whose 16x16 tiles make the result
    independent of it, except for the order in which 4/6 sums a tile's errors). noise: None
    (round to nearest even) or uniform [0, 1) float32 numbers of x's shape for stochastic
    rounding of the E2M1 elements; the scales are the same as for round to nearest (section
    6.3). amax: None or a 0-d float32 tensor used as the tensor amax in steps 1-2 and 7 (a
    piece of a larger operand). form: 4/6 and row scaling (nvfp4_form).
    """
    work = x.to(torch.float32)           # exact for 16-bit inputs; float64 rounds once here
    blocks, dims = _blocked(work, axis, block_2d)
    s, amax, s_dec, finite = _scales(blocks, dims, amax, axis, form)
    enc = torch.reciprocal(s * s_dec).clamp_(max=FLT_MAX)                  # step 5
    # Step 7's factor; NaN everywhere (in the line, when row-scaled) when the tensor scale is
    # undefined.
    one_over = ONE_OVER_2688_F32 if form.bound == 448 else _ONE_OVER_1536_F32
    dec = (s * amax).mul_(one_over)
    dec = torch.where(finite, dec, torch.nan)

    v = blocks * enc                                                        # step 6
    v.clamp_(-E2M1_MAX, E2M1_MAX)
    if noise is None:
        round_to_grid_(v, 0, 1)                                            # E2M1, RNE
    else:
        noise_blocks, _ = _blocked(noise, axis, block_2d)
        v = stochastic_round_to_grid(v, noise_blocks, 0, 1)
    v.mul_(dec)
    return _unblocked(v, x, axis, block_2d).to(x.dtype)


def nvfp4_scales(x: torch.Tensor, axis: int = -1, block_2d: bool = False,
                 amax=None, four_over_six: Optional[str] = None, four_over_six_bound: int = 448,
                 row_scaled: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(block scales, tensor amax) of NVFP4 as fake_quantize computes them (with the same
    four_over_six, four_over_six_bound and row_scaled options).

    block scales: the E4M3 decode scales s of step 4 (4/6's choice) as float32 values (0 for
    blocks that quantize to zero, k * 2**-9 for subnormal ones, at most 448), with x's shape
    and `axis` replaced by the number of blocks ceil(n / 16); for block_2d (2-D x) the shape is
    [ceil(rows / 16), ceil(cols / 16)]. A block's elements decode as q * s * amax / (6 bound).
    tensor amax: the float32 amax the tensor scale comes from (`amax` if given, else max |x|;
    NaN or Inf when x holds NaN or Inf): 0-d, or row-scaled x's shape with `axis` of size 1.
    When x (its line, row-scaled) holds NaN/Inf, or the imposed amax is not finite, its block
    scales are NaN (so are the outputs of fake_quantize).
    """
    check_tensor(x)
    if block_2d and x.dim() != 2:
        raise ValueError(f"block_2d needs a 2-D tensor (a weight), got shape {tuple(x.shape)}")
    axis = normalize_axis(axis, x.dim())
    if amax is not None:
        amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if amax.dim() != 0:
            raise ValueError(f"amax must be a scalar, got shape {tuple(amax.shape)}")
    form = nvfp4_form(four_over_six, four_over_six_bound, row_scaled, block_2d=block_2d,
                      amax=amax)
    with torch.no_grad():
        work = x.to(torch.float32)
        if work.numel() == 0:
            nb = lambda n: -(-n // NVFP4_BLOCK_SIZE)  # noqa: E731
            shape = ([nb(n) for n in work.shape] if block_2d else
                     [nb(n) if d == axis else n for d, n in enumerate(work.shape)])
            empty_amax = amax if amax is not None else torch.zeros((), device=x.device)
            return work.new_zeros(shape), empty_amax
        blocks, dims = _blocked(work, axis, block_2d)
        s, tensor_amax, _, finite = _scales(blocks, dims, amax, axis, form)
        s = torch.where(finite, s, torch.nan)
        if form.row_scaled:
            tensor_amax = tensor_amax.squeeze(axis + 1)
        return s.squeeze(dims), tensor_amax
