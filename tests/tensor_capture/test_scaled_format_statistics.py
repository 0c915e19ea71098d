"""Statistics of NVFP4, FP8 and MXFP6 operands (capture's quant_error and the telemetry's
operand_statistics) against expectations derived here in numpy: NVFP4's E4M3 block scales and
tensor scale by the design note's float32 sequence (E4M3 rounding by ml_dtypes after the clamp
at 448), FP8 scales as (fp8_max * 2^-margin) / amax in float32, the elements the clamp changes
(scaled |v| >= 7 for E2M1, > 464 for E4M3, >= 61440 for E5M2), MXFP6 saturation and shared
exponents from the block maxima by the OCP rule."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron.quantization.formats import fake_quantize
from megatron.tensor_capture.operand_sums import operand_statistics
from megatron.tensor_capture.stats import quant_error
from megatron.tensor_capture.telemetry import metrics

F32 = np.float32
# Magnitudes a scaled element value must reach before the clamp changes it (RNE ties at
# max + half a step go to the odd-mantissa max for E4M3 (448 = 1.110b), beyond it otherwise).
CLAMPED = {"nvfp4": (7.0, True), "fp8_e4m3": (464.0, False), "fp8_e5m2": (61440.0, True)}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _clamped(v: np.ndarray, fmt: str) -> int:
    t, inclusive = CLAMPED[fmt]
    a = np.abs(v)
    return int(np.count_nonzero(a >= t if inclusive else a > t))


def _exponent_hist(values: np.ndarray) -> dict:
    e = np.floor(np.log2(values.astype(np.float64))).astype(int)   # exact for these values
    return {"min": int(e.min()), "counts": np.bincount(e - e.min()).tolist()}


def _nvfp4_operand(dtype=torch.bfloat16, shape=(48, 160), seed=0):
    """Blocks of every kind: normal scales, subnormal ones (some whose E4M3 rounding falls far
    enough below S for elements to clamp at 6), scales that round to 0, all-zero blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[0, 0] = 1000.0                         # the tensor amax: a block of amax a gets
    #                                          S = a / 1000 * 448
    x[1, :16] *= 1e-3                        # S ~ 1e-3: subnormal E4M3 scales
    x[2, :16] = torch.linspace(-1.0, 1.0, 16) * (1.4 * 2.0 ** -9 * 1000 / 448)  # s < S: clamps
    x[3, :32] *= 1e-7                        # S ~ 1e-7 -> scale 0: the blocks become 0
    x[4, :16] = 0.0                          # an all-zero block: scale 0
    return x.to(dtype)


