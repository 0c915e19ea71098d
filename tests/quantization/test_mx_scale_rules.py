"""The four MX scale rules (--mx-scale-mode floor|rceil|ceil|even): hand-derived shared
exponents and values, the frexp reference of tests/fp4_reference.py on every MX format, and
torchao 0.18.0's ScaleCalculationMode (its to_mx) with every class of difference asserted.

The expectations are derived by hand from the rules' definitions (torchao's config.py):
floor: floor(log2 amax) - emax; rceil: ceil(log2(amax / max_normal)); ceil: ceil(log2 amax)
- emax; even: floor after amax's mantissa is rounded half up to the element's mantissa bits.
"""

import numpy as np
import pytest
import torch

import fp4_reference as ref
from megatron.quantization import fake_quantize, format_info, mx_shared_exponents
from megatron.quantization.config import SettingError, settings_from_flags

RULES = ("floor", "rceil", "ceil", "even")
MX_ALL = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2")

# (format, block amax, {rule: shared exponent}), worked out by hand. emax / mbits / max_normal:
# E4M3 8 / 3 / 448 = 1.75 * 2**8, E5M2 15 / 2 / 1.75 * 2**15, E3M2 4 / 2 / 1.75 * 2**4,
# E2M3 2 / 3 / 1.875 * 2**2, E2M1 2 / 1 / 1.5 * 2**2. The even rule's threshold is
# 2 - 2**-(mbits + 1): 1.9375 (mbits 3), 1.875 (2), 1.75 (1).
HAND_DERIVED = [
    ("mxfp8_e4m3", 1.0, dict(floor=-8, rceil=-8, ceil=-8, even=-8)),
    ("mxfp8_e4m3", 1.5, dict(floor=-8, rceil=-8, ceil=-7, even=-8)),
    ("mxfp8_e4m3", 1.75, dict(floor=-8, rceil=-8, ceil=-7, even=-8)),       # = 448 * 2**-8
    ("mxfp8_e4m3", 1.90625, dict(floor=-8, rceil=-7, ceil=-7, even=-8)),    # below 1.9375
    ("mxfp8_e4m3", 1.9375, dict(floor=-8, rceil=-7, ceil=-7, even=-7)),
    ("mxfp8_e5m2", 1.8, dict(floor=-15, rceil=-14, ceil=-14, even=-15)),
    ("mxfp8_e5m2", 1.875, dict(floor=-15, rceil=-14, ceil=-14, even=-14)),
    ("mxfp6_e3m2", 1.875, dict(floor=-4, rceil=-3, ceil=-3, even=-3)),
    ("mxfp6_e3m2", 1.625, dict(floor=-4, rceil=-4, ceil=-3, even=-4)),
    ("mxfp6_e2m3", 1.875, dict(floor=-2, rceil=-2, ceil=-1, even=-2)),      # = 7.5 * 2**-2
    ("mxfp6_e2m3", 1.9375, dict(floor=-2, rceil=-1, ceil=-1, even=-1)),
    ("mxfp4", 1.5, dict(floor=-2, rceil=-2, ceil=-1, even=-2)),             # = 6 * 2**-2
    ("mxfp4", 1.7, dict(floor=-2, rceil=-1, ceil=-1, even=-2)),
    ("mxfp4", 1.75, dict(floor=-2, rceil=-1, ceil=-1, even=-1)),
    ("mxfp4", 4.0, dict(floor=0, rceil=0, ceil=0, even=0)),                 # a power of two
]


@pytest.mark.parametrize("shift", [0, 20, -30])
@pytest.mark.parametrize("fmt, amax, expected", HAND_DERIVED)
def test_hand_derived_exponents(fmt, amax, expected, shift):
    """A block whose largest magnitude is amax * 2**shift (negative, among smaller values) has
    the hand-derived exponent + shift under each rule; a dtype change does not move it."""
    x = torch.full((2, 32), 0.25 * 2.0 ** shift)
    x[0, 5] = -amax * 2.0 ** shift
    x[1, 31] = amax * 2.0 ** shift
    for rule in RULES:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            if dtype == torch.bfloat16 and amax == 1.8:
                continue                                   # 1.8 is not a bf16 value
            e = mx_shared_exponents(x.to(dtype), fmt, scale_mode=rule)
            assert e.tolist() == [[expected[rule] + shift]] * 2, (rule, dtype)


