"""Checks that need a GPU: they run where CUDA is present and are skipped elsewhere (`make
gpu-check` runs them; the CPU suite hides the GPUs from itself, see conftest.py).

- Every quantized operand of the GEMMs of quantized_linear and quantized_matmul, forward and
  backward, has on CUDA the CPU's bits, in each kernel mode (eager, torch.compile, Triton).
- The unquantized bf16 attention of a training run runs on FlashAttention (no fallback).
- fp32 training losses on CUDA equal the CPU's up to summation order.
- The memory estimate is within 10% of what the allocator hands out at a realistic size.
- fake_quantize, the Triton kernels and the telemetry statistics on CUDA equal CPU / eager.

The CPU suite covers the same logic (test_gemm.py, test_attention_paths.py, test_formats*.py,
test_memory_estimate.py, test_quantized_training.py); these confirm it on the device users
train on.
"""

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pretrain_gpt
from megatron.quantization import attention as attention_module
from megatron.quantization import fake_quantize
from megatron.quantization.config import BackendSettings, MatmulQuantConfig, OperandFormats
from megatron.quantization.gemm import SiteState, quantized_linear, quantized_matmul
from megatron.quantization.runtime import QuantRuntime
from megatron.tensor_capture.operand_sums import SUM_FIELDS, operand_statistics
from megatron.training.presets import NATIVE_VOCAB_SIZE
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS
from test_distributed import torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "hifp8")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def assert_same_bits(expected: torch.Tensor, actual: torch.Tensor, what) -> None:
    """Equal bit for bit, NaNs (whose payloads may differ) at the same positions."""
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, what
    nan = expected.isnan()
    assert torch.equal(nan, actual.isnan()), what
    differ = (expected.view(BITS[expected.dtype]) != actual.view(BITS[actual.dtype])) & ~nan
    assert not differ.any(), (what, expected[differ][:8], actual[differ][:8])


# ---------------------------------------------------------------------------------------------
# Every GEMM operand, CPU against CUDA, in every kernel mode
# ---------------------------------------------------------------------------------------------

GEMM_FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4", "hifp8")
CUDA_KERNEL_MODES = ("eager", "compile", "triton")

# A linear as the model runs it: x [s, b, K] and weight [N, K]; wgrad reduces over the s*b
# tokens. (s, b, K, N): 130 tokens with K and N whole blocks, then a partial tail block on
# every reduction axis (K = 100, N = 70, 70 tokens; for 32-element MX and 16-element NVFP4
# blocks alike).
LINEAR_SHAPES = [(65, 2, 96, 160), (35, 2, 100, 70)]
# Attention's GEMMs as the chunked path runs them, [batch, M, K] @ [batch, K, N]: QK^T-like
# (K = head dim, N = keys) and PV-like (K = keys, N = head dim), tails on M, K or N.
MATMUL_SHAPES = [(4, 130, 64, 70), (4, 70, 130, 64)]

LINEAR_OPERANDS = {"fprop.input", "fprop.weight", "dgrad.grad_output", "dgrad.weight",
                   "wgrad.grad_output", "wgrad.input"}
MATMUL_OPERANDS = {"fprop.a", "fprop.b", "dgrad.grad_output", "dgrad.b", "wgrad.a",
                   "wgrad.grad_output"}