def _nvfp4_expected(x: torch.Tensor, axis: int, amax=None):
    """(block scales s, s_enc, clamped count) by the design note's float32 sequence."""
    a = x.float().numpy()
    moved = np.moveaxis(a, axis, -1)
    pad = -moved.shape[-1] % 16
    blocks = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)]).reshape(
        *moved.shape[:-1], -1, 16)
    amax = F32(np.abs(a).max()) if amax is None else F32(amax)
    s_enc = F32(min(F32(2688.0) / amax, np.finfo(np.float32).max)) if amax else F32(1.0)
    s_dec = F32(1.0) / s_enc
    block_amax = np.abs(blocks).max(axis=-1, keepdims=True)
    big = block_amax * F32(s_enc * F32(1.0 / 6.0))
    s = np.minimum(big, F32(448.0)).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    with np.errstate(divide="ignore"):
        enc = np.minimum(F32(1.0) / (s * s_dec), np.finfo(np.float32).max).astype(F32)
    v = blocks * enc
    return s[..., 0], s_enc, _clamped(v, "nvfp4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nvfp4_block_scales_and_saturation(dtype, axis):
    x = _nvfp4_operand(dtype)
    q = fake_quantize(x, "nvfp4", axis=axis)
    s, s_enc, clamped = _nvfp4_expected(x, axis)
    zero, subnormal = np.count_nonzero(s == 0), np.count_nonzero((s > 0) & (s < 2.0 ** -6))
    nonzero = s[s > 0]
    if axis == -1:
        assert zero >= 3 and subnormal >= 1 and clamped > 0      # the checks are not vacuous
    err = quant_error(x, q, "nvfp4", axis, options={"block_2d": False})
    assert err["tensor_scale"] == float(s_enc)
    assert err["blocks"] == s.size and err["nan_blocks"] == 0
    assert err["block_scale_zero_fraction"] == zero / s.size
    assert err["block_scale_subnormal_fraction"] == subnormal / s.size
    assert (err["block_scale_min"], err["block_scale_max"]) == (nonzero.min(), nonzero.max())
    assert err["block_scale_hist"] == _exponent_hist(nonzero)
    assert err["saturated_fraction"] == clamped / x.numel()
    sums, maxima, _ = operand_statistics(x, q, "nvfp4", axis, options={"block_2d": False})
    got = metrics(sums.tolist(), maxima.tolist(), "nvfp4")
    assert got["block_scale_zero_pct"] == pytest.approx(100 * zero / s.size, abs=1e-12)
    assert got["block_scale_subnormal_pct"] == pytest.approx(100 * subnormal / s.size,
                                                             abs=1e-12)
    assert got["saturated_pct"] == pytest.approx(100 * clamped / x.numel(), abs=1e-12)
    assert got["tensor_scale_min"] == got["tensor_scale_max"] == float(s_enc)
    assert (got["block_scale_min"], got["block_scale_max"]) == (nonzero.min(), nonzero.max())


def test_nvfp4_2d_tiles_and_an_imposed_amax():
    """16x16 weight tiles: one scale per tile, whatever the axis; an imposed amax (a piece of
    a larger operand) sets the tensor scale."""
    x = _nvfp4_operand(shape=(40, 72))
    q = fake_quantize(x, "nvfp4", axis=1, block_2d=True, amax=2000.0)
    err = quant_error(x, q, "nvfp4", 1, options={"block_2d": True, "amax": 2000.0})
    a = np.abs(np.pad(x.float().numpy(), [(0, 8), (0, 8)])).reshape(3, 16, 5, 16)
    s_enc = F32(2688.0) / F32(2000.0)
    s = np.minimum(a.max(axis=(1, 3)) * F32(s_enc * F32(1.0 / 6.0)), F32(448.0)).astype(
        ml_dtypes.float8_e4m3fn).astype(F32)
    assert err["blocks"] == 15 and err["tensor_scale"] == float(s_enc)
    assert err["block_scale_zero_fraction"] == np.count_nonzero(s == 0) / 15
    assert (err["block_scale_min"], err["block_scale_max"]) == (s[s > 0].min(), s.max())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("amax", [None, 2.5], ids=["current", "delayed"])
def test_fp8_tensor_scale_and_delayed_saturation(fmt, amax):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 96, generator=g) * 2).bfloat16()
    options = {"scaling": "tensor", "amax": amax, "margin": 0, "pow2_scale": False}
    q = fake_quantize(x, fmt, axis=-1, **options)
    a = x.float().numpy()
    used = F32(np.abs(a).max()) if amax is None else F32(amax)
    scale = F32(FP8_MAX[fmt]) / used
    clamped = _clamped(a * scale, fmt)
    if amax is not None:                     # the values beyond the delayed scale's range
        assert clamped > 0
    err = quant_error(x, q, fmt, 1, options=options)
    assert err["tensor_scale"] == float(scale)
    assert err["saturated_fraction"] == clamped / x.numel()
    assert "blocks" not in err
    got = metrics(*(t.tolist() for t in operand_statistics(x, q, fmt, 1, options=options)[:2]),
                  fmt)
    assert got["tensor_scale_min"] == got["tensor_scale_max"] == float(scale)
    assert got["saturated_pct"] == pytest.approx(100 * clamped / x.numel(), abs=1e-12)
    assert "block_scale_min" not in got and "block_scale_zero_pct" not in got


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_fp8_blockwise_scales(block):
    """Tile scales (fp8_max * 2^-margin) / tile amax; a negative margin makes the largest
    elements of each tile clamp; an all-zero tile keeps its placeholder scale 1 out of the
    range."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 300, generator=g) * torch.exp2(torch.randint(-8, 8, (200, 1),
                                                                      generator=g).float())
    x[:, 256:] = 0.0                          # all-zero tiles (both tilings)
    options = {"scaling": "block", "block": block, "margin": -1, "pow2_scale": False}
    q = fake_quantize(x, "fp8_e4m3", axis=-1, **options)
    a = x.numpy()
    if block == (1, 128):
        tiles = np.pad(a, [(0, 0), (0, 84)]).reshape(200, 3, 1, 128)
    else:
        tiles = np.pad(a, [(0, 56), (0, 84)]).reshape(2, 128, 3, 128).transpose(0, 2, 1, 3)
    tile_amax = np.abs(tiles).max(axis=(-2, -1))
    with np.errstate(divide="ignore"):
        scales = np.where(tile_amax > 0, F32(896.0) / tile_amax.astype(F32), F32(1.0))
    valid = scales[tile_amax > 0]
    spread = scales[..., None, None]
    clamped = _clamped(tiles * spread, "fp8_e4m3")
    assert clamped > 0
    err = quant_error(x, q, "fp8_e4m3", 1, options=options)
    assert err["blocks"] == scales.size and err["nan_blocks"] == 0
    assert (err["block_scale_min"], err["block_scale_max"]) == (valid.min(), valid.max())
    assert err["block_scale_hist"] == _exponent_hist(valid)
    assert err["saturated_fraction"] == clamped / x.numel()
    assert "tensor_scale" not in err and "block_scale_zero_fraction" not in err
    got = metrics(*(t.tolist() for t in operand_statistics(
        x, q, "fp8_e4m3", 1, options=options)[:2]), "fp8_e4m3")
    assert (got["block_scale_min"], got["block_scale_max"]) == (valid.min(), valid.max())
    assert got["saturated_pct"] == pytest.approx(100 * clamped / x.numel(), abs=1e-12)


@pytest.mark.parametrize("fmt,max_normal,emax", [("mxfp6_e2m3", 7.5, 2),
                                                 ("mxfp6_e3m2", 28.0, 4)])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mxfp6_saturation_and_exponents(fmt, max_normal, emax, scale_mode):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 96, generator=g) * torch.exp2(
        torch.randint(-10, 10, (40, 96), generator=g).float())).bfloat16()
    q = fake_quantize(x, fmt, axis=-1, scale_mode=scale_mode)
    blocks = np.abs(x.double().numpy()).reshape(40, 3, 32)
    amax = blocks.max(axis=-1, keepdims=True)
    e = np.floor(np.log2(amax)) - emax if scale_mode == "floor" else \
        np.ceil(np.log2(amax / max_normal))
    saturated = np.count_nonzero(blocks > max_normal * np.exp2(e))
    err = quant_error(x, q, fmt, 1, scale_mode)
    assert err["saturated_fraction"] == saturated / x.numel()
    hist = err["scale_exponent_hist"]
    assert (hist["min"], hist["min"] + len(hist["counts"]) - 1) == (e.min(), e.max())
    got = metrics(*(t.tolist() for t in operand_statistics(x, q, fmt, 1, scale_mode)[:2]),
                  fmt)
    assert (got["scale_exp_min"], got["scale_exp_max"]) == (e.min(), e.max())
    assert got["saturated_pct"] == pytest.approx(100 * saturated / x.numel(), abs=1e-12)
    if scale_mode == "floor":
        assert saturated > 0


@pytest.mark.parametrize("fmt,options", [
    ("nvfp4", {"block_2d": False}),
    ("fp8_e5m2", {"scaling": "tensor", "amax": 3.0, "margin": 0, "pow2_scale": True}),
    ("fp8_e4m3", {"scaling": "block", "block": (1, 128), "pow2_scale": True}),
])
def test_pieces_add_up(fmt, options):
    """Telemetry sums of two halves (micro-batches) add up to those of the whole; the scale
    ranges are the maxima of the halves' (an imposed amax: the same tensor scale)."""
    x = _nvfp4_operand(shape=(64, 128))
    halves = [x[:32], x[32:]]
    parts = [operand_statistics(h, fake_quantize(h, fmt, axis=-1, **options), fmt, -1,
                                options=options) for h in halves]
    whole_sums = parts[0][0] + parts[1][0]
    got = metrics(whole_sums.tolist(), torch.maximum(parts[0][1], parts[1][1]).tolist(), fmt)
    errors = [quant_error(h, fake_quantize(h, fmt, axis=-1, **options), fmt, -1,
                          options=options) for h in halves]
    assert got["saturated_pct"] == pytest.approx(
        100 * sum(e["saturated_fraction"] for e in errors) / 2, abs=1e-12)
    if fmt == "nvfp4":
        assert got["block_scale_zero_pct"] == pytest.approx(
            100 * sum(e["block_scale_zero_fraction"] for e in errors) / 2, abs=1e-12)
        scales = [e["tensor_scale"] for e in errors]
        assert (got["tensor_scale_min"], got["tensor_scale_max"]) == (min(scales), max(scales))


