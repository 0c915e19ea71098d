"""Exactness tests of megatron.quantization.formats against independent references.

Expectations come from tests/format_reference.py: code points decoded from their bit layouts,
float64 MX / HiF8 references with exact exponents and ml_dtypes element casts, and hand-made
blocks for every pitfall (P1-P18) of the number-formats design note.
"""

import math

import numpy as np
import pytest
import torch

import format_reference as ref  # noqa: E402
from megatron.quantization import (  # noqa: E402
    FORMAT_NAMES,
    NAN_EXPONENT,
    SCALE_MODES,
    canonical_format,
    fake_quantize,
    format_info,
    hifp8_scaled_fake_quantize,
    mx_shared_exponents,
)
from megatron.quantization import formats as formats_module  # noqa: E402

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
ALL_QUANT = MX + ("hifp8",)
MAXN = {f: ref.MX_FORMATS[f][3] for f in MX}
FP32_MAX = float(np.finfo(np.float32).max)


def t32(values):
    return torch.from_numpy(ref.exact_f32(values))


def assert_same(actual: torch.Tensor, expected, msg=""):
    """Bit-level equality of values (NaN == NaN, and +0 vs -0 distinguished)."""
    a = actual.detach().to(torch.float64).cpu().numpy()
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    both_nan = np.isnan(a) & np.isnan(e)
    same = (a == e) & (np.signbit(a) == np.signbit(e))
    bad = ~(same | both_nan)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        details = [(tuple(i), a[tuple(i)], e[tuple(i)]) for i in idx]
        raise AssertionError(f"{msg} {bad.sum()} mismatches, e.g. (index, got, expected) {details}")


def wide_random(shape, seed, lo=-30, hi=30):
    """float32 values with random signs, mantissas and exponents in [lo, hi)."""
    g = np.random.default_rng(seed)
    mant = g.uniform(1, 2, size=shape) * g.choice([-1, 1], size=shape)
    return (mant * np.exp2(g.integers(lo, hi, size=shape))).astype(np.float32)


