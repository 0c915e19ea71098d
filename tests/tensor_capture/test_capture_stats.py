"""Capture statistics against independent float64 computations and hand-made blocks."""

import math
import threading

import numpy as np
import pytest
import torch

from megatron.quantization.formats import fake_quantize
from megatron.tensor_capture.stats import hifp8_regions, quant_error, record_stats, tensor_info


def np_info(x: torch.Tensor) -> dict:
    """tensor_info computed with numpy float64 from the definition in the format doc."""
    a = x.detach().to(torch.float64).numpy().ravel()
    finite = a[np.isfinite(a)]
    return {"min": finite.min(), "max": finite.max(), "mean": finite.mean(),
            "std": finite.std(), "absmax": np.abs(finite).max(),
            "zero_fraction": np.count_nonzero(a == 0) / a.size,
            "nan_count": int(np.isnan(a).sum()), "inf_count": int(np.isinf(a).sum())}


def np_error(x: torch.Tensor, q: torch.Tensor) -> dict:
    a = x.to(torch.float64).numpy().ravel()
    b = q.to(torch.float64).numpy().ravel()
    both = np.isfinite(a) & np.isfinite(b)
    d = b[both] - a[both]
    sig, err = np.sum(a[both] ** 2), np.sum(d ** 2)
    nonzero = np.isfinite(a) & (a != 0)
    return {"mse": err / both.sum(), "sqnr_db": 10 * np.log10(sig / err),
            "relative_error": np.sqrt(err / sig),
            "flushed_fraction": np.count_nonzero(nonzero & (b == 0)) / nonzero.sum(),
            "nonfinite_fraction": np.count_nonzero(~np.isfinite(b)) / b.size}


def assert_close(got: dict, want: dict, rel=1e-12):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=0), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tensor_info_matches_numpy(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 129, generator=g) * 3 + 0.5).to(dtype)
    x[0, :5] = 0
    info = tensor_info(x)
    assert info["shape"] == [37, 129] and info["numel"] == 37 * 129
    assert info["dtype"] == str(dtype) and info["device"] == "cpu"
    assert_close(info, np_info(x))


def test_tensor_info_nonfinite_and_offset_data():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1000.0
    x[3], x[7], x[11] = float("nan"), float("inf"), -float("inf")
    info = tensor_info(x)
    assert (info["nan_count"], info["inf_count"]) == (1, 2)
    # std of values with mean/std = 1e6 still matches (two-pass variance).
    assert_close(info, np_info(x), rel=1e-9)


def test_tensor_info_edge_cases():
    empty = tensor_info(torch.empty(0, 3))
    assert empty["numel"] == 0 and empty["mean"] is None and empty["zero_fraction"] == 0.0
    nan = tensor_info(torch.full((4,), float("nan")))
    assert nan["nan_count"] == 4 and nan["min"] is None and nan["std"] is None
    leaf = torch.ones(3, requires_grad=True)
    info = tensor_info(leaf * 2)
    assert info["requires_grad"] and not info["is_leaf"] and info["std"] == 0.0


@pytest.mark.parametrize("fmt,axis", [("mxfp8_e4m3", -1), ("mxfp8_e4m3", 0),
                                      ("mxfp8_e5m2", 1), ("mxfp4", 0), ("hifp8", None)])
def test_quant_error_matches_numpy(fmt, axis):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 80, generator=g) * torch.logspace(-3, 2, 80)   # columns of many scales
    kwargs = {"saturate": True} if fmt == "hifp8" else {"axis": axis}
    q = fake_quantize(x, fmt, **kwargs)
    err = quant_error(x, q, fmt, axis, "floor")
    assert_close(err, np_error(x, q))
    assert 0.0 <= err["saturated_fraction"] < 0.05


def test_quant_error_bf16_and_exact():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    q = fake_quantize(x, "mxfp8_e4m3", axis=-1)
    assert_close(quant_error(x, q, "mxfp8_e4m3", -1), np_error(x, q))
    exact = torch.tensor([1.0, 2.0, 0.5, 0.0] * 8)
    err = quant_error(exact, fake_quantize(exact, "mxfp8_e4m3"), "mxfp8_e4m3", 0)
    assert err["sqnr_db"] == math.inf and err["mse"] == 0.0
    zeros = torch.zeros(32)
    err = quant_error(zeros, zeros.clone(), "mxfp4", 0)
    assert err["sqnr_db"] is None and err["relative_error"] is None and err["mse"] == 0.0


