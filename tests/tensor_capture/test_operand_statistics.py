"""operand_statistics, the telemetry's per-operand sums, against expectations computed here
in float64 numpy from x and q (amax, flushed %, SQNR, relative error, MX saturation and block
exponents from the block maxima by the OCP rule) and against the capture's quant_error (HiFP8
regions and saturation); pieces add up to the whole, reusing x's statistics changes nothing,
and NaN is reported as such.
"""

import math

import numpy as np
import pytest
import torch

from megatron.quantization.formats import (
    fake_quantize, hifp8_scale_exponent, hifp8_scaled_fake_quantize)
from megatron.tensor_capture.operand_sums import operand_statistics
from megatron.tensor_capture.stats import quant_error
from megatron.tensor_capture.telemetry import metrics

# (largest element magnitude, exponent of its top binade) of the MX element formats (OCP MX
# v1.0: E4M3 448 = 1.75 * 2**8, E5M2 57344 = 1.75 * 2**15, E2M1 6 = 1.5 * 2**2).
MX_ELEMENTS = {"mxfp8_e4m3": (448.0, 8), "mxfp8_e5m2": (57344.0, 15), "mxfp4": (6.0, 2)}


def _operand(dtype, shape=(40, 96), seed=0):
    """Values over many binades, exact zeros, tiny values and one block far above the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    x[0, :7] = 0.0
    x[1, :5] = 1e-30
    x[2, :32] *= 2.0 ** 40
    return x.to(dtype)


def _mx_expected(x64, q64, fmt, axis, scale_mode):
    """Saturated count and block exponent range from the block maxima (numpy)."""
    max_normal, emax = MX_ELEMENTS[fmt]
    moved = np.moveaxis(np.abs(x64), axis, -1)
    pad = -moved.shape[-1] % 32
    blocks = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)]).reshape(
        *moved.shape[:-1], -1, 32)
    amax = blocks.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        if scale_mode == "floor":
            e = np.floor(np.log2(amax)) - emax
        else:  # the smallest e with max_normal * 2**e >= amax
            e = np.ceil(np.log2(amax / max_normal))
    e = np.clip(np.where(amax > 0, e, -127), -127, 127)
    saturated = np.count_nonzero(blocks > max_normal * np.exp2(e))
    return saturated, e.min(), e.max()


def _telemetry(x, q, fmt, axis, scale_mode="floor", k=None, x_side=None):
    sums, maxima, side = operand_statistics(x, q, fmt, axis, scale_mode, k, x_side)
    return metrics(sums.tolist(), maxima.tolist(), fmt), side


def _check_common(got, x, q):
    x64, q64 = x.double().numpy(), q.double().numpy()
    signal, error = np.sum(x64 ** 2), np.sum((q64 - x64) ** 2)
    assert got["amax"] == np.abs(x64).max()
    assert got["flushed_pct"] == pytest.approx(
        100 * np.count_nonzero((x64 != 0) & (q64 == 0)) / np.count_nonzero(x64), abs=1e-12)
    # as a ratio: an SQNR near 0 dB (HiFP8 saturating far above its range) is still exact
    assert 10 ** (got["sqnr_db"] / 10) == pytest.approx(signal / error, rel=1e-6)
    assert got["rel_error"] == pytest.approx(math.sqrt(error / signal), rel=1e-6)
    return x64, q64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", list(MX_ELEMENTS))
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mx_operand_statistics(dtype, fmt, axis, scale_mode):
    x = _operand(dtype)
    q = fake_quantize(x, fmt, axis=axis, scale_mode=scale_mode)
    got, _ = _telemetry(x, q, fmt, axis, scale_mode)
    x64, q64 = _check_common(got, x, q)
    saturated, e_min, e_max = _mx_expected(x64, q64, fmt, axis % x.dim(), scale_mode)
    assert got["saturated_pct"] == pytest.approx(100 * saturated / x.numel(), abs=1e-12)
    if scale_mode == "floor":
        assert saturated > 0           # the check is not vacuous
    assert (got["scale_exp_min"], got["scale_exp_max"]) == (e_min, e_max)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "tensor-scaled"])
def test_hifp8_operand_statistics(dtype, scaled):
    x = _operand(dtype)
    k = hifp8_scale_exponent(x) if scaled else None
    q = hifp8_scaled_fake_quantize(x, scale_exponent=k) if scaled else \
        fake_quantize(x, "hifp8", saturate=True)
    got, _ = _telemetry(x, q, "hifp8", None, k=k)
    _check_common(got, x, q)
    reference = quant_error(x, q, "hifp8", hifp8_scale_exponent=None if k is None else int(k))
    assert got["saturated_pct"] == pytest.approx(100 * reference["saturated_fraction"],
                                                 abs=1e-12)
    assert reference["saturated_fraction"] > 0 or scaled
    for region, share in reference["hifp8_regions"].items():
        assert got[f"hifp8_{region}_pct"] == pytest.approx(100 * share, abs=1e-9), region


def test_hifp8_regions_of_subnormal_values_under_a_large_scale():
    """A tensor of tiny values with float32 subnormals among them: the per-tensor scale
    (k = 3 - floor(log2 amax) > 100) lifts the subnormals into HiF8's range, so their exact
    exponents matter (frexp, not the bits' exponent field)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g) * 1e-36
    x[0, :40] = torch.linspace(1e-40, 1e-38, 40)     # float32 subnormals (< 2**-126)
    x[1, :5] = 0.0
    assert int(torch.count_nonzero((x.abs() < 2.0 ** -126) & (x != 0))) >= 40
    k = hifp8_scale_exponent(x)
    assert int(k) > 100
    q = hifp8_scaled_fake_quantize(x, scale_exponent=k)
    got, _ = _telemetry(x, q, "hifp8", None, k=k)
    reference = quant_error(x, q, "hifp8", hifp8_scale_exponent=int(k))
    for region, share in reference["hifp8_regions"].items():
        assert got[f"hifp8_{region}_pct"] == pytest.approx(100 * share, abs=1e-9), region
    # and without subnormals the fast path gives the same as frexp would
    normal = x.clone()
    normal[(normal.abs() < 2.0 ** -126) & (normal != 0)] = 1e-36
    assert int(torch.count_nonzero(normal == 0)) == 5
    q = hifp8_scaled_fake_quantize(normal, scale_exponent=k)
    got, _ = _telemetry(normal, q, "hifp8", None, k=k)
    reference = quant_error(normal, q, "hifp8", hifp8_scale_exponent=int(k))
    for region, share in reference["hifp8_regions"].items():
        assert got[f"hifp8_{region}_pct"] == pytest.approx(100 * share, abs=1e-9), region


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4", "hifp8"])
def test_pieces_add_up_and_reusing_x_changes_nothing(fmt):
    x = _operand(torch.bfloat16, shape=(64, 96))
    q = fake_quantize(x, fmt, axis=-1)
    whole, side = operand_statistics(x, q, fmt, -1)[0:3:2]
    again = operand_statistics(x, q, fmt, -1, x_side=side)[0]
    torch.testing.assert_close(again, whole, rtol=0, atol=0)
    halves = [operand_statistics(x[rows], q[rows], fmt, -1) for rows in
              (slice(0, 32), slice(32, 64))]
    sums = halves[0][0] + halves[1][0]
    torch.testing.assert_close(sums, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.maximum(halves[0][1], halves[1][1]),
                               operand_statistics(x, q, fmt, -1)[1], rtol=0, atol=0)


def test_nan_and_high_precision_operands():
    x = _operand(torch.bfloat16)
    x[5, 5] = float("nan")
    q = fake_quantize(x, "mxfp8", axis=-1)
    got, _ = _telemetry(x, q, "mxfp8", -1)
    assert got["nonfinite"] == 1.0 and math.isnan(got["amax"])
    kept, _ = _telemetry(_operand(torch.float32), None, "none", None)
    assert kept == {"amax": float(_operand(torch.float32).abs().max())}
