"""Exactness tests of the FP8 recipes (per-tensor current / delayed scaling, 1x128 and 128x128
blockwise scaling) of megatron.quantization.formats against independent expectations.

Expectations come from tests/fp8_reference.py (numpy float32, step by step from section 7 of
the number-formats design note, element values decoded from their bits), from hand-derived
cases, and from torchao 0.18.0's float8 emulation (tensorwise: hp_tensor_to_float8_dynamic;
blockwise: the pure-torch formulas of torchao.prototype.blockwise_fp8_training.kernels).
"""

import ast
import importlib.util
import math
import os
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8_reference as R  # noqa: E402
from megatron.quantization import dispatch  # noqa: E402
from megatron.quantization.formats import fake_quantize  # noqa: E402
from megatron.quantization.formats.fp8 import (  # noqa: E402
    FP8_SCALINGS, check_fp8_options, _round_to_f32, fp8_amax, fp8_scales)

FMTS = ("fp8_e4m3", "fp8_e5m2")
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
FLT_MAX = float(np.finfo(np.float32).max)
F32 = np.float32
# (scaling, block, axis) of the recipes
CONFIGS = [("tensor", None, -1), ("block", (1, 128), -1), ("block", (1, 128), 0),
           ("block", (128, 128), 0)]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def assert_same(actual: torch.Tensor, expected, msg=""):
    """Bit-level equality of values: NaN == NaN, +0 and -0 distinguished."""
    a = actual.detach().to(torch.float64).cpu().numpy()
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    same = ((a == e) & (np.signbit(a) == np.signbit(e))) | (np.isnan(a) & np.isnan(e))
    if not same.all():
        idx = [tuple(i) for i in np.argwhere(~same)[:5]]
        raise AssertionError(f"{msg}: {(~same).sum()} mismatches, e.g. (index, got, expected) "
                             f"{[(i, a[i], e[i]) for i in idx]}")


def wide_random(shape, seed, lo=-30, hi=30):
    """float32 values with random signs, mantissas and binades 2**lo .. 2**hi."""
    g = np.random.default_rng(seed)
    mant = g.uniform(1, 2, size=shape) * g.choice([-1, 1], size=shape)
    return (mant * np.exp2(g.integers(lo, hi, size=shape))).astype(np.float32)


def as_input(x32: np.ndarray, dtype: str):
    """(torch input of `dtype`, its exact values as a numpy float32/float64 array)."""
    t = torch.from_numpy(x32).to(DTYPES[dtype])
    return t, (t.numpy() if dtype == "float64" else t.float().numpy())


def reference(values, fmt, scaling, block, axis, margin, pow2, dtype, amax=None):
    if scaling == "tensor":
        return R.tensor_reference(values, fmt, margin, pow2, amax=amax, dtype=dtype)
    if block == (1, 128):
        return R.row_block_reference(values, fmt, axis, margin, pow2, dtype=dtype)
    return R.square_block_reference(values, fmt, margin, pow2, dtype=dtype)


def fq(x, fmt, scaling="tensor", block=None, axis=-1, **kw):
    return fake_quantize(x, fmt, axis=axis, scaling=scaling, block=block, **kw)


# ---------------------------------------------------------------------------------------------
# The reference itself: grids from the bits, element rounding against ml_dtypes
# ---------------------------------------------------------------------------------------------

def test_reference_grids_match_the_design_note():
    e4, _ = R.positive_grid("fp8_e4m3")
    e5, _ = R.positive_grid("fp8_e5m2")
    assert (len(e4) - 1, e4[-1], e4[1], e4[8]) == (126, 448.0, 2.0 ** -9, 2.0 ** -6)
    assert (len(e5) - 1, e5[-1], e5[1], e5[4]) == (123, 57344.0, 2.0 ** -16, 2.0 ** -14)


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_rounding_matches_ml_dtypes_after_clamping(fmt):
    grid, _ = R.positive_grid(fmt)
    mids = (grid[1:] + grid[:-1]) / 2                         # every tie
    v = np.concatenate([grid, mids, np.nextafter(mids.astype(np.float32), 0),
                        np.nextafter(mids.astype(np.float32), np.inf),
                        wide_random(20000, 1, -20, 18), [1e30, np.inf, 61440.0, 464.0, 465.0]])
    v = np.concatenate([v, -v]).astype(np.float32)
    assert_same(torch.from_numpy(R.round_to_fp8(v, fmt)), R.elements_via_ml_dtypes(v, fmt), fmt)


# ---------------------------------------------------------------------------------------------
# Bit for bit against the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling,block,axis", CONFIGS)
def test_random_tensors_match_the_reference(dtype, fmt, scaling, block, axis):
    # 300 x 260: partial 1x128 blocks along both axes and partial 128x128 tiles at both edges;
    # binades 2**-30 .. 2**30 (fp16: its own range, subnormals included).
    lo, hi = (-20, 15) if dtype == "float16" else (-30, 30)
    seed = zlib.crc32(f"{dtype} {fmt}".encode()) % 1000
    x, values = as_input(wide_random((300, 260), seed=seed, lo=lo, hi=hi), dtype)
    for pow2 in (False, True):
        for margin in (0, 1, -1):
            out = fq(x, fmt, scaling, block, axis, margin=margin, pow2_scale=pow2)
            assert out.shape == x.shape and out.dtype == x.dtype
            expected, scales = reference(values, fmt, scaling, block, axis, margin, pow2, dtype)
            msg = f"{dtype} {fmt} {scaling} {block} axis {axis} pow2 {pow2} margin {margin}"
            assert_same(out, expected, msg)
            got = fp8_scales(x, fmt, axis, scaling, margin=margin, pow2_scale=pow2, block=block)
            assert got.dtype == torch.float32
            assert_same(got, scales, msg + " scales")