def test_hand_made_mx_blocks():
    """Four E4M3 blocks along axis 0 of a [128, 2] tensor (column 1 is a plain copy)."""
    col = torch.ones(128)
    col[0:5] = torch.tensor([500.0, 448.0, 300.0, 1e-5, 0.0])   # amax 500: e = 8 - 8 = 0
    col[32:64] = 0.5
    col[32] = 1.0                                               # amax 1: e = 0 - 8 = -8
    col[64:96] = 0.0                                            # all zero: e = -127
    col[96:128] = 2.0
    col[96] = float("nan")                                      # NaN block
    x = torch.stack([col, torch.ones(128)], dim=1)
    q = fake_quantize(x, "mxfp8_e4m3", axis=0)
    assert q[0, 0] == 448 and q[2, 0] == 288 and q[3, 0] == 0 and torch.isnan(q[96:, 0]).all()
    err = quant_error(x, q, "mxfp8_e4m3", 0, "floor")
    finite = 256 - 1
    assert err["saturated_fraction"] == pytest.approx(1 / finite)     # only 500 (448 is max)
    nonzero_finite = 31 + 32 + 0 + 31 + 128
    assert err["flushed_fraction"] == pytest.approx(1 / nonzero_finite)  # only 1e-5
    assert err["nonfinite_fraction"] == pytest.approx(32 / 256)
    assert err["nan_blocks"] == 1
    # Column 1: four blocks of ones, e = 0 - 8 = -8.
    hist = err["scale_exponent_hist"]
    assert hist["min"] == -127
    expected = [0] * 128
    expected[0], expected[-8 + 127], expected[0 + 127] = 1, 1 + 4, 1
    assert hist["counts"] == expected
    assert err["mse"] == pytest.approx((52.0 ** 2 + 12.0 ** 2 + 1e-10) / (256 - 32))


def test_rceil_scale_and_mxfp4_saturation():
    x = torch.tensor([7.0] + [1.0] * 31)
    floor = quant_error(x, fake_quantize(x, "mxfp4", axis=0), "mxfp4", 0, "floor")
    assert floor["saturated_fraction"] == pytest.approx(1 / 32)       # 7 -> 6 (P13)
    assert floor["scale_exponent_hist"] == {"min": 0, "counts": [1]}
    q = fake_quantize(x, "mxfp4", axis=0, scale_mode="rceil")
    rceil = quant_error(x, q, "mxfp4", 0, "rceil")
    assert rceil["saturated_fraction"] == 0.0 and q[0] == 8.0
    assert rceil["scale_exponent_hist"] == {"min": 1, "counts": [1]}


HIFP8_VALUES = {
    "mant3": [1.0, 8.0, -0.125],
    "mant2": [16.0, 200.0],
    "mant1": [256.0, 40000.0, 2.0 ** -15],
    "denormal": [2.0 ** -16, 2.0 ** -23, -3e-5],
    "underflow": [2.0 ** -24, 1e-30],
    "overflow": [40960.0, 1e6],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_hifp8_regions_hand_picked(dtype):
    values = [v for vs in HIFP8_VALUES.values() for v in vs]
    x = torch.tensor(values + [0.0, float("nan"), float("inf")], dtype=torch.float64)
    if dtype == torch.float16:   # fp16 cannot hold the extremes; keep what it can
        keep = {k: [v for v in vs if 2 ** -24 <= abs(v) < 65504] for k, vs in
                HIFP8_VALUES.items()}
        x = torch.tensor([v for vs in keep.values() for v in vs] + [0.0, float("nan")])
    else:
        keep = HIFP8_VALUES
    regions = hifp8_regions(x.to(dtype))
    total = sum(len(vs) for vs in keep.values())
    assert regions == pytest.approx({k: len(vs) / total for k, vs in keep.items()})


def test_hifp8_saturation_fraction():
    x = torch.tensor([1.0, 50000.0, 1e6, -33000.0, 2.0, float("nan")])
    q = fake_quantize(x, "hifp8", saturate=True)
    err = quant_error(x, q, "hifp8")
    assert err["saturated_fraction"] == pytest.approx(3 / 5)   # 50000, 1e6, -33000 -> 32768
    plain = fake_quantize(x, "hifp8")
    err = quant_error(x, plain, "hifp8")
    assert err["saturated_fraction"] == pytest.approx(3 / 5)   # two inf and 32768
    assert err["nonfinite_fraction"] == pytest.approx(3 / 6)
    # mse over elements where both are finite: exact float64 despite |x| >> 32768.
    assert_close(quant_error(x, q, "hifp8"), {"mse": np_error(x, q)["mse"]})


def test_statistics_do_not_depend_on_thread_count():
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(300, 1000, generator=g) + 0.3, torch.randn(7, 50021, generator=g)]
    results = {}

    def run(tag, threads):
        torch.set_num_threads(threads)
        results[tag] = [record_stats(x, fake_quantize(x, "mxfp8_e4m3"), "mxfp8_e4m3", -1)
                        for x in xs]

    before = torch.get_num_threads()
    try:
        run("two", 2)
        worker = threading.Thread(target=run, args=("one", 1))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert results["one"] == results["two"]
