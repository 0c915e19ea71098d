"""GPU checks of the fused attention path (skipped without CUDA): unquantized attention --
bf16 or fp32, grouped K/V heads or not, causal or with an explicit mask -- runs forward and
backward on a fused SDPA kernel with the math kernel excluded (a fallback to it raises), and
matches the CPU. tests/quantization/test_sdpa_backends.py checks the same calls on the CPU."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.quantization.local_attention import causal_mask

from test_attention_paths import _inputs, _module, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FUSED_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.CUDNN_ATTENTION]
SEQ, BATCH, DIM = 128, 2, 64


def _padding_mask():
    """Causal, and the last 16 keys of sample 1 are padding (megatron: True = masked)."""
    mask = causal_mask(SEQ, SEQ, torch.device("cpu")).repeat(BATCH, 1, 1, 1)
    mask[1, :, :, SEQ - 16:] = True
    return mask


def _cuda_matches_cpu(module, heads, groups, dtype, mask, kernels):
    """Runs the module on the CPU, then on the GPU with only `kernels` allowed (forward and
    backward), and compares: outputs elementwise, gradients by relative norm."""
    inputs = _inputs(SEQ, BATCH, heads, groups, DIM, dtype)
    grad = torch.randn(SEQ, BATCH, heads * DIM, generator=torch.Generator().manual_seed(9))
    grad = grad.to(dtype)
    cpu_out, cpu_grads = _run(lambda q, k, v: module(q, k, v, mask), inputs, grad)
    cuda_mask = mask.cuda() if mask is not None else None
    with sdpa_kernel(kernels):
        out, grads = _run(lambda q, k, v: module(q, k, v, cuda_mask),
                          [t.cuda() for t in inputs], grad.cuda())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.cpu(), cpu_out, rtol=tolerance, atol=tolerance)
    for cuda_grad, cpu_grad in zip(grads, cpu_grads):
        error = (cuda_grad.cpu().float() - cpu_grad.float()).norm()
        assert error <= tolerance * cpu_grad.float().norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 4)])
def test_fused_attention_never_falls_to_math(world_size_one, dtype, masked, heads, groups):
    module = _module(world_size_one)
    mask = _padding_mask() if masked else None
    _cuda_matches_cpu(module, heads, groups, dtype, mask, FUSED_KERNELS)


def test_bf16_causal_gqa_runs_on_flash_alone(world_size_one):
    """bf16 causal attention with grouped K/V heads (enable_gqa) runs on flash alone."""
    _cuda_matches_cpu(_module(world_size_one), 8, 2, torch.bfloat16, None,
                      [SDPBackend.FLASH_ATTENTION])