@pytest.mark.parametrize("fmt", FMTS)
def test_row_blocks_along_every_axis_of_a_3d_tensor(fmt):
    x, values = as_input(wide_random((130, 3, 257), seed=5), "float32")
    for axis in (0, 1, 2, -1):
        out = fq(x, fmt, "block", (1, 128), axis, pow2_scale=True)
        expected, scales = R.row_block_reference(values, fmt, axis, pow2=True)
        assert_same(out, expected, f"axis {axis}")
        got = fp8_scales(x, fmt, axis, "block", pow2_scale=True)
        assert got.shape == scales.shape
        assert_same(got, scales, f"axis {axis} scales")


def test_python_float32_rounding_of_the_scaled_max():
    # f32(fp8_max * f32(2**-margin)) is evaluated on Python floats (a compile-time constant):
    # it must round exactly like a float32 cast (numpy), ties, subnormals and overflow included.
    g = np.random.default_rng(51)
    values = g.uniform(1, 2, 20000) * np.exp2(g.integers(-160, 130, 20000))
    lo = (g.uniform(1, 2, 2000) * np.exp2(g.integers(-149, 127, 2000))).astype(np.float32)
    ties = (lo.astype(np.float64) + np.nextafter(lo, np.float32(np.inf)).astype(np.float64)) / 2
    edge = [FLT_MAX * (1 + 2.0 ** -25), FLT_MAX * (1 + 2.0 ** -25) * (1 - 2.0 ** -50),
            2.0 ** -150, 3 * 2.0 ** -151, 0.0, math.inf]
    values = np.concatenate([values, -values, ties, edge])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float32).astype(np.float64)
    got = np.array([_round_to_f32(float(v)) for v in values])
    assert np.array_equal(got, expected)


def test_fractional_margin_follows_the_float32_sequence():
    # scaled_max = f32(448 * f32(2**-0.5)), then one IEEE division.
    x, values = as_input(wide_random((64, 200), seed=8), "float32")
    for scaling, block, axis in CONFIGS:
        out = fq(x, "fp8_e4m3", scaling, block, axis, margin=0.5)
        expected, _ = reference(values, "fp8_e4m3", scaling, block, axis, 0.5, False, "float32")
        assert_same(out, expected, f"{scaling} {block}")


def test_large_margins_follow_the_float32_sequence():
    # amax near FLT_MAX: margin 8 gives a subnormal scale (pow2 truncates it to 0), margin 9
    # a scale below 1 / FLT_MAX (1 / scale = Inf): NaN / Inf outputs, as the reference's
    # literal float32 steps give. A very negative margin caps the scale at FLT_MAX.
    x = torch.tensor([3e38, -1e38, 0.0, 1.0])
    for margin, pow2 in ((8, False), (8, True), (9, False), (-300, False), (-300, True)):
        expected, scale = R.tensor_reference(x.numpy(), "fp8_e4m3", margin, pow2)
        assert_same(fq(x, "fp8_e4m3", margin=margin, pow2_scale=pow2), expected, str(margin))
        assert fp8_scales(x, "fp8_e4m3", margin=margin, pow2_scale=pow2).item() == scale
    assert torch.isnan(fq(x, "fp8_e4m3", margin=8, pow2_scale=True)).all()
    assert fq(x, "fp8_e4m3", margin=9)[0].item() == math.inf
    assert fp8_scales(x, "fp8_e4m3", margin=-300).item() == FLT_MAX
    assert fp8_scales(x, "fp8_e4m3", margin=6, pow2_scale=True).item() > 0


def test_float64_inputs():
    # float32 scales from the float64 amax rounded to float32 (a finite amax above FLT_MAX
    # counts as FLT_MAX); x * scale, rounding and q * scale_inv in float64.
    x, values = as_input(wide_random((200, 300), seed=9), "float64")
    x = x * 3.0 ** 0.5                     # values that are not float32 numbers
    values = x.numpy()
    for scaling, block, axis in CONFIGS:
        for pow2 in (False, True):
            out = fq(x, "fp8_e4m3", scaling, block, axis, pow2_scale=pow2)
            assert out.dtype == torch.float64
            expected, _ = reference(values, "fp8_e4m3", scaling, block, axis, 0, pow2, "float64")
            assert_same(out, expected, f"{scaling} {block} {pow2}")
    huge = torch.tensor([1e300, -2.0, 1e-300], dtype=torch.float64)
    assert fp8_scales(huge, "fp8_e4m3").item() == F32(448) / F32(FLT_MAX)
    assert_same(fq(huge, "fp8_e4m3"), R.tensor_reference(huge.numpy(), "fp8_e4m3",
                                                         dtype="float64")[0])


# ---------------------------------------------------------------------------------------------
# Hand-derived cases (bit layouts and section 7.1)
# ---------------------------------------------------------------------------------------------