def _wide_range(shape, seed: int, dtype) -> torch.Tensor:
    """Normal numbers scaled over 12 decades along the last axis, first row zero: blocks along
    either axis get scales of their own, small elements fall on the element formats'
    subnormals, large ones saturate HiFP8, and an all-zero block keeps the minimum scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1])
    x.view(-1, shape[-1])[0] = 0.0
    return x.to(dtype)


def _gemm_inputs(kind: str, shape, dtype):
    """(a, b, gradient of the output) of a linear (x, weight, dY) or a batched matmul."""
    if kind == "linear":
        s, b, k, n = shape
        shapes = ((s, b, k), (n, k), (s, b, n))
    else:
        batch, m, k, n = shape
        shapes = ((batch, m, k), (batch, k, n), (batch, m, n))
    return [_wide_range(size, seed, dtype) for seed, size in enumerate(shapes)]


def observed_quantizations(kind: str, shape, fmt: str, dtype, device, kernels: str) -> dict:
    """{"gemm.operand": (axis, q on the CPU)} of every quantized operand that one forward and
    backward of quantized_linear / quantized_matmul reports to its observer on `device`, its
    site in kernel mode `kernels`."""
    a, b, grad = (t.to(device) for t in _gemm_inputs(kind, shape, dtype))
    a.requires_grad_()
    b.requires_grad_()
    every = OperandFormats(fmt, fmt)
    config = MatmulQuantConfig(fprop=every, dgrad=every, wgrad=every)
    seen = {}

    def observer(gemm, operand, hp, q, fmt, axis, **extra):
        if q is not None:
            key = f"{gemm}.{operand}"
            assert key not in seen, key
            seen[key] = (axis, q.detach().cpu())

    state = SiteState("gpu-check", config, QuantRuntime(BackendSettings(kernels=kernels)))
    if kind == "linear":
        out = quantized_linear(a, b, None, config, observer=observer, state=state)
    else:
        out = quantized_matmul(a, b, config, observer=observer, state=state)
    out.backward(grad)
    return seen


@contextlib.contextmanager
def compiled_without_fallback(recompile_limit: int):
    """torch.compile from an empty cache that raises where it would otherwise run eager PyTorch
    in silence -- past `recompile_limit` graphs of one function, or on a compilation error --
    and proof that graphs were compiled, whole (no graph break leaves a part to eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=recompile_limit,
                                    fail_on_recompile_limit_hit=True, suppress_errors=False):
        yield
    assert counters["stats"]["unique_graphs"] > 0, "nothing went through torch.compile"
    assert not counters["graph_break"], dict(counters["graph_break"])


def _gemm_cases():
    return [("linear", s) for s in LINEAR_SHAPES] + [("matmul", s) for s in MATMUL_SHAPES]


@pytest.mark.parametrize("mode", CUDA_KERNEL_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_every_gemm_operand_on_cuda_has_the_cpu_bits(fmt, dtype, mode):
    """All six quantized operands of fprop, dgrad and wgrad (each along its own reduction
    axis), for linears and attention-like matmuls with and without tail blocks: eager CPU
    (the definition) against CUDA in `mode`; compiled graphs are checked all compiled (a
    generous recompile limit, raising past it; the default limit is the next test's). Round
    to nearest: stochastic draws come from per-device generators (CUDA eager against Triton is
    checked below)."""
    if mode == "triton":
        pytest.importorskip("triton")
    cases = _gemm_cases()
    expected = [observed_quantizations(kind, s, fmt, dtype, "cpu", "eager") for kind, s in cases]
    guard = compiled_without_fallback(64) if mode == "compile" else contextlib.nullcontext()
    with guard:
        actual = [observed_quantizations(kind, s, fmt, dtype, "cuda", mode) for kind, s in cases]
    for (kind, shape), cpu, cuda in zip(cases, expected, actual):
        operands = LINEAR_OPERANDS if kind == "linear" else MATMUL_OPERANDS
        assert set(cpu) == set(cuda) == operands, (kind, sorted(cpu), sorted(cuda))
        for name in sorted(operands):
            (cpu_axis, cpu_q), (cuda_axis, cuda_q) = cpu[name], cuda[name]
            assert cpu_axis == cuda_axis, (kind, shape, name)
            assert_same_bits(cpu_q, cuda_q, (kind, shape, name))


@pytest.mark.parametrize("fmt", GEMM_FORMATS)
def test_compiled_gemm_operands_stay_within_the_recompile_limit(fmt):
    """A bf16 run's GEMM operands of one format -- linear and attention shapes, both blocked
    axes, tails, operands with and without requires_grad -- under Dynamo's default recompile
    limit: past it --quant-kernels compile would quietly run eager PyTorch for the rest of the
    run."""
    limit = torch._dynamo.config.recompile_limit
    with compiled_without_fallback(limit):
        for kind, shape in _gemm_cases():
            observed_quantizations(kind, shape, fmt, torch.bfloat16, "cuda", "compile")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil", "ceil", "even"])
def test_fake_quantize_on_cuda_equals_cpu(fmt, dtype, scale_mode):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * torch.logspace(-12, 12, 96)).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e30]).to(dtype)
    kwargs = {"saturate": True} if fmt == "hifp8" else {"scale_mode": scale_mode}
    cpu = fake_quantize(x, fmt, axis=-1, **kwargs)
    cuda = fake_quantize(x.cuda(), fmt, axis=-1, **kwargs).cpu()
    # Inf / NaN inputs give NaN, whose payload and sign the devices write differently (bf16:
    # CPU 0xFFFF, CUDA 0x7FC0) and the formats leave open: NaN positions, all other bits.
    assert_same_bits(cpu, cuda, (fmt, dtype, scale_mode))