def test_nonfinite_operands():
    """NaN anywhere makes NVFP4 and current-scaled FP8 all NaN: nothing counts as saturated and
    the scales are undefined; under delayed scaling only the NaN position is lost."""
    x = _nvfp4_operand(torch.float32)
    x[7, 7] = math.nan
    err = quant_error(x, fake_quantize(x, "nvfp4"), "nvfp4", -1, options={})
    assert err["tensor_scale"] is None and err["nan_blocks"] == err["blocks"]
    assert err["saturated_fraction"] == 0 and err["block_scale_min"] is None
    current = {"scaling": "tensor"}
    err = quant_error(x, fake_quantize(x, "fp8_e4m3", **current), "fp8_e4m3", -1,
                      options=current)
    assert err["saturated_fraction"] == 0 and err["nonfinite_fraction"] == 1.0
    delayed = {"scaling": "tensor", "amax": 10.0}
    q = fake_quantize(x, "fp8_e4m3", amax=10.0)
    err = quant_error(x, q, "fp8_e4m3", -1, options=delayed)
    finite = x.isfinite()
    expected = _clamped(x[finite].numpy() * (F32(448.0) / F32(10.0)), "fp8_e4m3")
    assert err["saturated_fraction"] == expected / (x.numel() - 1) > 0
    assert err["nonfinite_fraction"] == 1 / x.numel()