def test_scale_examples():
    e4 = torch.tensor([448.0, -3.0, 0.5])
    assert fp8_scales(e4, "fp8_e4m3").item() == 1.0                       # 448 / 448
    assert fp8_scales(torch.tensor([1.0, -0.25]), "fp8_e4m3").item() == 448.0
    assert fp8_scales(torch.tensor([-57344.0, 1.0]), "fp8_e5m2").item() == 1.0
    assert fp8_scales(torch.tensor([1.0]), "fp8_e5m2").item() == 57344.0
    # margin: 448 * 2**-1 / 1 and 448 * 2**1 / 1
    assert fp8_scales(torch.tensor([1.0]), "fp8_e4m3", margin=1).item() == 224.0
    assert fp8_scales(torch.tensor([1.0]), "fp8_e4m3", margin=-1).item() == 896.0
    # pow2: 448 / 3 = 149.33 -> 128; 448 / 448 = 1 stays; 448 / 500 = 0.896 -> 0.5
    assert fp8_scales(torch.tensor([3.0]), "fp8_e4m3", pow2_scale=True).item() == 128.0
    assert fp8_scales(torch.tensor([448.0]), "fp8_e4m3", pow2_scale=True).item() == 1.0
    assert fp8_scales(torch.tensor([500.0]), "fp8_e4m3", pow2_scale=True).item() == 0.5
    # The scale is the IEEE float32 quotient, not 448 * (1 / amax) (two roundings).
    amax = F32(2.9)
    assert fp8_scales(torch.tensor([2.9]), "fp8_e4m3").item() == F32(448) / amax   # 154.48276
    assert F32(448) / amax != F32(448) * (F32(1) / amax)


def test_pow2_keeps_the_exponent_bits_just_below_a_power_of_two():
    # amax one ulp above 1.75: 448 / amax = 255.99998 (float32, just below 2**8), whose
    # exponent bits give 128. exp2(floor(log2(s))) in float32 gives 256 here (P2: log2
    # rounds up to 8.0), which would let 1.75 * 256 = 448.00003 saturate.
    amax = np.nextafter(F32(1.75), F32(2))
    assert F32(448) / amax == np.nextafter(F32(256), F32(0))
    x = torch.tensor([float(amax), 1.0, -0.3])
    assert fp8_scales(x, "fp8_e4m3", pow2_scale=True).item() == 128.0
    assert fp8_scales(x, "fp8_e4m3", amax=float(amax), pow2_scale=True).item() == 128.0
    expected, _ = R.tensor_reference(x.numpy(), "fp8_e4m3", pow2=True)
    assert_same(fq(x, "fp8_e4m3", pow2_scale=True), expected)
    assert fq(x, "fp8_e4m3", pow2_scale=True)[0].item() == 1.75


def test_e4m3_saturation_and_ties_at_scale_one():
    # Delayed amax 448 gives scale exactly 1. 464 is the tie between 448 (S.1111.110, even)
    # and 480 (S.1111.111, the NaN code): it goes to 448; 465 and 1e30 saturate (P7).
    x = torch.tensor([464.0, 465.0, 449.0, 1e30, -464.0, -1e38, 17.0, 18.0, 1.0625, 3.4e38])
    out = fq(x, "fp8_e4m3", amax=448.0)
    assert_same(out, [448, 448, 448, 448, -448, -448, 16, 18, 1.0, 448])


def test_e5m2_saturation_and_ties_at_scale_one():
    # 61440 is the tie between 57344 and 65536 (beyond max): RNE would give Inf; we saturate
    # (P8). 53248 ties 49152 (S.11110.10, even) and 57344 (S.11110.11, odd).
    x = torch.tensor([61440.0, 61439.0, 1e38, -61440.0, 53248.0, 3.4e38, 2.5, 2.0 ** -17])
    out = fq(x, "fp8_e5m2", amax=57344.0)
    assert_same(out, [57344, 57344, 57344, -57344, 49152, 57344, 2.5, 0.0])


@pytest.mark.parametrize("fmt,tiny", [("fp8_e4m3", 2.0 ** -9), ("fp8_e5m2", 2.0 ** -16)])
def test_subnormal_ties(fmt, tiny):
    # Half the smallest subnormal is a tie between 0 (even) and the smallest subnormal
    # (mantissa ...01, odd): it goes to 0, keeping its sign; 1.5 * tiny ties tiny (odd) and
    # 2 * tiny (even).
    half = tiny / 2
    x = torch.tensor([half, -half, np.nextafter(F32(half), F32(1)), 1.5 * tiny, tiny])
    out = fq(x, fmt, amax=FP8_MAX[fmt])            # scale 1
    assert_same(out, [0.0, -0.0, tiny, 2 * tiny, tiny])


def test_dequantization_is_q_times_scale_inv_not_q_divided_by_scale():
    # amax 10: scale = f32(448 / 10) = f32(44.8), not a power of two. 7.142857 * scale
    # rounds to the E4M3 value 320 (spacing 32 there); then
    # f32(320 * f32(1 / scale)) = 7.1428576 while f32(320 / scale) = 7.142857.
    x = torch.tensor([10.0, 7.142857])
    scale = F32(448) / F32(10)
    assert fp8_scales(x, "fp8_e4m3").item() == scale
    expected = F32(320) * (F32(1) / scale)
    assert expected == F32("7.1428576") and F32(320) / scale == F32("7.142857")
    assert expected != F32(320) / scale
    out = fq(x, "fp8_e4m3")
    assert out[1].item() == expected
    assert out[0].item() == F32(448) * (F32(1) / scale)


def test_no_double_rounding_through_bf16():
    # P6: 1.0625 + 2**-20 -> E4M3 1.125 directly; through bf16 (1.0625, a tie) it would be 1.0.
    x = torch.tensor([1.0625 + 2.0 ** -20])
    assert fq(x, "fp8_e4m3", amax=448.0).item() == 1.125
    assert fq(x.bfloat16(), "fp8_e4m3", amax=448.0).item() == 1.0   # the bf16 input is 1.0625


