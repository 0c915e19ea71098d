"""limited_precision_matmul against an independent reference of the same model written with
exact rationals (fractions.Fraction): group sums exact, alignment to the larger exponent and
truncation toward zero with integer arithmetic, FP32 promotion with numpy float32 additions.

Inputs are bf16 values with exponents in [-8, 8]: their products and the sums of 32 of them
are exact in float64, so the implementation's float64 group sums are the exact ones too."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron.quantization.accumulation import limited_precision_matmul


def _floor_log2(x: Fraction) -> int:
    n, d = abs(x.numerator), x.denominator
    e = n.bit_length() - d.bit_length()
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1
    return e


def _truncate(x: Fraction, exponent: int, m: int) -> Fraction:
    step = Fraction(2) ** (exponent - m)
    return step * int(x / step)                      # int() truncates toward zero


def reference(a, b, m, group, promotion):
    a, b = a.double().tolist(), b.double().tolist()
    rows, k, cols = len(a), len(b), len(b[0])
    out = np.zeros((rows, cols), dtype=np.float32)
    for i in range(rows):
        for j in range(cols):
            partial, acc = Fraction(0), np.float32(0)
            starts = list(range(0, k, group))
            for g, start in enumerate(starts):
                s = sum((Fraction(a[i][t]) * Fraction(b[t][j])
                         for t in range(start, min(start + group, k))), Fraction(0))
                if partial == 0 and s == 0:
                    continue
                e = max(_floor_log2(x) for x in (partial, s) if x != 0)
                total = _truncate(partial, e, m) + _truncate(s, e, m)
                partial = _truncate(total, _floor_log2(total), m) if total else Fraction(0)
                last = g == len(starts) - 1
                if promotion and ((start + group) % promotion == 0 or last):
                    acc = np.float32(acc + np.float32(float(partial)))
                    partial = Fraction(0)
            out[i, j] = acc if promotion else np.float32(float(partial))
    return torch.from_numpy(out)


def _bf16(shape, generator, low=-8, high=8, signs=True):
    mant = torch.randint(128, 256, shape, generator=generator).double() / 128
    exp = torch.randint(low, high + 1, shape, generator=generator).double()
    sign = (torch.randint(0, 2, shape, generator=generator) * 2 - 1).double() if signs else 1
    x = (sign * mant * torch.exp2(exp)).float()
    assert torch.equal(x, x.bfloat16().float())
    return x


CASES = {   # name: (M, K, N, m, group, promotion)
    "fp22 no promotion": (3, 200, 4, 13, 32, 0),
    "fp22 promoted every 128": (3, 300, 4, 13, 32, 128),
    "14 bits, group 16, promotion 64": (2, 130, 3, 14, 16, 64),
    "fp32 bits, group 32": (2, 96, 3, 23, 32, 0),
    "4 bits": (2, 70, 3, 4, 8, 0),
}


@pytest.mark.parametrize("name", CASES)
def test_random_inputs_equal_the_reference(name):
    rows, k, cols, m, group, promotion = CASES[name]
    g = torch.Generator().manual_seed(hash(name) % 2 ** 31)
    a, b = _bf16((rows, k), g), _bf16((k, cols), g)
    got = limited_precision_matmul(a, b, m, group, promotion)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference(a, b, m, group, promotion)), name


def test_adversarial_inputs_equal_the_reference():
    """Cancellation (a large partial sum undone by the next groups), a large dynamic range
    within a row, K not a multiple of the group, all-zero groups."""
    g = torch.Generator().manual_seed(7)
    k = 101
    a = _bf16((4, k), g, signs=False)
    b = _bf16((k, 3), g, signs=False)
    a[0, :32] = 256.0                       # a big first group ...
    a[0, 32:64] = -256.0                    # ... cancelled by the second
    a[1, ::2] *= 2.0 ** -8                  # small and large products interleaved
    a[2, 40:80] = 0.0                       # zero groups between live ones
    for m, group, promotion in ((13, 32, 0), (13, 32, 64), (10, 8, 24), (23, 1, 0)):
        got = limited_precision_matmul(a, b, m, group, promotion)
        assert torch.equal(got, reference(a, b, m, group, promotion)), (m, group, promotion)


def test_promotion_every_product_is_fp32_accumulation():
    """With 23 bits and every product promoted, the model is FP32 accumulation in order."""
    g = torch.Generator().manual_seed(3)
    a, b = _bf16((3, 77), g), _bf16((77, 5), g)
    got = limited_precision_matmul(a, b, 23, 1, 1)
    want = np.zeros((3, 5), dtype=np.float32)
    an, bn = a.numpy(), b.numpy()
    for t in range(77):                         # products of bf16 values are exact in fp32
        want = (want + np.outer(an[:, t], bn[t, :]).astype(np.float32)).astype(np.float32)
    assert torch.equal(got, torch.from_numpy(want))


def test_fewer_bits_lose_more_and_promotion_recovers_it():
    """The DeepSeek-V3 effect on sums of positive terms: 13 bits without promotion lose far
    more than with promotion every 128 products (relative to the exact sum)."""
    g = torch.Generator().manual_seed(0)
    a = _bf16((8, 4096), g, low=-1, high=1, signs=False)
    b = _bf16((4096, 8), g, low=-1, high=1, signs=False)
    exact = (a.double() @ b.double())
    def err(**kw):
        return float(((limited_precision_matmul(a, b, **kw).double() - exact) / exact).abs().max())
    plain, promoted = err(mantissa_bits=13, promotion=0), err(mantissa_bits=13, promotion=128)
    assert 1e-3 < plain < 0.05 and promoted < plain / 10, (plain, promoted)


def test_batched_and_broadcast_shapes_and_bad_arguments():
    g = torch.Generator().manual_seed(5)
    a, b = _bf16((2, 3, 40), g), _bf16((2, 40, 4), g)
    batched = limited_precision_matmul(a, b, 13, 32, 0)
    for i in range(2):
        assert torch.equal(batched[i], limited_precision_matmul(a[i], b[i], 13, 32, 0))
    assert torch.equal(limited_precision_matmul(a, b[0], 13, 32, 0)[1],
                       limited_precision_matmul(a[1], b[0], 13, 32, 0))
    for kwargs, words in (({"mantissa_bits": 0}, "valid 1..23"),
                          ({"mantissa_bits": 24}, "valid 1..23"),
                          ({"group": 0}, "positive"),
                          ({"promotion": 48}, "multiple of the group")):
        with pytest.raises(ValueError, match=words):
            limited_precision_matmul(a, b, **kwargs)
    with pytest.raises(ValueError, match="needs a"):
        limited_precision_matmul(a, b.transpose(-1, -2))


# -- in the GEMMs ------------------------------------------------------------------------------

def _config(*flags):
    from megatron.quantization.schemes import quant_config

    return quant_config(["--quant-scheme", "linear_mxfp8", *flags], num_layers=2).linear


def test_every_gemm_of_a_linear_layer_takes_the_limited_accumulator():
    """fprop, dgrad and wgrad on the quantized operands, each as limited_precision_matmul
    computes it (and only the GEMMs asked)."""
    from megatron.quantization import formats
    from megatron.quantization.gemm import SiteState, quantized_linear

    g = torch.Generator().manual_seed(11)
    x, w, bias = torch.randn(2, 5, 96, generator=g), torch.randn(64, 96, generator=g), \
        torch.randn(64, generator=g)
    dy = torch.randn(2, 5, 64, generator=g)
    for gemms in (("fprop", "dgrad", "wgrad"), ("wgrad",)):
        config = _config("--quant-accumulation-bits", "10", "--quant-accumulation-group", "16",
                         "--quant-accumulation-gemms", *gemms)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_linear(xg, wg, bias, config, state=SiteState("l", config))
        y.backward(dy)
        mx = lambda t, axis, fmt="mxfp8_e4m3": formats.fake_quantize(t, fmt, axis=axis)
        limited = lambda a, b: limited_precision_matmul(a, b, 10, 16, 0)
        fprop = (limited(mx(x, -1), mx(w, 1).t()) + bias) if "fprop" in gemms else \
            torch.nn.functional.linear(mx(x, -1), mx(w, 1), bias)
        assert torch.equal(y.detach(), fprop), gemms
        dgrad = (limited if "dgrad" in gemms else torch.matmul)(mx(dy, -1), mx(w, 0))
        assert torch.equal(xg.grad, dgrad), gemms
        wgrad = limited(mx(dy.reshape(-1, 64), 0).t(), mx(x.reshape(-1, 96), 0))
        assert torch.equal(wg.grad, wgrad), gemms


def test_the_settings_are_checked_shown_and_train():
    from megatron.quantization.config import SettingError, settings_from_flags
    from megatron.quantization.describe import describe_config
    from megatron.quantization.schemes import quant_config

    with pytest.raises(SettingError, match="--quant-accumulation-promotion 48: 0 or a multiple"):
        settings_from_flags(["--quant-accumulation-promotion", "48"])
    with pytest.raises(SettingError, match="--quant-accumulation-bits 30: out of range"):
        settings_from_flags(["--quant-accumulation-bits", "30"])
    quant = quant_config(["--quant-scheme", "FA_linear_mxfp8", "--quant-accumulation-bits",
                          "13", "--quant-accumulation-promotion", "128"], num_layers=2)
    text = describe_config(quant, 2)
    assert "--quant-accumulation-bits 13" in text and "--quant-accumulation-promotion 128" in text
    assert quant.attn_qk.gemm.limits("fprop") and not quant_config([]).linear.gemm.limits("fprop")

    import pretrain_gpt
    from conftest import TINY_MOCK_ARGS
    from megatron.training.training import pretrain

    args = TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-scheme", "FA_linear_mxfp8"]
    plain = pretrain(pretrain_gpt.forward_step, args)
    limited = pretrain(pretrain_gpt.forward_step, args + ["--quant-accumulation-bits", "7"])
    assert all(math.isfinite(v) for v in limited.losses.values())
    assert limited.losses[2] != plain.losses[2]


@pytest.mark.parametrize("argv, named", [
    (["--quant-accumulation-gemms", "fprop"], "--quant-accumulation-gemms fprop"),
    (["--quant-accumulation-promotion", "128"], "--quant-accumulation-promotion 128"),
    (["--quant-accumulation-group", "16"], "--quant-accumulation-group 16"),
])
def test_accumulator_flags_without_bits_are_refused(argv, named):
    from megatron.quantization.config import SettingError, settings_from_flags
    with pytest.raises(SettingError, match=f"{named} without --quant-accumulation-bits"):
        settings_from_flags(["--quant-scheme", "linear_mxfp8"] + argv)
    with_bits = settings_from_flags(["--quant-scheme", "linear_mxfp8",
                                     "--quant-accumulation-bits", "13"] + argv)
    assert with_bits.gemm.accumulation_bits == 13
