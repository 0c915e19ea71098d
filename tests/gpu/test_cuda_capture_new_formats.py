"""GPU checks of the NVFP4 / FP8 / MXFP6 capture and telemetry (skipped without CUDA): the
statistics on the device equal the CPU's, and a capture taken on the GPU -- stochastic draws
made there -- reproduces bit for bit on the GPU from its metadata, with telemetry equal to
its statistics (the CPU suite checks the same on the CPU: test_capture_new_formats.py,
test_scaled_format_statistics.py)."""

import pytest
import torch

from megatron.quantization import fake_quantize
from megatron.tensor_capture.load import load_record
from megatron.tensor_capture.replay import requantize
from megatron.tensor_capture.operand_sums import operand_statistics
from megatron.tensor_capture.stats import quant_error

from test_capture_new_formats import _expected_telemetry, _run, bits
from test_cuda import assert_same_sums

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [
    ("nvfp4", {"block_2d": False}), ("nvfp4", {"block_2d": True, "amax": 300.0}),
    ("fp8_e4m3", {"scaling": "tensor", "amax": None, "margin": 0, "pow2_scale": False}),
    ("fp8_e5m2", {"scaling": "tensor", "amax": 0.5, "margin": 1, "pow2_scale": True}),
    ("fp8_e4m3", {"scaling": "block", "block": (1, 128), "pow2_scale": True}),
    ("fp8_e4m3", {"scaling": "block", "block": (128, 128), "pow2_scale": False}),
    ("mxfp6_e2m3", {}), ("mxfp6_e3m2", {}),
]


@pytest.mark.parametrize("fmt,options", CASES)
def test_statistics_on_cuda_equal_cpu(fmt, options):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(160, 256, generator=g) * torch.logspace(-8, 3, 256)).bfloat16()
    results, errors = [], []
    for device in ("cpu", "cuda"):
        xd = x.to(device)
        q = fake_quantize(xd, fmt, axis=-1, **options)
        sums, maxima, _ = operand_statistics(xd, q, fmt, -1, options=options)
        results.append((sums.cpu(), maxima.cpu()))
        errors.append(quant_error(xd, q, fmt, -1, options=options))
    assert_same_sums(*results)
    cpu_error, cuda_error = errors
    for key in ("saturated_fraction", "flushed_fraction", "tensor_scale", "blocks",
                "block_scale_min", "block_scale_max", "block_scale_hist",
                "block_scale_zero_fraction", "block_scale_subnormal_fraction",
                "scale_exponent_hist"):
        assert cuda_error.get(key) == cpu_error.get(key), key


def test_nvfp4_recipe_capture_on_cuda(tmp_path_factory, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    entries, scalars = _run(tmp_path_factory, "cuda-nvfp4", ["--quant-recipe", "nvfp4"])
    seeded = 0
    for entry in entries:
        meta = entry["metadata"]
        if meta["format"] == "none":
            continue
        assert entry["tensor_info"]["device"].startswith("cuda")
        record = load_record(entry["path"])
        q = requantize(record["tensor"], meta, device="cuda")   # the GPU's draws
        assert torch.equal(bits(q), bits(record["quantized"])), entry["file"]
        seeded += "stochastic_seed" in meta
    assert seeded > 0
    for (iteration, site, operand), values in _expected_telemetry(entries).items():
        for metric, value in values.items():
            got = scalars[f"quant/{site}/{operand}/{metric}"][iteration]
            assert got == pytest.approx(value, rel=2e-6, abs=1e-5), (site, operand, metric)
