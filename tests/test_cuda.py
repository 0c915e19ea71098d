"""Checks that need a GPU: they run where CUDA is present and are skipped elsewhere.

The CPU suite covers the same logic (test_attention_paths.py, test_formats.py,
test_quantized_training.py); these confirm it on the device the users train on.
"""

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron.quantization import attention as attention_module
from megatron.quantization.formats import fake_quantize
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "hifp8")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_fake_quantize_on_cuda_equals_cpu(fmt, dtype, scale_mode):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * torch.logspace(-12, 12, 96)).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e30]).to(dtype)
    kwargs = {"saturate": True} if fmt == "hifp8" else {"scale_mode": scale_mode}
    cpu = fake_quantize(x, fmt, axis=-1, **kwargs)
    cuda = fake_quantize(x.cuda(), fmt, axis=-1, **kwargs).cpu()
    assert torch.equal(cpu.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       cuda.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("fmt", ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
                                 "mxfp4", "nvfp4", "hifp8"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_triton_kernels_equal_eager_on_cuda(fmt, dtype, rounding):
    """The fused Triton kernels (compiled for the GPU, not interpreted) give eager's bits."""
    pytest.importorskip("triton")
    from megatron.quantization import formats
    if rounding == "stochastic" and fmt == "hifp8":
        pytest.skip("hifp8 has no stochastic rounding")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 130, generator=g) * torch.logspace(-40, 37, 130)).to(dtype)
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3e38, 1e-30]).to(dtype)
    x[1, 40], x[2, 70] = float("nan"), float("inf")
    x = x.cuda()
    results = {}
    for mode in ("eager", "triton"):
        formats.set_kernels(mode)
        try:
            options = {"saturate": True} if fmt == "hifp8" else {}
            if rounding == "stochastic":
                options.update(rounding="stochastic",
                               generator=torch.Generator("cuda").manual_seed(3))
            results[mode] = [fake_quantize(t, fmt, axis=axis, **options).cpu()
                             for t, axis in ((x, -1), (x, 0), (x[:, 3:], -1), (x[:, 3:], 0))]
        finally:
            formats.set_kernels("auto")
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for eager, kernel in zip(results["eager"], results["triton"]):
        assert torch.equal(eager.isnan(), kernel.isnan())
        same = eager.view(bits) == kernel.view(bits)
        assert (same | eager.isnan()).all(), (eager[~same][:8], kernel[~same][:8])


@pytest.mark.parametrize("scheme_args", [["--quant-scheme", "bf16"],
                                         ["--quant-scheme", "FA_linear_mxfp8",
                                          "--attn-pv-quant", "mxfp8"]])
def test_two_iterations_on_cuda(scheme_args, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = pretrain(pretrain_gpt.forward_step,
                      TINY_MOCK_ARGS + ["--train-iters", "2", "--bf16", *scheme_args])
    assert result.iteration == 2 and all(torch.isfinite(torch.tensor(l))
                                         for l in result.losses.values())


def test_bf16_attention_takes_the_fused_kernel(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pretrain(pretrain_gpt.forward_step,
             TINY_MOCK_ARGS + ["--train-iters", "1", "--bf16", "--quant-scheme", "bf16"])
    assert calls and all(calls)


def test_memory_estimate_against_the_allocator(monkeypatch):
    """The estimate of a 1-iteration bf16 run against the allocator's peak on this GPU: the
    estimate leaves out the CUDA context and caching, so it may be somewhat lower, never far."""
    from megatron.training.memory_estimate import estimate_memory, parse_estimate_args

    argv = TINY_MOCK_ARGS + ["--train-iters", "1", "--bf16", "--quant-scheme", "FA_linear_mxfp8"]
    estimate = estimate_memory(parse_estimate_args(argv + ["--world-size", "1"]))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.cuda.reset_peak_memory_stats()
    pretrain(pretrain_gpt.forward_step, argv)
    peak = torch.cuda.max_memory_allocated()
    assert 0.5 * peak <= estimate.total_bytes <= 1.5 * peak, (estimate.total_bytes, peak)


@pytest.mark.parametrize("fmt,scaled", [(f, False) for f in FORMATS] + [("hifp8", True)])
def test_telemetry_statistics_on_cuda_equal_cpu(fmt, scaled):
    """operand_statistics (no host sync; bincount, frexp, norms on the device) gives the
    CPU's sufficient statistics on CUDA."""
    from megatron.quantization.formats import hifp8_scale_exponent, hifp8_scaled_fake_quantize
    from megatron.tensor_capture.stats import SUM_FIELDS, operand_statistics

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 96, generator=g) * torch.logspace(-8, 6, 96)).bfloat16()
    k = hifp8_scale_exponent(x) if scaled else None
    results = []
    for device in ("cpu", "cuda"):
        xd = x.to(device)
        q = hifp8_scaled_fake_quantize(xd) if scaled else \
            fake_quantize(xd, fmt, axis=-1, **({"saturate": True} if fmt == "hifp8" else {}))
        sums, maxima, _ = operand_statistics(xd, q, fmt, -1, "floor",
                                             None if k is None else k.to(device))
        results.append((sums.cpu(), maxima.cpu()))
    (cpu_sums, cpu_max), (cuda_sums, cuda_max) = results
    norms = [SUM_FIELDS.index("signal_sq"), SUM_FIELDS.index("error_sq")]
    exact = [i for i in range(len(SUM_FIELDS)) if i not in norms]
    # counts, regions and maxima exactly; the float32 norms up to their summation order
    torch.testing.assert_close(cuda_sums[exact], cpu_sums[exact], rtol=0, atol=0)
    torch.testing.assert_close(cuda_max, cpu_max, rtol=0, atol=0)
    torch.testing.assert_close(cuda_sums[norms], cpu_sums[norms], rtol=1e-6, atol=0)