def test_bf16_output_is_the_float32_result_rounded_once():
    x, values = as_input(wide_random((50, 256), seed=3), "bfloat16")
    for scaling, block, axis in CONFIGS:
        out = fq(x, "fp8_e5m2", scaling, block, axis)
        # (bf16 and float32 inputs differ only where the block value_for_inf is used)
        via_f32 = fq(x.float(), "fp8_e5m2", scaling, block, axis).bfloat16()
        assert torch.equal(out.view(torch.int16), via_f32.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Current scaling specials
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_current_scaling_non_finite_makes_everything_nan(dtype, special):
    x = torch.tensor([1.0, -2.0, 0.0, special, 3.0], dtype=DTYPES[dtype])
    out = fq(x, "fp8_e4m3")
    assert out.dtype == x.dtype and torch.isnan(out).all()
    assert fp8_scales(x, "fp8_e4m3").item() == 1.0          # the rule's scale for amax NaN/Inf
    amax = fp8_amax(x).item()
    assert (math.isnan(amax) if math.isnan(special) else amax == math.inf)


@pytest.mark.parametrize("fmt", FMTS)
def test_zero_tensor(fmt):
    x = torch.tensor([0.0, -0.0, 0.0, -0.0])
    out = fq(x, fmt, pow2_scale=True)
    assert_same(out, [0.0, -0.0, 0.0, -0.0])
    assert fp8_scales(x, fmt).item() == 1.0 and fp8_amax(x).item() == 0.0
    assert_same(fq(x, fmt, "block"), [0.0, -0.0, 0.0, -0.0])


@pytest.mark.parametrize("fmt", FMTS)
def test_fp32_subnormal_tensor_is_not_flushed(fmt):
    # amax = 1.5 * 2**-128: fp8_max / amax overflows float32 -> scale FLT_MAX (pow2: 2**127).
    x = torch.tensor([2.0 ** -130, -3 * 2.0 ** -133, 1.5 * 2.0 ** -128, 0.0])
    assert fp8_scales(x, fmt).item() == FLT_MAX
    assert fp8_scales(x, fmt, pow2_scale=True).item() == 2.0 ** 127
    for pow2 in (False, True):
        out = fq(x, fmt, pow2_scale=pow2)
        expected, _ = R.tensor_reference(x.numpy(), fmt, pow2=pow2)
        assert_same(out, expected)
        assert (out[:3] != 0).all()
    # With pow2 the values are exact: x * 2**127 is in range and on the grid.
    assert_same(fq(x, fmt, pow2_scale=True), x)


# ---------------------------------------------------------------------------------------------
# Delayed scaling
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_scale_comes_from_amax_not_from_x(fmt):
    x, values = as_input(wide_random((40, 100), seed=11, lo=-8, hi=8), "float32")
    for amax in (3.0, 1e-3, 7e5):
        for margin in (0, 2):
            expected, scale = R.tensor_reference(values, fmt, margin, amax=amax)
            assert scale == (F32(FP8_MAX[fmt]) * F32(2.0 ** -margin)) / F32(amax)
            out = fq(x, fmt, amax=amax, margin=margin)
            assert_same(out, expected, f"amax {amax} margin {margin}")
            got = fp8_scales(x, fmt, amax=amax, margin=margin)
            assert got.item() == scale and got.item() != fp8_scales(x, fmt, margin=margin).item()
            # the same numbers for x times anything: the scale ignores x
            assert fp8_scales(x * 1000, fmt, amax=amax, margin=margin).item() == scale


@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_values_above_amax_saturate(fmt):
    amax = 2.0
    scale = F32(FP8_MAX[fmt]) / F32(amax)
    top = F32(FP8_MAX[fmt]) * (F32(1) / scale)
    # 10 * amax, and 3e38 whose product with the scale overflows float32 to Inf.
    x = torch.tensor([20.0, -20.0, 3e38, -3e38, 2.0, 1.0])
    out = fq(x, fmt, amax=amax)
    assert_same(out[:5], [top, -top, top, -top, top])
    assert out[5].item() == R.tensor_reference(x.numpy(), fmt, amax=amax)[0][5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delayed_non_finite_elements_are_nan_only_in_place(dtype):
    x = torch.tensor([1.0, math.nan, -0.0, math.inf, -math.inf, -3.0, 0.0], dtype=DTYPES[dtype])
    out = fq(x, "fp8_e4m3", amax=4.0)
    expected, _ = R.tensor_reference(x.float().numpy(), "fp8_e4m3", amax=4.0, dtype=dtype)
    assert_same(out, expected)
    assert torch.isnan(out).tolist() == [False, True, False, True, True, False, False]
    assert np.signbit(out[2].item()) and not np.signbit(out[6].item())


@pytest.mark.parametrize("amax", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_delayed_degenerate_amax_gives_scale_one(amax):
    x = torch.tensor([0.3, -100.0, 500.0, 2.0 ** -12])
    assert fp8_scales(x, "fp8_e4m3", amax=amax).item() == 1.0
    assert_same(fq(x, "fp8_e4m3", amax=amax), [0.3125, -96.0, 448.0, 0.0])


def test_delayed_amax_as_float_or_tensor():
    x = torch.from_numpy(wide_random((1000,), seed=12, lo=-5, hi=5))
    a = fq(x, "fp8_e5m2", amax=5.5, pow2_scale=True)
    for amax in (torch.tensor(5.5), torch.tensor(5.5, dtype=torch.float64),
                 torch.tensor(5.5, dtype=torch.bfloat16), 5.5, np.float32(5.5)):
        assert torch.equal(fq(x, "fp8_e5m2", amax=amax, pow2_scale=True), a)
    # A is converted to float32 first: a float64 A that is not a float32 number rounds.
    a64 = 1.0 + 2.0 ** -30
    assert fp8_scales(x, "fp8_e4m3", amax=a64).item() == 448.0
    with pytest.raises(ValueError, match=r"amax must be a scalar.*\(2,\)"):
        fq(x, "fp8_e4m3", amax=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"amax must be a scalar.*\(2,\)"):
        fp8_scales(x, "fp8_e4m3", amax=[1.0, 2.0])


# ---------------------------------------------------------------------------------------------
# Blockwise specials
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,axis", [((1, 128), -1), ((1, 128), 0), ((128, 128), 0)])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_non_finite_makes_only_its_tile_nan(block, axis, special):
    x, _ = as_input(wide_random((300, 260), seed=13, lo=-6, hi=6), "float32")
    clean = fq(x, "fp8_e4m3", "block", block, axis)
    bad = x.clone()
    bad[130, 140] = special
    out = fq(bad, "fp8_e4m3", "block", block, axis)
    tile = torch.zeros(300, 260, dtype=torch.bool)
    if block == (128, 128):
        tile[128:256, 128:256] = True
    elif axis == 1 or axis == -1:
        tile[130, 128:256] = True
    else:
        tile[128:256, 140] = True
    assert torch.isnan(out[tile]).all()
    assert torch.equal(out[~tile], clean[~tile])
    expected, scales = reference(bad.numpy(), "fp8_e4m3", "block", block, axis, 0, False,
                                 "float32")
    assert_same(out, expected)
    assert_same(fp8_scales(bad, "fp8_e4m3", axis, "block", block=block), scales)


def test_partial_tiles_equal_zero_padding():
    x = torch.from_numpy(wide_random((200, 300), seed=15, lo=-4, hi=4))
    x[:, 256:] = -x[:, 256:].abs()               # an all-negative partial tile
    padded = F.pad(x, (0, 84, 0, 56))
    for block in ((1, 128), (128, 128)):
        out = fq(x, "fp8_e4m3", "block", block)
        assert torch.equal(out, fq(padded, "fp8_e4m3", "block", block)[:200, :300])
        scales = fp8_scales(x, "fp8_e4m3", scaling="block", block=block)
        padded_scales = fp8_scales(padded, "fp8_e4m3", scaling="block", block=block)
        assert torch.equal(scales, padded_scales[:scales.shape[0], :scales.shape[1]])


def test_square_tiles_do_not_depend_on_axis_or_transposition():
    x = torch.from_numpy(wide_random((300, 200), seed=16))
    out = fq(x, "fp8_e4m3", "block", (128, 128), axis=0)
    assert torch.equal(out, fq(x, "fp8_e4m3", "block", (128, 128), axis=1))
    assert torch.equal(fq(x.t(), "fp8_e4m3", "block", (128, 128)), out.t())
    # 1x128 blocks do depend on the axis
    assert not torch.equal(fq(x, "fp8_e4m3", "block", (1, 128), axis=0),
                           fq(x, "fp8_e4m3", "block", (1, 128), axis=1))


@pytest.mark.parametrize("dtype,value_for_inf", [("float32", FLT_MAX),
                                                 ("bfloat16", 3.3895313892515355e38),
                                                 ("float16", 65504.0)])
def test_block_value_for_inf_is_the_input_dtype_max(dtype, value_for_inf):
    # A tile whose scale overflows float32 gets the largest finite value of x's dtype
    # (TE's blockwise kernels); per tensor it is always FLT_MAX. fp16 values are never small
    # enough, so a margin of -200 overflows fp8_max * 2**200 itself.
    tiny, margin = (2.0 ** -133, 0) if dtype != "float16" else (2.0 ** -20, -200)
    x = torch.full((2, 128), tiny, dtype=DTYPES[dtype])
    x[1] = 1.0
    scales = fp8_scales(x, "fp8_e4m3", scaling="block", margin=margin)
    assert scales[0, 0].item() == value_for_inf
    assert fp8_scales(x[:1], "fp8_e4m3", margin=margin).item() == FLT_MAX
    pow2 = fp8_scales(x, "fp8_e4m3", scaling="block", margin=margin, pow2_scale=True)
    assert pow2[0, 0].item() == 2.0 ** math.floor(math.log2(value_for_inf))
    expected, ref_scales = R.row_block_reference(x.float().numpy(), "fp8_e4m3", margin=margin,
                                                 dtype=dtype)
    assert_same(fq(x, "fp8_e4m3", "block", margin=margin), expected)
    assert_same(scales, ref_scales)


# ---------------------------------------------------------------------------------------------
# Differential: torchao 0.18.0
# ---------------------------------------------------------------------------------------------

def _fp8_codes(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes of fp8 values held exactly in a float tensor."""
    return values.float().to(TORCH_FP8[fmt]).view(torch.uint8)


def _differential_inputs():
    g = torch.Generator().manual_seed(21)
    return {"normal": torch.randn(1024, 1024, generator=g),
            "wide": torch.from_numpy(wide_random((1024, 1024), seed=22)),
            "uniform": torch.rand(1024, 1024, generator=g) * 3.7}


def test_torchao_tensorwise_differential():
    """Against torchao's hp_tensor_to_float8_dynamic on 3 x 1 M values per case.

    torchao computes the same scale (f32(f64(fp8_max) / f64(amax)): a double-rounded division
    that equals the float32 IEEE quotient) and the same codes (f32(x * scale), clamp, cast),
    but dequantizes as q / scale. The only difference class is therefore, for float32 with a
    scale that is not a power of two, the elements where f32(q / scale) != f32(q * f32(1 /
    scale)) (1 ulp). With a power-of-two scale both are exact; for bf16 the float32 results
    round to the same bf16 value here. Its pow2 scale (exp2(floor(log2 s)) in float32) is
    wrong only one ulp below 2**k, which these inputs do not hit.
    """
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    counts = {}
    for name, x32 in _differential_inputs().items():
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            for fmt in FMTS:
                for pow2 in (False, True):
                    ao = hp_tensor_to_float8_dynamic(x, TORCH_FP8[fmt], LinearMMConfig(),
                                                     round_scales_to_power_of_2=pow2)
                    out = fq(x, fmt, pow2_scale=pow2)
                    scale = fp8_scales(x, fmt, pow2_scale=pow2)
                    assert torch.equal(ao._scale.float(), scale), (name, dtype, fmt, pow2)
                    # Same codes: our output times the scale rounds back to our q.
                    ours_q = (out.float() * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt])
                    assert torch.equal(_fp8_codes(ours_q, fmt), ao._data.view(torch.uint8))
                    q = ao._data.float()
                    assert torch.equal((q * torch.reciprocal(scale)).to(dtype), out)
                    ao_out = ao.to_original_precision()
                    differ = ao_out != out
                    key = (name, str(dtype)[6:], fmt, pow2)
                    counts[key] = int(differ.sum())
                    if dtype == torch.bfloat16 or pow2:
                        assert counts[key] == 0, key
                    else:
                        # every difference is exactly the q / scale class, and nothing else
                        by_division = (q / scale).to(dtype)
                        assert torch.equal(ao_out, by_division)
                        assert torch.equal(differ, by_division != out)
    # The class is not empty (0-50 % of the float32 outputs, depending on the scale), so the
    # check above has teeth. (randn's scales for E4M3 and E5M2 happen to give none.)
    fp32_nonpow2 = [c for k, c in counts.items() if k[1] == "float32" and not k[3]]
    assert sum(c > 100_000 for c in fp32_nonpow2) >= 3, counts
    print("torchao tensorwise differences:", counts)


def _torchao_blockwise_functions():
    """torchao 0.18.0's pure-torch blockwise quantizers, loaded from the source of
    torchao/prototype/blockwise_fp8_training/kernels.py (that module imports triton at the
    top, which a CPU install lacks; the two functions themselves use torch only)."""
    from torchao.float8.config import e4m3_dtype
    spec = importlib.util.find_spec("torchao.prototype.blockwise_fp8_training")
    path = os.path.join(os.path.dirname(spec.origin), "kernels.py")
    with open(path) as fh:
        tree = ast.parse(fh.read())
    wanted = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_weight_quant"}
    nodes = [n for n in tree.body
             if (isinstance(n, ast.FunctionDef) and n.name in wanted)
             or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "EPS"
                                                    for t in n.targets))]
    namespace = {"torch": torch, "e4m3_dtype": e4m3_dtype}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)
    assert wanted <= set(namespace) and namespace["EPS"] == 1e-12
    return namespace["torch_blockwise_scale_act_quant_lhs"], \
        namespace["torch_blockwise_scale_weight_quant"]


def test_torchao_blockwise_differential():
    """Against torchao's torch formulas (1x128 activations, 128x128 weights, E4M3, no pow2):
    s = f32(448 / f64(amax)), q = fp8(clamp(x * s)), returned with 1 / s; dequantized as
    q * (1 / s), which is our order: 0 differences expected (no class)."""
    act_quant, weight_quant = _torchao_blockwise_functions()
    for name, x32 in _differential_inputs().items():
        x32 = x32 * torch.exp2(torch.arange(-20, 20, 40 / 1024).floor()).unsqueeze(1)
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            q, scale_inv = act_quant(x)
            ao_out = (q.float().reshape(1024, 8, 128) * scale_inv.reshape(1024, 8, 1))
            out = fq(x, "fp8_e4m3", "block", (1, 128))
            assert torch.equal(ao_out.reshape(1024, 1024).to(dtype), out), (name, dtype)
            assert torch.equal(torch.reciprocal(fp8_scales(x, "fp8_e4m3", scaling="block")),
                               scale_inv)
            q, scale_inv = weight_quant(x)
            ao_out = q.float().reshape(8, 128, 8, 128) * scale_inv.reshape(8, 1, 8, 1)
            out = fq(x, "fp8_e4m3", "block", (128, 128))
            assert torch.equal(ao_out.reshape(1024, 1024).to(dtype), out), (name, dtype)
            scales = fp8_scales(x, "fp8_e4m3", scaling="block", block=(128, 128))
            assert torch.equal(torch.reciprocal(scales), scale_inv)


# ---------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------

def _neighbours(v: np.ndarray, fmt: str):
    """(lo, hi) FP8 grid neighbours of float32 values v (|v| <= max), signed."""
    grid, _ = R.positive_grid(fmt)
    mag = np.abs(v.astype(np.float64))
    idx = np.searchsorted(grid, mag, side="right")
    lo = grid[idx - 1]
    hi = np.where(lo == mag, lo, grid[np.minimum(idx, len(grid) - 1)])
    sign = np.where(np.signbit(v), -1.0, 1.0)
    return sign * lo, sign * hi


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scaling,block,axis", CONFIGS)
def test_stochastic_rounding_gives_a_grid_neighbour(fmt, scaling, block, axis):
    x = torch.from_numpy(wide_random((260, 300), seed=31))
    g = torch.Generator().manual_seed(5)
    out = fq(x, fmt, scaling, block, axis, rounding="stochastic", generator=g)
    # The scales are those of round to nearest: compare against the reference's scales.
    _, scales = reference(x.numpy(), fmt, scaling, block, axis, 0, False, "float32")
    if scaling == "tensor":
        full = np.broadcast_to(scales, x.shape)
    elif block == (1, 128):
        full = np.repeat(scales, 128, axis=axis)[:, :300] if axis in (1, -1) else \
            np.repeat(scales, 128, axis=0)[:260]
    else:
        full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:260, :300]
    full = full.astype(np.float32)
    v = np.clip(x.numpy() * full, -FP8_MAX[fmt], FP8_MAX[fmt])
    lo, hi = _neighbours(v, fmt)
    inv = F32(1) / full
    y = out.numpy()
    assert ((y == (lo.astype(np.float32) * inv)) | (y == (hi.astype(np.float32) * inv))).all()
    # As many went up as the probabilities (|v| - |lo|) / (|hi| - |lo|) predict.
    between = lo != hi
    went_up = (y == hi.astype(np.float32) * inv) & between
    p = (np.abs(v[between]) - np.abs(lo[between])) / (np.abs(hi[between]) - np.abs(lo[between]))
    assert abs(went_up.sum() - p.sum()) <= 6 * math.sqrt((p * (1 - p)).sum())
    assert went_up.sum() > 1000 and (between & ~went_up).sum() > 1000
    assert np.array_equal(fp8_scales(x, fmt, axis, scaling, block=block).numpy(), scales)


@pytest.mark.parametrize("fmt,value,lo,hi", [
    ("fp8_e4m3", 1.1, 1.0, 1.125),
    ("fp8_e4m3", 300.0, 288.0, 320.0),
    ("fp8_e4m3", 2.0 ** -10 * 1.25, 0.0, 2.0 ** -9),      # below the smallest subnormal
    ("fp8_e5m2", 0.7, 0.625, 0.75),
    ("fp8_e5m2", 50000.0, 49152.0, 57344.0),
])
def test_stochastic_rounding_is_unbiased(fmt, value, lo, hi):
    # amax pinned to fp8_max by the first element: scale 1, so v = f32(value).
    n = 200_000
    x = torch.full((n + 1,), value)
    x[0] = FP8_MAX[fmt]
    v = float(F32(value))
    p = (v - lo) / (hi - lo)
    g = torch.Generator().manual_seed(7)
    out = fq(x, fmt, rounding="stochastic", generator=g)[1:]
    assert set(out.unique().tolist()) <= {lo, hi}
    ups = int((out == hi).sum())
    assert abs(ups - n * p) <= 6 * math.sqrt(n * p * (1 - p)), (ups, n * p)
    assert abs(out.double().mean().item() - v) <= 6 * (hi - lo) * math.sqrt(p * (1 - p) / n)


def test_stochastic_rounding_reproducible_and_specials():
    x = torch.from_numpy(wide_random((64, 256), seed=32)).bfloat16()

    def draw(seed, **kw):
        return fq(x, "fp8_e4m3", rounding="stochastic",
                  generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(3).view(torch.int16), draw(3).view(torch.int16))
    assert not torch.equal(draw(3), draw(4))
    assert draw(3).dtype == torch.bfloat16
    # Values on the grid never move: x = fq(x) is a fixed point of SR too.
    on_grid = fq(x, "fp8_e4m3", pow2_scale=True)
    assert torch.equal(fq(on_grid, "fp8_e4m3", pow2_scale=True, rounding="stochastic",
                          generator=torch.Generator().manual_seed(1)), on_grid)
    # NaN rules are those of round to nearest.
    bad = x.clone()
    bad[3, 5] = math.nan
    out = fq(bad, "fp8_e4m3", "block", rounding="stochastic",
             generator=torch.Generator().manual_seed(1))
    assert torch.isnan(out[3, :128]).all() and not torch.isnan(out[3, 128:]).any()
    assert not torch.isnan(out[:3]).any()
    delayed = fq(bad.float(), "fp8_e4m3", amax=1.0, rounding="stochastic",
                 generator=torch.Generator().manual_seed(1))
    # one NaN; everything else saturates at 448 * (1 / 448) = 1 or below
    assert int(torch.isnan(delayed).sum()) == 1 and delayed.nan_to_num(0).abs().max() == 1.0


# ---------------------------------------------------------------------------------------------
# API, options and errors
# ---------------------------------------------------------------------------------------------

def test_shapes_dtypes_and_non_contiguous_inputs():
    base = torch.from_numpy(wide_random((3, 200, 150), seed=41, lo=-10, hi=10))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = base.to(dtype)
        for kw in (dict(), dict(amax=2.0), dict(scaling="block", axis=1),
                   dict(scaling="block", block=(1, 128), axis=0)):
            out = fake_quantize(x, "fp8_e4m3", **kw)
            assert out.shape == x.shape and out.dtype == dtype
            t = x.transpose(0, 2)                                  # non-contiguous
            kw_t = dict(kw, axis=2 - kw["axis"]) if "axis" in kw else kw
            assert torch.equal(fake_quantize(t, "fp8_e4m3", **kw_t),
                               fake_quantize(t.contiguous(), "fp8_e4m3", **kw_t))
        x2 = x[0]
        out = fake_quantize(x2.t(), "fp8_e5m2", scaling="block", block=(128, 128))
        assert torch.equal(out, fake_quantize(x2.t().contiguous(), "fp8_e5m2",
                                              scaling="block", block=(128, 128)))
    assert fake_quantize(torch.ones(0, 5), "fp8_e4m3").shape == (0, 5)


def test_check_options_normalizes():
    x = torch.ones(2, 3)
    assert FP8_SCALINGS == ("tensor", "block")
    assert check_fp8_options(x, None, 0, False, None) == ("tensor", 0.0, False, None)
    assert check_fp8_options(x, "block", 1, True, None) == ("block", 1.0, True, (1, 128))
    assert check_fp8_options(x, "block", -2.5, False, [128, 128]) == (
        "block", -2.5, False, (128, 128))
    hash(check_fp8_options(x, "block", 0, False, (128, 128)))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(scaling="row"), r"'row'.*tensor, block"),
    (dict(scaling="Tensor"), r"'Tensor'.*tensor, block"),
    (dict(margin=math.nan), r"margin.*nan"),
    (dict(margin=math.inf), r"margin.*inf"),
    (dict(margin="1"), r"margin.*'1'"),
    (dict(margin=True), r"margin.*True"),
    (dict(margin=10 ** 400), r"margin.*1000"),
    (dict(pow2_scale=1), r"pow2_scale.*1"),
    (dict(scaling="block", block=(1, 64)), r"\(1, 64\).*\(1, 128\), \(128, 128\)"),
    (dict(scaling="block", block=(128, 1)), r"\(128, 1\).*valid"),
    (dict(scaling="block", block=128), r"128.*valid"),
    (dict(block=(1, 128)), r"block=\(1, 128\).*scaling='tensor'"),
    (dict(scaling="tensor", block=(128, 128)), r"block=\(128, 128\)"),
    (dict(scaling="block", amax=1.0), r"amax.*scaling='block'"),
    (dict(amax=torch.ones(3)), r"amax must be a scalar.*\(3,\)"),
])
def test_bad_fp8_options(kwargs, pattern):
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match=pattern):
        fake_quantize(x, "fp8_e4m3", **kwargs)


def test_other_errors():
    with pytest.raises(ValueError, match=r"\(128, 128\).*2-D.*\(2, 3, 4\)"):
        fake_quantize(torch.randn(2, 3, 4), "fp8_e5m2", scaling="block", block=(128, 128))
    with pytest.raises(ValueError, match=r"\(128, 128\).*2-D.*\(300,\)"):
        fp8_scales(torch.randn(300), "fp8_e5m2", scaling="block", block=(128, 128))
    for kw in (dict(scaling="tensor"), dict(margin=1), dict(pow2_scale=True),
               dict(block=(1, 128))):
        with pytest.raises(ValueError, match="fp8"):
            fake_quantize(torch.randn(4, 32), "mxfp8", **kw)
    with pytest.raises(ValueError, match="not an fp8 format"):
        fp8_scales(torch.randn(4, 32), "mxfp8")
    with pytest.raises(ValueError, match=r"axis 2 .*ndim 2"):
        fake_quantize(torch.randn(4, 32), "fp8_e4m3", scaling="block", axis=2)
    with pytest.raises(TypeError, match="int32"):
        fp8_amax(torch.ones(3, dtype=torch.int32))


def test_fp8_scales_shapes_and_amax():
    x = torch.from_numpy(wide_random((5, 300, 7), seed=42))
    assert fp8_scales(x, "fp8_e4m3").shape == ()
    assert fp8_scales(x, "fp8_e4m3", axis=1, scaling="block").shape == (5, 3, 7)
    assert fp8_scales(x, "fp8_e4m3", axis=0, scaling="block").shape == (1, 300, 7)
    assert fp8_scales(x[0], "fp8_e4m3", scaling="block", block=(128, 128)).shape == (3, 1)
    assert fp8_scales(torch.ones(0, 300), "fp8_e4m3", scaling="block").shape == (0, 3)
    xb = x.bfloat16()
    assert fp8_amax(xb).item() == float(np.abs(xb.float().numpy()).max())
    assert fp8_amax(x).dtype == torch.float32 and fp8_amax(x).shape == ()
    assert fp8_amax(x).item() == float(np.abs(x.numpy()).max())
    assert fp8_amax(torch.tensor([-3.0, 2.0])).item() == 3.0
    assert fp8_amax(torch.tensor([1.0, -math.inf])).item() == math.inf
    assert math.isnan(fp8_amax(torch.tensor([math.inf, math.nan])).item())
    assert fp8_amax(torch.empty(0)).item() == 0.0
    # delayed-scaling bookkeeping: the amax of step t feeds the scale of step t + 1
    a = fp8_amax(x)
    assert fp8_scales(x, "fp8_e4m3", amax=a).item() == fp8_scales(x, "fp8_e4m3").item()
    assert torch.equal(fake_quantize(x, "fp8_e4m3", amax=a), fake_quantize(x, "fp8_e4m3"))


def test_inputs_requiring_grad_and_the_input_is_untouched():
    x = torch.from_numpy(wide_random((4, 256), seed=43)).requires_grad_()
    keep = x.detach().clone()
    for kw in (dict(), dict(amax=1.0), dict(scaling="block")):
        out = fake_quantize(x, "fp8_e4m3", **kw)
        assert not out.requires_grad
    assert torch.equal(x.detach(), keep)


def test_compiled_variant_is_identical():
    x = torch.from_numpy(wide_random((200, 260), seed=44))
    x[7, 9] = math.nan
    for kw in (dict(amax=3.0, margin=1, pow2_scale=True),
               dict(scaling="block", block=(1, 128), axis=0)):
        eager = fake_quantize(x, "fp8_e4m3", **kw)
        compiled = dispatch.fake_quantize(x, "fp8_e4m3", kernels="compile", **kw)
        assert torch.equal(compiled.view(torch.int32), eager.view(torch.int32)), kw


def test_zero_dim_tensor_with_per_tensor_scaling():
    """A 0-d tensor has no block axis, but per-tensor scaling needs none: its one value is the
    amax, so it maps onto fp8_max exactly and comes back as f32(448 * f32(1/scale))."""
    x = torch.tensor(3.3)
    scale = np.float32(448.0) / np.float32(3.3)
    expected = np.float32(448.0) * (np.float32(1.0) / scale)
    assert fake_quantize(x, "fp8_e4m3").item() == float(expected)
    with pytest.raises(ValueError, match="at least one dimension"):
        fake_quantize(x, "fp8_e4m3", scaling="block")