@pytest.mark.parametrize("fmt", ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
                                 "mxfp4", "nvfp4", "hifp8"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_triton_kernels_equal_eager_on_cuda(fmt, dtype, rounding):
    """The fused Triton kernels (compiled for the GPU, not interpreted) give eager's bits."""
    pytest.importorskip("triton")
    if rounding == "stochastic" and fmt == "hifp8":
        pytest.skip("hifp8 has no stochastic rounding")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 130, generator=g) * torch.logspace(-40, 37, 130)).to(dtype)
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3e38, 1e-30]).to(dtype)
    x[1, 40], x[2, 70] = float("nan"), float("inf")
    x = x.cuda()
    results = {}
    for mode in ("eager", "triton"):
        options = {"saturate": True} if fmt == "hifp8" else {}
        if rounding == "stochastic":
            options.update(rounding="stochastic",
                           generator=torch.Generator("cuda").manual_seed(3))
        results[mode] = [fake_quantize(t, fmt, axis=axis, kernels=mode, **options).cpu()
                         for t, axis in ((x, -1), (x, 0), (x[:, 3:], -1), (x[:, 3:], 0))]
    for eager, kernel in zip(results["eager"], results["triton"]):
        assert_same_bits(eager, kernel, (fmt, dtype, rounding))


# ---------------------------------------------------------------------------------------------
# Attention kernel
# ---------------------------------------------------------------------------------------------