def test_the_documented_e4m3_example():
    """docs/quantization.md: amax 1.9375 under E4M3. floor: e = -8, 1.9375 * 2**8 = 496
    saturates to 448, so the block's maximum comes back as 1.75. rceil, ceil and even: e = -7,
    248 is halfway between the E4M3 neighbours 240 (1.111b * 2**7) and 256 (1.000b * 2**8) and
    goes to the even mantissa, 256: 2.0. The other elements (0.3) come back as 0.3125 under all
    four: 0.3 * 2**8 = 76.8 -> 80 (E4M3 spacing 8 in [64, 128)) under floor, 0.3 * 2**7 =
    38.4 -> 40 (spacing 4 in [32, 64)) under the others."""
    x = torch.full((1, 32), 0.3)
    x[0, 0] = 1.9375
    for rule, top in (("floor", 1.75), ("rceil", 2.0), ("ceil", 2.0), ("even", 2.0)):
        y = fake_quantize(x, "mxfp8_e4m3", scale_mode=rule)
        assert y[0, 0].item() == top, rule
        assert (y[0, 1:] == 0.3125).all(), rule


def test_zero_subnormal_and_non_finite_blocks_under_every_rule():
    """amax 0 or an fp32 subnormal: e = -127 (the E8M0 minimum) under every rule, and the block
    comes back exactly (zeros) or rounded on that grid; NaN or Inf: the whole block is NaN."""
    x = torch.zeros(4, 32)
    x[1, 3] = 1e-40
    x[2, 7] = float("nan")
    x[3, 9] = float("inf")
    for fmt in MX_ALL:
        for rule in RULES:
            e = mx_shared_exponents(x, fmt, scale_mode=rule)
            assert e[:2].flatten().tolist() == [-127, -127], (fmt, rule)
            assert e[2:].flatten().tolist() == [128, 128], (fmt, rule)
            y = fake_quantize(x, fmt, scale_mode=rule)
            assert torch.equal(y[0], x[0]) and torch.isnan(y[2:]).all()


def test_float32_max_does_not_overflow_under_ceil_and_even():
    """amax = float32 max: ceil and even bump e to 128 - emax (still inside E8M0), and the
    dequantized block stays finite wherever it is not rounded beyond float32 max."""
    x = torch.full((1, 32), 1.0)
    x[0, 0] = torch.finfo(torch.float32).max
    for fmt in MX_ALL:
        emax = format_info(fmt).emax_elem
        for rule in ("ceil", "even"):
            assert mx_shared_exponents(x, fmt, scale_mode=rule).item() == 128 - emax
            y = fake_quantize(x, fmt, scale_mode=rule)
            assert torch.isfinite(y[0, 1:]).all()


@pytest.mark.parametrize("rule", ["ceil", "even"])
@pytest.mark.parametrize("fmt", MX_ALL)
def test_random_blocks_match_the_frexp_reference(fmt, rule):
    """Blocks over 200 binades (some at the 2**-127 clamp), a quarter with amax just at and
    below the even threshold, along both axes, in float32, bf16 and float64."""
    g = np.random.default_rng(5)
    rows = 256
    mant = g.uniform(1, 2, (rows, 96)) * g.choice([-1, 1], (rows, 96))
    binade = np.repeat(g.integers(-150, 60, (rows, 3)), 32, axis=1)
    x = (mant * np.exp2(binade - g.integers(0, 8, (rows, 96)))).astype(np.float32)
    mbits = ref.ELEMENT_MANTISSA_BITS[ref.MX_ELEMENT[fmt]]
    threshold = np.float32(2 - 2.0 ** -(mbits + 1))
    k = rows // 4
    at = threshold * np.exp2(binade[:2 * k, 0]).astype(np.float32)
    x[:k, 0], x[k:2 * k, 0] = at[:k], np.nextafter(at[k:], np.float32(0))
    x[:2 * k, 1:32] *= np.float32(0.5)                # so that x[:, 0] is its block's amax
    xt = torch.from_numpy(x)
    for axis in (-1, 0):
        moved = np.moveaxis(x.astype(np.float64), axis, -1)
        y, e, _ = ref.mx_reference(moved, ref.MX_ELEMENT[fmt], rule)
        got = fake_quantize(xt, fmt, axis=axis, scale_mode=rule)
        assert np.array_equal(got.double().numpy(), np.moveaxis(y, -1, axis)), axis
        assert np.array_equal(mx_shared_exponents(xt, fmt, axis=axis, scale_mode=rule).numpy(),
                              np.moveaxis(e, -1, axis))
    xb = xt.bfloat16()
    yb, _, _ = ref.mx_reference(xb.double().numpy(), ref.MX_ELEMENT[fmt], rule)
    assert torch.equal(fake_quantize(xb, fmt, scale_mode=rule), torch.from_numpy(yb).bfloat16())
    xd = xt.double() * (1 - 2.0 ** -40)        # float64 amax just below the float32 values
    yd, _, _ = ref.mx_reference(xd.numpy(), ref.MX_ELEMENT[fmt], rule)
    assert np.array_equal(fake_quantize(xd, fmt, scale_mode=rule).numpy(), yd)