def block_with_scale_one(fmt, values):
    """Rows of 32: max_normal first (so the floor scale is 2**0), then up to 31 values."""
    values = list(values)
    rows = []
    for i in range(0, len(values), 31):
        chunk = values[i:i + 31]
        rows.append([MAXN[fmt]] + chunk + [0.0] * (31 - len(chunk)))
    return np.array(rows, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Code points
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", MX)
def test_mx_every_code_point_is_reproduced(fmt):
    values = [v for _, v in ref.mx_element_codes(fmt)]
    x = block_with_scale_one(fmt, values)
    assert_same(fake_quantize(t32(x), fmt), x, fmt)


@pytest.mark.parametrize("fmt", MX)
def test_mx_midpoints_round_to_nearest_even(fmt):
    grid = ref.mx_positive_grid(fmt)
    mids, expect, below, above = [], [], [], []
    for (lo, c_lo), (hi, c_hi) in zip(grid, grid[1:]):
        mid = (lo + hi) / 2
        mids.append(mid)
        expect.append(lo if c_lo % 2 == 0 else hi)   # ties to the even code
        below.append((np.nextafter(np.float32(mid), np.float32(0)), lo))
        above.append((np.nextafter(np.float32(mid), np.float32(np.inf)), hi))
    # Saturation above max_normal (the block max stays in [2**emax, 2**(emax + 1))).
    top = 2.0 ** (ref.MX_FORMATS[fmt][2] + 1)
    sat = [MAXN[fmt] + (top - MAXN[fmt]) * f for f in (0.25, 0.5, 0.75)]
    sat.append(float(np.nextafter(np.float32(top), np.float32(0))))
    cases = list(zip(mids, expect)) + below + above + [(s, MAXN[fmt]) for s in sat]
    xs = [float(v) for v, _ in cases]
    es = [float(e) for _, e in cases]
    x = block_with_scale_one(fmt, xs + [-v for v in xs])
    e = block_with_scale_one(fmt, es + [-v for v in es])
    assert_same(fake_quantize(t32(x), fmt), e, fmt)


def test_hif8_decoded_grid_matches_the_design_note():
    v = ref.hif8_values()
    assert (v[0x08], v[0x09], v[0x10], v[0x18], v[0x20], v[0x30]) == (1, 1.125, 2, 0.5, 4, 0.25)
    assert (v[0x40], v[0x60], v[0x61], v[0x6E]) == (16, 256, 384, 32768)
    assert v[0x6F] == math.inf and v[0xEF] == -math.inf and math.isnan(v[0x80])
    assert (v[0x7E], v[0x7F], v[0x01], v[0x07], v[0x00]) == (
        2.0 ** -15, 1.5 * 2.0 ** -15, 2.0 ** -22, 2.0 ** -16, 0.0)
    assert len([x for x in v if math.isfinite(x) and x > 0]) == 126


def test_hifp8_every_code_point_is_reproduced():
    values = [v for v in ref.hif8_values() if math.isfinite(v)]
    assert_same(fake_quantize(t32(values), "hifp8"), values)
    assert_same(fake_quantize(t32(values), "hifp8", saturate=True), values)


def test_hifp8_midpoints_round_away_from_zero():
    grid = ref.hif8_positive_grid()
    xs, es = [], []
    for lo, hi in zip(grid, grid[1:]):
        mid = (lo + hi) / 2
        xs += [mid, float(np.nextafter(np.float32(mid), np.float32(0))),
               float(np.nextafter(np.float32(mid), np.float32(np.inf)))]
        es += [hi, lo, hi]                      # ties away from zero (P18)
    assert_same(fake_quantize(t32(xs), "hifp8"), es)
    assert_same(fake_quantize(t32([-v for v in xs]), "hifp8"), [-v + 0.0 for v in es])  # no -0


def test_hifp8_specials_and_thresholds():
    below = lambda v: float(np.nextafter(np.float32(v), np.float32(0)))  # noqa: E731
    cases = [
        (40960.0, math.inf), (below(40960.0), 32768.0), (-40960.0, -math.inf),
        (49152.0, math.inf), (1e30, math.inf), (math.inf, math.inf), (-math.inf, -math.inf),
        (2.0 ** -23, 2.0 ** -22), (below(2.0 ** -23), 0.0), (-(2.0 ** -23), -(2.0 ** -22)),
        (1.5 * 2.0 ** -22, 2.0 ** -21), (1e-30, 0.0), (2.0 ** -149, 0.0),
        (-0.0, 0.0), (-1e-30, 0.0), (0.0, 0.0),
        (1.0625, 1.125), (12.5, 13.0), (15.5, 16.0), (17.0, 16.0), (18.0, 20.0),   # P17, P18
        (1.0625 + 2.0 ** -20, 1.125),
    ]
    x = torch.tensor([c[0] for c in cases] + [math.nan], dtype=torch.float32)
    assert_same(fake_quantize(x, "hifp8"), [c[1] for c in cases] + [math.nan])
    sat = [math.copysign(32768.0, e) if abs(e) == math.inf else e for e in (c[1] for c in cases)]
    assert_same(fake_quantize(x, "hifp8", saturate=True), sat + [math.nan])
    assert_same(fake_quantize(x, "hifp8", saturate=False), [c[1] for c in cases] + [math.nan])


def test_hifp8_random_against_grid_reference():
    x = wide_random((20000,), seed=1, lo=-26, hi=17)
    x[:200] *= np.float32(1e-3)
    assert_same(fake_quantize(torch.from_numpy(x), "hifp8"), ref.hif8_reference(x))
    assert_same(fake_quantize(torch.from_numpy(x), "hifp8", saturate=True),
                ref.hif8_reference(x, saturate=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("saturate", [False, True])
def test_hifp8_every_16_bit_input(dtype, saturate):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    expected = ref.hif8_reference(x.double().numpy(), saturate=saturate)
    out = fake_quantize(x, "hifp8", saturate=saturate)
    assert out.dtype == dtype
    assert_same(out.double(), expected)


def test_hifp8_against_en_dtypes():
    import en_dtypes

    x = wide_random((20000,), seed=2, lo=-26, hi=16)
    grid = np.array(ref.hif8_positive_grid(), dtype=np.float32)
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    x = np.concatenate([x, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    expected = x.astype(en_dtypes.hifloat8).astype(np.float64) + 0.0
    assert_same(fake_quantize(torch.from_numpy(x), "hifp8"), expected)


# ---------------------------------------------------------------------------------------------
# MX against the float64 + ml_dtypes reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("fmt", MX)
def test_mx_random_against_ml_dtypes_reference(fmt, scale_mode):
    x = wide_random((64, 96), seed=3)
    # Some blocks with a small dynamic range, so that most elements are normal.
    x[:16] = np.random.default_rng(4).standard_normal((16, 96)).astype(np.float32)
    expected = ref.mx_reference(x, fmt, scale_mode)
    assert_same(fake_quantize(torch.from_numpy(x), fmt, scale_mode=scale_mode), expected)
    assert_same(mx_shared_exponents(torch.from_numpy(x), fmt, scale_mode=scale_mode),
                ref.mx_reference_exponents(x, fmt, scale_mode))


@pytest.mark.parametrize("fmt", MX)
def test_mx_elements_match_ml_dtypes_casts(fmt):
    """With scale 2**0, element rounding equals ml_dtypes' RNE cast (compared in range)."""
    ml_dtype = ref.MX_FORMATS[fmt][4]
    g = np.random.default_rng(5)
    emin = {"mxfp8_e4m3": -9, "mxfp8_e5m2": -16, "mxfp4": -1}[fmt]
    v = (g.uniform(-1, 1, size=31 * 600)
         * np.exp2(g.integers(emin - 2, ref.MX_FORMATS[fmt][2] + 1, size=31 * 600)))
    v = np.clip(v.astype(np.float32), -MAXN[fmt], MAXN[fmt])
    x = block_with_scale_one(fmt, v)
    got = fake_quantize(t32(x), fmt)[:, 1:].numpy().reshape(-1)[:v.size]
    expected = v.astype(ml_dtype).astype(np.float32)
    assert_same(torch.from_numpy(got), expected)


def test_double_rounding_is_avoided():
    """P6: 1.0625 + 2**-20 -> 1.125 directly in E4M3, 1.0 through bf16."""
    x = block_with_scale_one("mxfp8_e4m3", [1.0625 + 2.0 ** -20])
    assert fake_quantize(t32(x), "mxfp8_e4m3")[0, 1].item() == 1.125


# ---------------------------------------------------------------------------------------------
# Pitfall blocks
# ---------------------------------------------------------------------------------------------

def test_e4m3_overflow_saturates():
    """P7: 465 is NaN in ml_dtypes; in MX it saturates. 464 ties to the even 448."""
    x = block_with_scale_one("mxfp8_e4m3", [464.0, 465.0, 479.0, 480.0, 511.875, -500.0, 449.0])
    e = block_with_scale_one("mxfp8_e4m3", [448.0] * 6 + [448.0])
    e[0, 6] = -448.0
    assert_same(fake_quantize(t32(x), "mxfp8_e4m3"), e)


def test_e5m2_overflow_saturates():
    """P8: 61440 is a tie that RNE sends to 65536 (inf); MX clamps to 57344."""
    x = block_with_scale_one("mxfp8_e5m2", [61440.0, -61440.0, 65535.0, 59392.0])
    e = block_with_scale_one("mxfp8_e5m2", [57344.0, -57344.0, 57344.0, 57344.0])
    assert_same(fake_quantize(t32(x), "mxfp8_e5m2"), e)


def test_e2m1_ties():
    """P9: RNE on the E2M1 grid."""
    pairs = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
             (5.0, 4.0), (7.0, 6.0), (6.5, 6.0), (0.2421875, 0.0), (0.2578125, 0.5)]
    x = block_with_scale_one("mxfp4", [p[0] for p in pairs] + [-p[0] for p in pairs])
    e = block_with_scale_one("mxfp4", [p[1] for p in pairs] + [-p[1] for p in pairs])
    e[e == 0] = 0.0
    got = fake_quantize(t32(x), "mxfp4")
    assert_same(got.abs(), np.abs(e))
    assert torch.equal(got, t32(e))


@pytest.mark.parametrize("fmt", MX)
def test_all_zero_block(fmt):
    x = torch.zeros(3, 32)
    assert_same(fake_quantize(x, fmt), np.zeros((3, 32)))
    assert mx_shared_exponents(x, fmt).tolist() == [[-127]] * 3


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_blocks_become_nan(fmt, special):
    x = torch.ones(2, 64)
    x[0, 5] = special
    out = fake_quantize(x, fmt)
    assert torch.isnan(out[0, :32]).all()
    assert_same(out[0, 32:], np.ones(32))
    assert_same(out[1], np.ones(64))
    ones = -ref.MX_FORMATS[fmt][2]          # amax 1 = 2**0 -> e = 0 - emax_elem
    assert mx_shared_exponents(x, fmt).tolist() == [[NAN_EXPONENT, ones], [ones, ones]]


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("fmt", MX)
def test_fp32_subnormal_inputs_are_kept(fmt, scale_mode):
    sub = [2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -130, 1.5 * 2.0 ** -127, 2.0 ** -126 - 2.0 ** -149]
    x = np.zeros((2, 32))
    x[0, :len(sub)] = sub
    x[1, :len(sub)] = [-s for s in sub]
    out = fake_quantize(t32(x), fmt, scale_mode=scale_mode)
    assert_same(out, ref.mx_reference(x, fmt, scale_mode))
    assert (mx_shared_exponents(t32(x), fmt, scale_mode=scale_mode) == -127).all()
    if fmt == "mxfp8_e4m3":   # amax 2**-126 - ulp -> scale 2**-127, element 2 - ulp -> 2 (E4M3)
        assert out[0, 4].item() == 2.0 ** -126 and out[0, 2].item() == 2.0 ** -130


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("fmt", MX)
def test_amax_just_below_every_power_of_two(fmt, scale_mode):
    """P2: nextafter(2**k, 0) for every k; float32 log2 misfloors most of them."""
    ks = np.arange(-125, 129)
    with np.errstate(over="ignore"):   # 2**128 -> inf in float32; nextafter(inf, 0) = max
        amax = np.nextafter(np.exp2(ks).astype(np.float32), np.float32(0))
    x = np.zeros((len(ks), 32), dtype=np.float32)
    x[:, 0] = amax
    x[:, 1] = amax / 3
    out = fake_quantize(torch.from_numpy(x), fmt, scale_mode=scale_mode)
    # rceil rounds the block at float32 max up to 2**128, which is inf in float32 (P12).
    with np.errstate(over="ignore"):
        assert_same(out, ref.mx_reference(x, fmt, scale_mode).astype(np.float32))
    exps = mx_shared_exponents(torch.from_numpy(x), fmt, scale_mode=scale_mode)[:, 0].numpy()
    for k, e, a in zip(ks, exps, amax):
        m, kk = math.frexp(float(a))
        if scale_mode == "floor":
            expected = max(-127, kk - 1 - ref.MX_FORMATS[fmt][2])
        else:
            expected = max(-127, math.ceil(math.log2(float(a) / MAXN[fmt]) - 1e-12)
                           if a > 0 else -127)
        assert e == expected, (k, e, expected)
    if scale_mode == "floor":
        # Mid-range: the block max saturates to max_normal * 2**(k - 1 - emax).
        k = 10
        row = list(ks).index(k)
        assert out[row, 0].item() == MAXN[fmt] * 2.0 ** (k - 1 - ref.MX_FORMATS[fmt][2])


@pytest.mark.parametrize("fmt", MX)
def test_huge_outlier_float32_max(fmt):
    x = np.ones((1, 32), dtype=np.float32)
    x[0, 7] = FP32_MAX
    out = fake_quantize(torch.from_numpy(x), fmt)
    emax = ref.MX_FORMATS[fmt][2]
    assert out[0, 7].item() == MAXN[fmt] * 2.0 ** (127 - emax)
    assert torch.isfinite(out).all()
    assert_same(out, ref.mx_reference(x, fmt))
    x[0, 7] = -FP32_MAX
    assert fake_quantize(torch.from_numpy(x), fmt)[0, 7].item() == -MAXN[fmt] * 2.0 ** (127 - emax)


@pytest.mark.parametrize("fmt", MX)
def test_tiny_blocks_use_the_subnormal_scale_exactly(fmt):
    """P5: blocks whose scale clamps to 2**-127 (amax < 2**-118 for E4M3) are not halved."""
    g = np.random.default_rng(6)
    top = -126 + ref.MX_FORMATS[fmt][2]    # amax < 2**top -> floor(log2 amax) - emax < -127
    x = (g.uniform(-1, 1, size=(8, 32)) * np.exp2(g.integers(-135, top, size=(8, 1))))
    x = x.astype(np.float32)
    x[0, 0] = 2.0 ** (top - 1)
    exps = mx_shared_exponents(torch.from_numpy(x), fmt)
    assert (exps == -127).all()
    out = fake_quantize(torch.from_numpy(x), fmt)
    assert_same(out, ref.mx_reference(x, fmt))
    # The element grid is simply scaled by 2**-127: 2**-119 = 2**8 * 2**-127 is on it.
    assert out[0, 0].item() == 2.0 ** (top - 1)


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("n", [33, 70, 5, 1, 64])
def test_partial_blocks_equal_zero_padding(fmt, n):
    x = torch.from_numpy(wide_random((3, n), seed=n, lo=-8, hi=8))
    npad = -(-n // 32) * 32
    padded = torch.zeros(3, npad)
    padded[:, :n] = x
    expected = fake_quantize(padded, fmt)[:, :n]
    out = fake_quantize(x, fmt)
    assert out.shape == x.shape
    assert_same(out, expected.numpy())
    assert_same(out, ref.mx_reference(x.numpy(), fmt))


@pytest.mark.parametrize("fmt", MX)
def test_every_axis_of_a_3d_tensor(fmt):
    x = torch.from_numpy(wide_random((20, 33, 40), seed=7, lo=-10, hi=10))
    for axis in (0, 1, 2, -1, -2, -3):
        moved = x.movedim(axis, -1).contiguous()
        expected = fake_quantize(moved, fmt).movedim(-1, axis)
        assert_same(fake_quantize(x, fmt, axis=axis), expected.numpy(), f"axis {axis}")
        exps = mx_shared_exponents(x, fmt, axis=axis)
        assert torch.equal(exps, mx_shared_exponents(moved, fmt).movedim(-1, axis))
    assert_same(fake_quantize(x, fmt, axis=-1), ref.mx_reference(x.numpy(), fmt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ALL_QUANT + ("bf16", "fp16"))
def test_non_contiguous_inputs(fmt, dtype):
    base = torch.from_numpy(wide_random((96, 80), seed=8, lo=-10, hi=10)).to(dtype)
    views = [base.t(), base[:, ::2], base[1::3, 5:70], base.view(96, 2, 40).permute(2, 0, 1),
             base[:1].expand(5, 80)]
    for v in views:
        assert not v.is_contiguous()
        for axis in range(v.dim()):
            expected = fake_quantize(v.contiguous(), fmt, axis=axis)
            out = fake_quantize(v, fmt, axis=axis)
            assert out.shape == v.shape
            assert torch.equal(out, expected) or (
                torch.isnan(out).eq(torch.isnan(expected)).all()
                and torch.equal(out.nan_to_num(), expected.nan_to_num()))


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("fmt", ALL_QUANT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_equal_float32_of_the_upcast(fmt, dtype, scale_mode):
    lo, hi = (-30, 30) if dtype == torch.bfloat16 else (-20, 14)
    x = torch.from_numpy(wide_random((16, 100), seed=9, lo=lo, hi=hi)).to(dtype)
    x[0, :40] = torch.tensor(2.0 ** -127).to(dtype) if dtype == torch.bfloat16 else 2.0 ** -20
    x[1, 3] = float("nan")
    x[2, :32] = 0.0
    x[3, 40] = -float("inf")
    if dtype == torch.bfloat16:
        x[4, :32] = torch.tensor(FP32_MAX).to(dtype)
    sat = True if fmt == "hifp8" else None
    out = fake_quantize(x, fmt, scale_mode=scale_mode, saturate=sat)
    assert out.dtype == dtype and out.shape == x.shape
    expected = fake_quantize(x.float(), fmt, scale_mode=scale_mode, saturate=sat).to(dtype)
    assert_same(out.float(), expected.float().numpy())


def test_float64_inputs_match_the_reference():
    x = wide_random((4, 96), seed=10, lo=-20, hi=20).astype(np.float64)
    x += np.random.default_rng(11).uniform(-1, 1, x.shape) * 2.0 ** -40 * np.abs(x)  # > fp32 bits
    for fmt in MX:
        out = fake_quantize(torch.from_numpy(x), fmt)
        assert out.dtype == torch.float64
        expected = mx_reference_f64(x, fmt)
        assert_same(out, expected, fmt)
    out = fake_quantize(torch.from_numpy(x), "hifp8")
    assert_same(out, ref.hif8_reference(x))


def mx_reference_f64(x, fmt):
    """MX reference for float64 inputs: exact grid rounding (no float32 step in between)."""
    e = ref.mx_reference_exponents(x, fmt)
    scale = np.ldexp(1.0, np.repeat(e, 32, axis=-1)[..., :x.shape[-1]])
    grid = np.array([v for v, _ in ref.mx_positive_grid(fmt)])
    mag = np.minimum(np.abs(x / scale), MAXN[fmt])
    idx = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    codes = dict(ref.mx_positive_grid(fmt))
    even_lo = np.array([codes[v] % 2 == 0 for v in lo.ravel()]).reshape(lo.shape)
    q = np.where(mag - lo < hi - mag, lo, np.where(mag - lo > hi - mag, hi,
                                                   np.where(even_lo, lo, hi)))
    return np.sign(x) * q * scale


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_pass_through_formats(fmt):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    x = torch.from_numpy(wide_random((50,), seed=12, lo=-10, hi=10))
    assert torch.equal(fake_quantize(x, fmt), x.to(dtype).float())
    xb = x.to(torch.bfloat16)
    assert torch.equal(fake_quantize(xb, fmt), xb.to(dtype).to(torch.bfloat16))


def test_float64_pass_through_rounds_once():
    """P6: torch casts float64 -> bf16 through float32; 1 + 2**-8 + 2**-30 must go up."""
    x = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -8, 3.3e38, 3.4e38, -65519.9,
                      -65520.0, 2.0 ** -134, 1.5 * 2.0 ** -133], dtype=torch.float64)
    assert_same(fake_quantize(x, "bf16"), [1 + 2.0 ** -7, 1.0, 3.2964854295465914e38, math.inf,
                                           -65536.0, -65536.0, 0.0, 2.0 ** -132])
    assert_same(fake_quantize(x, "fp16"), [1 + 2.0 ** -8, 1 + 2.0 ** -8, math.inf, math.inf,
                                           -65504.0, -math.inf, 0.0, 0.0])


def test_inputs_requiring_grad_give_plain_results():
    x = torch.randn(4, 64, requires_grad=True)
    for fmt in ALL_QUANT:
        out = fake_quantize(x, fmt)
        assert not out.requires_grad
        assert torch.equal(out, fake_quantize(x.detach(), fmt))


def test_none_returns_the_input():
    x = torch.randn(3, 5)
    assert fake_quantize(x, "none") is x


# ---------------------------------------------------------------------------------------------
# Scale modes and shared exponents
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,amax,floor_val,rceil_val", [
    ("mxfp8_e4m3", 500.0, 448.0, 512.0),
    ("mxfp4", 7.0, 6.0, 8.0),
    ("mxfp8_e4m3", 448.0, 448.0, 448.0),
    ("mxfp8_e4m3", 449.0, 448.0, 448.0),
])
def test_floor_vs_rceil_examples(fmt, amax, floor_val, rceil_val):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    assert fake_quantize(x, fmt, scale_mode="floor")[0, 0].item() == floor_val
    assert fake_quantize(x, fmt, scale_mode="rceil")[0, 0].item() == rceil_val


def test_rceil_biased_exponent_126_for_amax_150():
    x = torch.full((1, 32), 3.0)
    x[0, 9] = 150.0
    assert mx_shared_exponents(x, "mxfp8", scale_mode="rceil").item() + 127 == 126
    assert mx_shared_exponents(x, "mxfp8", scale_mode="floor").item() == 7 - 8


@pytest.mark.parametrize("fmt", MX)
def test_rceil_exponent_at_exact_multiples_of_max_normal(fmt):
    """amax = max_normal * 2**k needs exactly 2**k; one ulp more needs 2**(k + 1)."""
    ks = np.arange(-100, 100, 7)
    amax = (MAXN[fmt] * np.exp2(ks)).astype(np.float32)
    x = np.zeros((len(ks), 2, 32), dtype=np.float32)
    x[:, 0, 0] = amax
    x[:, 1, 0] = np.nextafter(amax, np.float32(np.inf))
    e = mx_shared_exponents(torch.from_numpy(x), fmt, scale_mode="rceil")[..., 0]
    assert e[:, 0].tolist() == ks.tolist()
    assert e[:, 1].tolist() == (ks + 1).tolist()


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("fmt", MX)
def test_shared_exponents_from_python_frexp(fmt, scale_mode):
    x = wide_random((5, 3, 100), seed=13, lo=-140, hi=127)
    x[0, 0, :32] = 0
    out = mx_shared_exponents(torch.from_numpy(x), fmt, axis=-1, scale_mode=scale_mode)
    assert out.dtype == torch.int32 and out.shape == (5, 3, 4)
    emax, maxn = ref.MX_FORMATS[fmt][2], MAXN[fmt]
    for idx in np.ndindex(5, 3, 4):
        block = [abs(float(v)) for v in x[idx[0], idx[1], idx[2] * 32:(idx[2] + 1) * 32]]
        amax = max(block)
        if amax == 0:
            expected = -127
        elif scale_mode == "floor":
            expected = math.frexp(amax)[1] - 1 - emax
        elif scale_mode == "ceil":    # ceil(log2 amax) - emax; log2 is whole iff mantissa 1/2
            mant, k = math.frexp(amax)
            expected = k - (mant == 0.5) - emax
        elif scale_mode == "even":    # amax's mantissa rounded half up to mbits, then floor
            mant, k = math.frexp(amax)
            steps = 2 ** (ref.MX_MANTISSA_BITS[fmt] + 1)       # mant in [1/2, 1) in 1/steps
            expected = k - 1 - emax + (math.floor(mant * steps + 0.5) == steps)
        else:   # smallest e with maxn * 2**e >= amax, by exact float64 comparisons
            expected = math.frexp(amax)[1] - math.frexp(maxn)[1]
            while math.ldexp(maxn, expected) < amax:
                expected += 1
            while math.ldexp(maxn, expected - 1) >= amax:
                expected -= 1
        assert out[idx].item() == min(127, max(-127, expected)), (idx, amax)
    # Along another axis the shape follows.
    assert mx_shared_exponents(torch.from_numpy(x), fmt, axis=0).shape == (1, 3, 100)


# ---------------------------------------------------------------------------------------------
# HiFP8 per-tensor scaling
# ---------------------------------------------------------------------------------------------

def test_hifp8_scaled_fake_quantize():
    x = wide_random((300,), seed=14, lo=-12, hi=12)
    amax = float(np.abs(x).max())
    k = 3 - (math.frexp(amax)[1] - 1)
    expected = ref.hif8_reference(x.astype(np.float64) * 2.0 ** k, saturate=True) * 2.0 ** -k
    out = hifp8_scaled_fake_quantize(torch.from_numpy(x))
    assert_same(out, expected)
    scaled_max = amax * 2.0 ** k
    assert 8 <= scaled_max < 16
    out15 = hifp8_scaled_fake_quantize(torch.from_numpy(x), target_exponent=15)
    expected15 = ref.hif8_reference(x * 2.0 ** (k + 12), saturate=True) * 2.0 ** -(k + 12)
    assert_same(out15, expected15)
    assert torch.equal(hifp8_scaled_fake_quantize(torch.zeros(4)), torch.zeros(4))
    xb = torch.from_numpy(x).bfloat16()
    assert torch.equal(hifp8_scaled_fake_quantize(xb),
                       hifp8_scaled_fake_quantize(xb.float()).bfloat16())


# ---------------------------------------------------------------------------------------------
# Names, info and errors
# ---------------------------------------------------------------------------------------------

def test_format_names_and_info():
    assert set(FORMAT_NAMES) == {"mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxfp6_e2m3",
                                 "mxfp6_e3m2", "nvfp4", "fp8_e4m3", "fp8_e5m2", "hifp8",
                                 "bf16", "fp16", "none"}
    assert canonical_format("mxfp8") == "mxfp8_e4m3"
    assert all(canonical_format(canonical_format(n)) == canonical_format(n) for n in FORMAT_NAMES)
    e4 = format_info("mxfp8")
    assert (e4.name, e4.kind, e4.block_size, e4.emax_elem, e4.max_normal, e4.min_normal,
            e4.min_subnormal, e4.mantissa_bits) == ("mxfp8_e4m3", "mx", 32, 8, 448.0, 2.0 ** -6,
                                                    2.0 ** -9, 3)
    e5 = format_info("mxfp8_e5m2")
    assert (e5.emax_elem, e5.max_normal, e5.min_normal, e5.min_subnormal) == (
        15, 57344.0, 2.0 ** -14, 2.0 ** -16)
    f4 = format_info("mxfp4")
    assert (f4.emax_elem, f4.max_normal, f4.min_normal, f4.min_subnormal, f4.mantissa_bits) == (
        2, 6.0, 1.0, 0.5, 1)
    h = format_info("hifp8")
    assert (h.kind, h.block_size, h.max_normal, h.min_normal, h.min_subnormal,
            h.overflow_threshold, h.mantissa_bits) == ("hifp8", None, 32768.0, 2.0 ** -15,
                                                       2.0 ** -22, 40960.0, 3)
    assert format_info("bf16").kind == "float" and format_info("none").kind == "none"
    for fmt in MX:   # the info agrees with the decoded grids
        grid = [v for v, _ in ref.mx_positive_grid(fmt)]
        info = format_info(fmt)
        assert info.max_normal == grid[-1] and info.min_subnormal == grid[1]
    with pytest.raises(AttributeError):
        e4.max_normal = 1.0


def test_bad_arguments():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="mxfp8_e5m2.*hifp8"):
        fake_quantize(x, "fp8")
    with pytest.raises(ValueError, match="valid formats"):
        canonical_format("MXFP9")
    with pytest.raises(TypeError, match="torch.int32"):
        fake_quantize(torch.ones(4, 32, dtype=torch.int32), "mxfp8")
    with pytest.raises(TypeError, match="torch.int64"):
        mx_shared_exponents(torch.ones(4, 32, dtype=torch.int64), "mxfp8")
    with pytest.raises(ValueError, match=r"axis 2 .*ndim 2"):
        fake_quantize(x, "mxfp8", axis=2)
    with pytest.raises(ValueError, match=r"axis -3 .*ndim 2"):
        mx_shared_exponents(x, "mxfp4", axis=-3)
    with pytest.raises(ValueError, match="floor, rceil"):
        fake_quantize(x, "mxfp8", scale_mode="round")
    with pytest.raises(ValueError, match="saturate"):
        fake_quantize(x, "mxfp8", saturate=True)
    with pytest.raises(ValueError, match="saturate"):
        fake_quantize(x, "mxfp4", saturate=False)
    with pytest.raises(ValueError, match="not an MX format"):
        mx_shared_exponents(x, "hifp8")
    assert torch.equal(fake_quantize(x, "hifp8", saturate=False), fake_quantize(x, "hifp8"))


def test_empty_and_scalar_tensors():
    assert fake_quantize(torch.empty(0, 32), "mxfp8").shape == (0, 32)
    assert fake_quantize(torch.empty(3, 0), "mxfp4").shape == (3, 0)
    assert fake_quantize(torch.tensor(1.0625), "hifp8").item() == 1.125
    with pytest.raises(ValueError, match="ndim 0"):
        fake_quantize(torch.tensor(1.0), "mxfp8")


# ---------------------------------------------------------------------------------------------
# Implementation paths that must agree exactly
# ---------------------------------------------------------------------------------------------

def _native_fp8_casts(monkeypatch, dtype, enabled: bool) -> None:
    """The element rounding of `dtype` inputs by torch's fp8 casts (True) or by the generic
    grid rounding (False): the read-only table formats.elements reads, replaced."""
    from types import MappingProxyType
    table = dict(formats_module.elements.NATIVE_FP8_CASTS)
    table[dtype] = enabled
    monkeypatch.setattr(formats_module.elements, "NATIVE_FP8_CASTS", MappingProxyType(table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_fp8_casts_equal_generic_grid_rounding(dtype, monkeypatch):
    x = torch.from_numpy(wide_random((32, 128), seed=15, lo=-40, hi=40)).to(dtype)
    x[0, 0] = float("nan")
    x[1, 40] = 2.0 ** -130
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
        for mode in SCALE_MODES:
            _native_fp8_casts(monkeypatch, dtype, True)
            a = fake_quantize(x, fmt, scale_mode=mode)
            with monkeypatch.context() as m:    # as if the fp8 cast did not saturate
                m.setattr(formats_module.elements, "_SATURATING_CPU_CASTS", set())
                b = fake_quantize(x, fmt, scale_mode=mode)
            _native_fp8_casts(monkeypatch, dtype, False)
            c = fake_quantize(x, fmt, scale_mode=mode)
            assert_same(a.float(), c.float().numpy(), fmt)
            assert_same(b.float(), c.float().numpy(), fmt)


def test_kernel_mode_is_an_explicit_argument():
    # The kernel mode is an argument (no process global): "auto" by default, which runs CPU
    # tensors eagerly (never compiled); "compile" and "eager" are taken as asked; an unknown
    # mode is an error naming the valid ones.
    import inspect

    from megatron.quantization import dispatch
    from megatron.quantization.config import KERNEL_MODES, BackendSettings

    x = torch.randn(4, 32)
    call = formats_module.prepare_call(x, "mxfp8")
    assert KERNEL_MODES == ("auto", "triton", "compile", "eager")
    assert inspect.signature(fake_quantize).parameters["kernels"].default == "auto"
    assert BackendSettings().kernels == "auto"
    assert dispatch.quantize_backend(x, call, "auto") == "eager"     # eager is the default
    assert dispatch.quantize_backend(x, call, "compile") == "compile"
    assert dispatch.quantize_backend(x, call, "eager") == "eager"
    assert dispatch.check_kernel_mode("compile") == "compile"
    for bad in (lambda: dispatch.check_kernel_mode("fast"),
                lambda: dispatch.quantize_backend(x, call, "fast"),
                lambda: fake_quantize(x, "mxfp8", kernels="fast")):
        with pytest.raises(ValueError, match="'fast'.*auto, triton, compile, eager"):
            bad()


def test_compiled_variant_is_identical():
    x = torch.from_numpy(wide_random((8, 70), seed=16, lo=-30, hi=20))
    x[0, 1], x[1, 2], x[2, :32] = float("nan"), -float("inf"), 0.0
    x[3, 3] = -1e-30
    x[4, :32] = 2.0 ** -125
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for fmt, axis in (("mxfp8_e4m3", -1), ("mxfp4", 0), ("hifp8", -1)):
            assert_same(fake_quantize(xd, fmt, axis=axis, kernels="compile").float(),
                        formats_module.fake_quantize(xd, fmt, axis=axis).float().numpy(),
                        f"{fmt} {dtype}")