def test_bf16_gqa_attention_of_a_training_run_runs_on_flash_attention(monkeypatch):
    """With FlashAttention the only SDPA backend allowed, a fallback (math or memory-efficient
    kernel) raises instead of passing unnoticed; the spy proves the fused path ran, causal
    with the groups as they are (4 query heads, 2 K/V groups)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.size(1), k.size(1), q.dtype, kwargs.get("is_causal"),
                      kwargs.get("attn_mask")))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
            "--train-iters", "2", "--bf16", "--quant-scheme", "bf16"])
    assert result.iteration == 2
    assert calls and set(calls) == {(4, 2, torch.bfloat16, True, None)}, set(calls)


# ---------------------------------------------------------------------------------------------
# Training losses, CUDA against CPU
# ---------------------------------------------------------------------------------------------

LOSS_SCHEMES = {
    "bf16": ["--quant-scheme", "bf16"],
    "FA_linear_mxfp8-pv": ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"],
}
# fp32 runs from the same weights differ only in the order fp32 sums are taken (cuBLAS against
# the CPU's GEMMs, SDPA's kernels, reductions; the fused Triton attention that the CUDA run
# takes by default for quantized attention, also in its exp). Between CPU runs that differ
# that way (one process against TP=2, one thread against two) the losses of these three
# iterations differ by at most 1.5e-7 relative, with MXFP8 operands too: 1e-5 leaves a wide
# margin for the GPU's orders, and stays 16x below what quantizing these GEMMs at all changes
# (FA_linear_mxfp8 + PV against bf16: 1.6e-4 at iteration 1), so a wrong bit pattern or axis
# would not pass.
LOSS_RTOL = 1e-5


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 GEMMs in fp32 (no TF32), deterministic kernels where PyTorch has them, and the
    CPU's weight initialisation on the GPU (megatron/training/model.py)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("MEGATRON_LOWP_CPU_INIT", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # (torch.backends' attributes are properties of module objects, set and restored directly)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


@pytest.mark.parametrize("scheme", LOSS_SCHEMES)
def test_fp32_losses_on_cuda_equal_the_cpu_losses(scheme, exact_fp32, monkeypatch):
    argv = TINY_MOCK_ARGS + ["--train-iters", "3"] + LOSS_SCHEMES[scheme]
    cuda = pretrain(pretrain_gpt.forward_step, argv).losses
    with monkeypatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")          # the subprocess runs on the CPU
        cpu, _ = torchrun(1, argv)
    assert sorted(cuda) == sorted(cpu) == [1, 2, 3]
    for it in cpu:
        assert cuda[it] == pytest.approx(cpu[it], rel=LOSS_RTOL), (it, cuda, cpu)


# ---------------------------------------------------------------------------------------------
# Memory estimate against the allocator
# ---------------------------------------------------------------------------------------------

# Llama 3.2 1B with 2 layers at seq 8192: the launcher's shapes, 8 GiB and more per GPU.
# NullTokenizer's vocabulary is --vocab-size + 1 (its eod), so the run and the estimate both
# pad the preset's 128256 entries.
MEMORY_ARGS = ["--model-preset", "llama32-1b", "--num-layers", "2", "--seq-length", "8192",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16", "--mock-data",
               "--tokenizer-type", "NullTokenizer",
               "--vocab-size", str(NATIVE_VOCAB_SIZE["llama32-1b"] - 1),
               "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "1000",
               "--eval-iters", "1", "--num-workers", "0"]


def _warm_up_cublas() -> None:
    """Create the cuBLAS / cuBLASLt handles and workspaces the run's GEMMs use (bf16, fp32,
    bf16 with an fp32 output), so they fall in the baseline rather than in the peak."""
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    bias = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    a @ a
    a.float() @ a.float()
    torch.addmm(bias, a, a)
    torch.mm(a, a, out_dtype=torch.float32)
    torch.cuda.synchronize()


@pytest.mark.parametrize("scheme", ["bf16", "FA_linear_mxfp8"])
def test_memory_estimate_within_10_percent_of_the_allocator(scheme, monkeypatch):
    """The estimate's total against the allocator's peak, less what was allocated before the
    run (cuBLAS workspaces, earlier tests' caches). Two iterations: the optimizer state Adam
    creates at the first step is held through the second iteration's backward, as in any
    longer run, and the estimate counts it."""
    from megatron.training.memory_estimate import estimate_memory, parse_estimate_args

    argv = MEMORY_ARGS + ["--quant-scheme", scheme, "--train-iters", "2"]
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    estimate = estimate_memory(parse_estimate_args(
        argv + ["--world-size", "1", "--gpu-memory-gib", str(gpu_gib)]))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _warm_up_cublas()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = pretrain(pretrain_gpt.forward_step, argv)
    peak = torch.cuda.max_memory_allocated() - baseline
    assert result.iteration == 2
    assert abs(estimate.total_bytes - peak) <= 0.10 * peak, \
        (scheme, estimate.total_bytes / 2 ** 30, peak / 2 ** 30)


# ---------------------------------------------------------------------------------------------
# Telemetry statistics
# ---------------------------------------------------------------------------------------------


def assert_same_sums(cpu, cuda):
    """operand_statistics' (sums, maxima) on the CPU and on CUDA: counts, regions and maxima
    exactly; the float32 norms up to their summation order."""
    (cpu_sums, cpu_max), (cuda_sums, cuda_max) = cpu, cuda
    norms = [SUM_FIELDS.index("signal_sq"), SUM_FIELDS.index("error_sq")]
    exact = [i for i in range(len(SUM_FIELDS)) if i not in norms]
    torch.testing.assert_close(cuda_sums[exact], cpu_sums[exact], rtol=0, atol=0)
    torch.testing.assert_close(cuda_max, cpu_max, rtol=0, atol=0)
    torch.testing.assert_close(cuda_sums[norms], cpu_sums[norms], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt,scaled", [(f, False) for f in FORMATS] + [("hifp8", True)])
def test_telemetry_statistics_on_cuda_equal_cpu(fmt, scaled):
    """operand_statistics (no host sync; bincount, frexp, norms on the device) gives the
    CPU's sufficient statistics on CUDA."""
    from megatron.quantization.formats import hifp8_scale_exponent, hifp8_scaled_fake_quantize

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
    assert_same_sums(*results)