def _torchao(x: torch.Tensor, fmt: str, rule: str):
    """(unbiased exponents, float32 dequantized values) from torchao's to_mx / to_dtype."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp6_e2m3": DTYPE_FP6_E2M3,
            "mxfp6_e3m2": DTYPE_FP6_E3M2, "mxfp8_e4m3": torch.float8_e4m3fn,
            "mxfp8_e5m2": torch.float8_e5m2}[fmt]
    scale, data = to_mx(x, elem, 32, ScaleCalculationMode(rule))
    return scale.view(torch.uint8).long() - 127, to_dtype(data, scale, elem, 32, torch.float32)


@pytest.mark.parametrize("rule", ["ceil", "even"])
@pytest.mark.parametrize("fmt", MX_ALL)
def test_differential_against_torchao(fmt, rule):
    """262,144 float32 values in blocks over 240 binades, a quarter of them with amax at the
    even threshold (and one float32 ulp below), against torchao 0.18.0. Its exponents equal
    ours in every block; its values differ only in blocks with e = -127, which it divides by
    2**-126 instead of 2**-127 (its clamp to the smallest normal, our pitfall P5)."""
    g = np.random.default_rng(17)
    rows = 2048
    mant = g.uniform(1, 2, (rows, 128)) * g.choice([-1, 1], (rows, 128))
    binade = np.repeat(g.integers(-240, 100, (rows, 4)), 32, axis=1) + 100
    x = (mant * np.exp2(binade - g.integers(0, 10, (rows, 128)) - 100)).astype(np.float32)
    mbits = ref.ELEMENT_MANTISSA_BITS[ref.MX_ELEMENT[fmt]]
    k = rows // 8
    at = (np.float32(2 - 2.0 ** -(mbits + 1))
          * np.exp2(binade[:2 * k, 0] - 100)).astype(np.float32)
    x[:k, 0], x[k:2 * k, 0] = at[:k], np.nextafter(at[k:], np.float32(0))
    x[:2 * k, 1:32] *= np.float32(0.5)                # so that x[:, 0] is its block's amax
    xt = torch.from_numpy(x)
    ours = fake_quantize(xt, fmt, scale_mode=rule)
    e = mx_shared_exponents(xt, fmt, scale_mode=rule)
    et, yt = _torchao(xt, fmt, rule)
    assert torch.equal(et, e)
    clamped = e == -127
    block_diff = (ours != yt).view(rows, 4, 32).any(-1)
    assert clamped.sum() > 500
    assert not (block_diff & ~clamped).any()
    assert block_diff.sum() > 50                      # the class is there: the check has teeth
    floor_e = mx_shared_exponents(xt, fmt, scale_mode="floor")
    bumped, free = floor_e != e, floor_e > -127
    assert bumped[free].sum() > 100
    if rule == "even":                                # at the threshold: one binade up;
        assert bumped[:k, 0][free[:k, 0]].all()       # one ulp below it: floor's e
        assert not bumped[k:2 * k, 0][free[k:2 * k, 0]].any()


def test_the_flag_takes_every_rule_and_names_them_on_a_bad_value():
    for rule in RULES:
        assert settings_from_flags(["--mx-scale-mode", rule]).mx.scale_mode == rule
    with pytest.raises(SettingError, match="'round'.*floor.*rceil.*ceil.*even"):
        settings_from_flags(["--mx-scale-mode", "round"])
    with pytest.raises(ValueError, match="'round'.*floor, rceil, ceil, even"):
        fake_quantize(torch.ones(32), "mxfp8", scale_mode="round")
