"""The random Hadamard transform fused into the quantization of a GEMM operand: the same bits
as rotating the operand first and quantizing the rotated copy (what an observed GEMM does),
forward and backward, with stochastic rounding and the weight cache; and the transform's own
arithmetic, bit for bit an independent float32 butterfly in the documented order."""

import math

import numpy as np
import pytest
import torch

from megatron.quantization import gemm
from megatron.quantization.config import BackendSettings, MatmulQuantConfig, OperandFormats, \
    RhtSettings
from megatron.quantization.formats import hadamard_sign_vector, random_hadamard_transform
from megatron.quantization.gemm import SiteState, quantized_linear
from megatron.quantization.runtime import QuantRuntime


def numpy_butterfly_rht(x: np.ndarray, block: int, seed: int) -> np.ndarray:
    """The transform along the last axis of a float32 array, written from its definition:
    signs, then in-place butterflies with strides 1, 2, ..., block/2, then * f32(1/sqrt(b))."""
    d = hadamard_sign_vector(block, seed).numpy()
    out = x.astype(np.float32).reshape(-1, x.shape[-1] // block, block) * d
    h = 1
    while h < block:
        for start in range(0, block, 2 * h):
            for i in range(start, start + h):
                a, c = out[..., i].copy(), out[..., i + h].copy()
                out[..., i], out[..., i + h] = a + c, a - c
        h *= 2
    return (out * np.float32(1 / math.sqrt(block))).reshape(x.shape)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_the_transform_is_the_documented_butterfly_bit_for_bit(block):
    g = torch.Generator().manual_seed(block)
    x = torch.randn(6, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (6, 256),
                                                                    generator=g).float())
    expected = numpy_butterfly_rht(x.numpy(), block, seed=9)
    got = random_hadamard_transform(x, axis=-1, block=block, seed=9)
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))
    # bf16: the float32 result rounded once; another axis: the same numbers moved there.
    xb = x.bfloat16()
    assert torch.equal(random_hadamard_transform(xb, -1, block, 9),
                       torch.from_numpy(numpy_butterfly_rht(xb.float().numpy(), block, 9))
                       .bfloat16())
    assert torch.equal(random_hadamard_transform(x.t().contiguous(), 0, block, 9).t(), got)
    # The differentiable path (autograd on) computes the same operations.
    tracked = random_hadamard_transform(x.clone().requires_grad_(), -1, block, 9)
    assert tracked.requires_grad and torch.equal(tracked.detach(), got)


class Recorder:
    def __init__(self):
        self.hp = {}

    def __call__(self, gemm_name, operand, hp, q, fmt, axis, **extra):
        self.hp.setdefault((gemm_name, operand), []).append(hp)


def _config(fmt, block, stochastic=frozenset()):
    ops = OperandFormats(fmt, fmt)
    return MatmulQuantConfig(fprop=ops, dgrad=ops, wgrad=ops, stochastic=stochastic,
                             rht=RhtSettings(("fprop", "dgrad", "wgrad"), block, 3))


def _train(cfg, x, w, grad, observer, state):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(x, w, None, cfg, observer=observer, state=state)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("fmt, block, dtype", [
    ("mxfp4", 16, torch.float32), ("mxfp4", 64, torch.bfloat16), ("nvfp4", 16, torch.bfloat16),
    ("nvfp4", 128, torch.float32), ("mxfp8_e4m3", 32, torch.float32)])
def test_fused_rotation_gives_the_bits_of_rotating_first(monkeypatch, fmt, block, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 128, generator=g).to(dtype)          # M = 128 tokens, K = 128
    w = torch.randn(256, 128, generator=g).to(dtype)            # N = 256
    grad = torch.randn(2, 64, 256, generator=g).to(dtype)
    cfg = _config(fmt, block, stochastic=frozenset({"dgrad.a", "wgrad.b"}))
    rotations = []
    rotate = gemm._rotated
    monkeypatch.setattr(gemm, "_rotated", lambda *a: rotations.append(1) or rotate(*a))

    def run(observer):
        state = SiteState("decoder.layers.0.mlp.linear_fc1", cfg,
                          QuantRuntime(BackendSettings(kernels="eager")))
        state.runtime.start_iteration(seed=5, iteration=2)
        return _train(cfg, x, w, grad, observer, state)

    fused = run(None)
    assert not rotations                   # no operand was rotated into a copy
    recorder = Recorder()
    two_step = run(recorder)
    assert len(rotations) == 6             # every operand of the three GEMMs
    for a, b in zip(fused, two_step):
        assert torch.equal(a, b)
    # The observer saw the rotated operands themselves.
    assert torch.equal(recorder.hp[("fprop", "input")][0],
                       random_hadamard_transform(x, -1, block, 3))


def test_a_cached_fused_weight_is_rotated_for_an_observer_that_comes_later():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    cfg = _config("nvfp4", 16)
    state = SiteState("layer", cfg)
    plain = quantized_linear(x, w, None, cfg, state=state)
    assert state.weights["fprop"][1] is None          # the fused entry keeps no rotated copy
    recorder = Recorder()
    observed = quantized_linear(x, w, None, cfg, observer=recorder, state=state)
    assert torch.equal(plain, observed)
    assert torch.equal(recorder.hp[("fprop", "weight")][0],
                       random_hadamard_transform(w, 1, 16, 3))


def test_lengths_the_block_does_not_divide_are_padded_and_rotated_first(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 40, generator=g), torch.randn(24, 40, generator=g)   # K = 40
    cfg = _config("mxfp4", 16)
    rotations = []
    rotate = gemm._rotated
    monkeypatch.setattr(gemm, "_rotated", lambda *a: rotations.append(1) or rotate(*a))
    quantized_linear(x, w, None, cfg, state=SiteState("layer", cfg))
    assert len(rotations) == 2


def test_rht_option_errors():
    from megatron.quantization.formats import fake_quantize
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="length 48 along axis 1 is not a multiple of the "
                                         "Hadamard block 32"):
        fake_quantize(x, "mxfp4", rht=(32, 0))
    with pytest.raises(ValueError, match="MX formats and to nvfp4 in 1-D blocks"):
        fake_quantize(x, "fp8_e4m3", rht=(16, 0))
    with pytest.raises(ValueError, match="16, 32, 64, 128"):
        fake_quantize(x, "mxfp4", rht=(8, 0))
    with pytest.raises(ValueError, match="seed must be an int"):
        fake_quantize(x, "mxfp4", rht=(16, 1.5))
    assert torch.equal(fake_quantize(x, "mxfp4", rht=(16, 4)),
                       fake_quantize(random_hadamard_transform(x, -1, 16, 4), "mxfp4"))
