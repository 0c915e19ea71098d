"""Exactness of the building blocks: histogram bins, HiF8 regions, MX shared exponents."""

import numpy as np
import pytest
import torch

from megatron.analysis import binning
from megatron.analysis.hifp8 import REGIONS
from megatron.analysis.hifp8 import region_counts_from_hist
from megatron.analysis.ranges import format_ranges
from megatron.analysis.summarize import shared_exponents, summarize_tensors


def _reference_bins(values):
    """Bin index of finite nonzero float64 magnitudes via frexp (independent of float bits)."""
    mag = np.abs(values[np.isfinite(values) & (values != 0)]).astype(np.float64)
    mant, exp = np.frexp(mag)
    idx = (exp - 1 - binning.E_MIN) * binning.SUB + np.floor((2 * mant - 1) * binning.SUB)
    return np.bincount(np.clip(idx.astype(np.int64), 0, binning.NBINS - 1),
                       minlength=binning.NBINS)


def _tricky_values(rng):
    powers = 2.0 ** np.arange(-149, 128, dtype=np.float64)
    edges = np.concatenate([powers * f for f in (1.0, 1.25, 1.5, 1.75)])
    edges = edges[edges < np.finfo(np.float32).max].astype(np.float32)
    below = np.nextafter(edges, np.float32(0))
    random = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-45, 38, 20000)).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e-39], dtype=np.float32)
    return np.concatenate([edges, -below, random, specials])


def test_histogram_matches_frexp_reference():
    values = _tricky_values(np.random.default_rng(0))
    counts, zeros, nonfinite, has_sub = binning.histogram(binning.abs_bits(values))
    assert (counts == _reference_bins(values)).all()
    assert zeros == np.count_nonzero(values == 0) and nonfinite == 3 and has_sub


def test_joint_histogram_shifts_exactly():
    rng = np.random.default_rng(1)
    values = _tricky_values(rng)
    values = values[np.isfinite(values)]
    values = values[: values.size // 32 * 32].reshape(-1, 32)
    shift = rng.integers(-20, 20, size=values.shape[0])
    joint = binning.joint_histogram(binning.abs_bits(values), shift)
    assert (joint.plain == _reference_bins(values.ravel())).all()
    scaled = values.astype(np.float64) / np.exp2(shift)[:, None]
    assert (joint.scaled == _reference_bins(scaled.ravel())).all()


def test_hifp8_regions_at_their_boundaries():
    bounds = [2.0 ** -23, 2.0 ** -15, 2.0 ** -7, 2.0 ** -3, 2.0 ** 4, 2.0 ** 8, 40960.0]
    values = np.array([b * f for b in bounds for f in (1.0, 1 - 2 ** -20)] + [1e-30, 1e30],
                      dtype=np.float32)
    counts = region_counts_from_hist(binning.histogram(binning.abs_bits(values))[0])
    got = dict(zip(REGIONS, counts))
    assert got == {"underflow": 2, "denormal": 2, "mant1": 4, "mant2": 4, "mant3": 2,
                   "overflow": 2}


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_shared_exponents_match_the_format_library(fmt, mode):
    from megatron.quantization.formats import mx_shared_exponents

    powers = 2.0 ** np.arange(-130, 127)
    amax = np.concatenate([powers, np.nextafter(powers, 0), powers * 1.75, powers * 1.5,
                           [0.0, 1e-45]]).astype(np.float32)
    amax = amax[amax <= np.finfo(np.float32).max]
    blocks = np.zeros((amax.size, 32), dtype=np.float32)
    blocks[:, 5] = amax
    expected = mx_shared_exponents(torch.from_numpy(blocks), fmt, axis=-1,
                                   scale_mode=mode).reshape(-1).numpy()
    assert (shared_exponents(amax, format_ranges(fmt), mode) == expected).all()


def test_nan_blocks_and_nonfinite_values():
    from megatron.quantization.formats import fake_quantize

    x = torch.randn(4, 64)
    x[0, 3] = float("nan")
    x[2, 40] = float("inf")
    q = fake_quantize(x, "mxfp8_e4m3", axis=-1)
    st = summarize_tensors(x, q, format_ranges("mxfp8_e4m3"), axis=-1)
    m = st.metrics()
    assert (m["nan"], m["inf"], m["finite"]) == (1, 1, 254)
    assert st.blocks == 8 and st.nan_blocks == 2
    quant = m["quantization"]
    assert quant["nonfinite_fraction"] == pytest.approx(64 / 256)
    assert quant["compared_elements"] == 192
    finite = np.isfinite(q.numpy())
    xs, qs = x.numpy()[finite].astype(np.float64), q.numpy()[finite].astype(np.float64)
    assert quant["mse"] == pytest.approx(np.mean((qs - xs) ** 2), rel=1e-9)


@pytest.mark.parametrize("fmt", ["none", "hifp8"])
def test_bf16_fast_path_equals_the_general_path(fmt):
    from megatron.quantization.formats import fake_quantize

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 70000, generator=gen) * 300).to(torch.bfloat16)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-40])
    x[2, 7] = 60000.0
    q = None if fmt == "none" else fake_quantize(x, fmt, saturate=False)
    ranges = format_ranges(fmt)
    fast = summarize_tensors(x, q, ranges).metrics()
    general = summarize_tensors(x.float(), None if q is None else q.float(), ranges).metrics()
    assert fast.keys() == general.keys()
    for key, value in general.items():
        if isinstance(value, float):
            assert fast[key] == pytest.approx(value, rel=1e-12), key
        elif key != "quantization":
            assert fast[key] == value, key
    if q is not None:
        assert general["quantization"]["nonfinite_fraction"] > 0
        for key, value in general["quantization"].items():
            assert fast["quantization"][key] == pytest.approx(value, rel=1e-12), key
