"""quantized_linear / quantized_matmul against a float64 reference with explicit transposes.

The reference quantizes every operand only along its LAST axis, after moving the GEMM's
reduction axis there as a contiguous copy (e.g. W^T.contiguous() for the dgrad weight), and
computes the matmuls in float64. So it does not rely on fake_quantize's `axis` argument, and a
GEMM quantized along the wrong axis would differ by far more than the tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.quantization import (
    MatmulQuantConfig,
    OperandFormats,
    fake_quantize,
    quantized_linear,
    quantized_matmul,
)
from megatron.quantization.config import HiFP8Settings, MxSettings

NONE = OperandFormats()
MX8 = OperandFormats("mxfp8", "mxfp8")
FULL_MX4 = MatmulQuantConfig(fprop=OperandFormats("mxfp4", "mxfp4"),
                             dgrad=OperandFormats("mxfp4", "mxfp4"),
                             wgrad=OperandFormats("mxfp4", "mxfp4"))
MIXED = MatmulQuantConfig(fprop=OperandFormats("mxfp8_e4m3", "mxfp4"),
                          dgrad=OperandFormats("mxfp8_e5m2", "hifp8"),
                          wgrad=OperandFormats("mxfp4", "mxfp8_e5m2"),
                          mx=MxSettings(scale_mode="rceil"))
CONFIGS = {
    "fprop_only": MatmulQuantConfig(fprop=OperandFormats("mxfp4", "mxfp4")),
    "dgrad_only": MatmulQuantConfig(dgrad=OperandFormats("mxfp4", "mxfp4")),
    "wgrad_only": MatmulQuantConfig(wgrad=OperandFormats("mxfp4", "mxfp4")),
    "a_only": MatmulQuantConfig(fprop=OperandFormats("mxfp4", "none"),
                                dgrad=OperandFormats("mxfp4", "none"),
                                wgrad=OperandFormats("mxfp4", "none")),
    "b_only": MatmulQuantConfig(fprop=OperandFormats("none", "mxfp4"),
                                dgrad=OperandFormats("none", "mxfp4"),
                                wgrad=OperandFormats("none", "mxfp4")),
    "full_mxfp4": FULL_MX4,
    "full_mxfp8_rceil": MatmulQuantConfig(MX8, MX8, MX8, mx=MxSettings(scale_mode="rceil")),
    "full_hifp8": MatmulQuantConfig(*(OperandFormats("hifp8", "hifp8"),) * 3),
    "full_hifp8_tensor_scaled": MatmulQuantConfig(*(OperandFormats("hifp8", "hifp8"),) * 3,
                                                  hifp8=HiFP8Settings(scaling="tensor")),
    "mixed": MIXED,
}


def q_explicit(t, fmt, axis, config):
    """Quantize along `axis` by making it the last, contiguous axis, then moving it back."""
    if fmt == "none":
        return t
    moved = t.movedim(axis, -1).contiguous()
    if fmt == "hifp8" and config.hifp8.scaling == "tensor":
        # one scale for the whole operand: 2**-k * HiF8(2**k * t), amax * 2**k in [8, 16)
        k = 3 - int(torch.floor(torch.log2(moved.abs().max().double())))
        q = fake_quantize(moved * 2.0 ** k, "hifp8", saturate=True) * 2.0 ** -k
    else:
        q = fake_quantize(moved, fmt, axis=-1, scale_mode=config.mx.scale_mode,
                          saturate=True if fmt == "hifp8" else None)
    return q.movedim(-1, axis)


def linear_reference(x, w, b, dy, config):
    """(y, dx, dw, db) in float64 from explicitly transposed quantized operands."""
    k, n = x.shape[-1], w.shape[0]
    q = lambda t, fmt, axis: q_explicit(t, fmt, axis, config).double()  # noqa: E731
    y = q(x, config.fprop.a, -1) @ q(w, config.fprop.b, -1).T
    if b is not None:
        y = y + b.double()
    dx = q(dy, config.dgrad.a, -1) @ q(w.T.contiguous(), config.dgrad.b, -1).T   # W along N
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    dw = (q(dy2.T.contiguous(), config.wgrad.b, -1) @ q(x2.T.contiguous(), config.wgrad.a, -1).T)
    return y, dx, dw, dy2.double().sum(0)


def matmul_reference(a, b, dc, config):
    q = lambda t, fmt, axis: q_explicit(t, fmt, axis, config).double()  # noqa: E731
    c = q(a, config.fprop.a, -1) @ q(b, config.fprop.b, -2)
    da = q(dc, config.dgrad.a, -1) @ q(b, config.dgrad.b, -1).transpose(-1, -2)
    db = q(a, config.wgrad.a, -2).transpose(-1, -2) @ q(dc, config.wgrad.b, -2)
    return c, da, db


def close(actual, expected, what):
    expected = expected.to(actual.dtype)
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max() / scale
    assert err < 2e-6, f"{what}: relative error {err:.3g}"


def run_linear(x, w, b, dy, config, observer=None):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    y = quantized_linear(x, w, b, config, observer=observer)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def data(shape_x, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = shape_x[-1]
    x = torch.randn(*shape_x, generator=g) * torch.exp2(torch.randint(-3, 4, (k,), generator=g))
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g)
    dy = torch.randn(*shape_x[:-1], n, generator=g) * torch.exp2(
        torch.randint(-6, 2, shape_x[:-1] + (1,), generator=g).float())
    return [t.to(dtype) for t in (x, w, b, dy)]


# ---------------------------------------------------------------------------------------------
# quantized_linear
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [(40, 70), (5, 7, 64)])
def test_linear_matches_explicit_transpose_reference(name, shape):
    config = CONFIGS[name]
    x, w, b, dy = data(shape, 48, seed=1)
    y, dx, dw, db = run_linear(x, w, b, dy, config)
    ry, rdx, rdw, rdb = linear_reference(x, w, b, dy, config)
    close(y, ry, "y")
    close(dx, rdx, "dx")
    close(dw, rdw, "dw")
    close(db, rdb, "db")
    assert y.shape == shape[:-1] + (48,) and dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_each_switch_affects_only_its_gemm(gemm):
    x, w, b, dy = data((64, 96), 40, seed=2)
    hp = run_linear(x, w, b, dy, MatmulQuantConfig())
    got = run_linear(x, w, b, dy, CONFIGS[f"{gemm}_only"])
    affected = {"fprop": 0, "dgrad": 1, "wgrad": 2}[gemm]
    for i, (g, h) in enumerate(zip(got, hp)):
        if i == affected:
            assert not torch.equal(g, h), f"{gemm} switch had no effect"
        else:
            assert torch.equal(g, h), f"{gemm} switch changed output {i}"


def test_disabled_config_is_plain_linear():
    x, w, b, dy = data((6, 5, 40), 24, seed=3)
    config = MatmulQuantConfig()
    assert not config.enabled
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(xr, wr, b, config)
    assert "Quantized" not in type(y.grad_fn).__name__
    assert torch.equal(y, F.linear(x, w, b))
    assert torch.equal(quantized_matmul(x, w.T, config), torch.matmul(x, w.T))


def test_bias_grad_is_dy_summed_over_tokens():
    x, w, b, dy = data((3, 4, 32), 16, seed=4)
    *_, db = run_linear(x, w, b, dy, FULL_MX4)
    close(db, dy.double().sum((0, 1)), "db")
    _, _, _, db_none = run_linear(x, w, None, dy, FULL_MX4)
    assert db_none is None


def test_bf16_gemms_run_in_bf16():
    x, w, b, dy = data((3, 11, 64), 32, seed=5, dtype=torch.bfloat16)
    config = MatmulQuantConfig(MX8, MX8, OperandFormats("mxfp4", "hifp8"))
    y, dx, dw, db = run_linear(x, w, b, dy, config)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    q = lambda t, fmt, axis: q_explicit(t, fmt, axis, config)  # noqa: E731
    assert torch.equal(y, F.linear(q(x, "mxfp8", -1), q(w, "mxfp8", -1), b))
    assert torch.equal(dx, torch.matmul(q(dy, "mxfp8", -1), q(w, "mxfp8", 0)))
    dy2, x2 = dy.reshape(-1, 32), x.reshape(-1, 64)
    assert torch.equal(dw, torch.matmul(q(dy2, "hifp8", 0).T, q(x2, "mxfp4", 0)))


def test_backward_skips_gemms_without_grad():
    x, w, b, dy = data((40, 64), 32, seed=6)
    calls = []
    observer = lambda gemm, operand, *rest: calls.append((gemm, operand))  # noqa: E731
    xr = x.clone().requires_grad_()
    quantized_linear(xr, w, b, FULL_MX4, observer).backward(dy)
    assert [c for c in calls if c[0] == "wgrad"] == [] and ("dgrad", "grad_input") in calls
    calls.clear()
    wr = w.clone().requires_grad_()
    quantized_linear(x, wr, b, FULL_MX4, observer).backward(dy)
    assert [c for c in calls if c[0] == "dgrad"] == [] and ("wgrad", "grad_weight") in calls


def test_hifp8_operands_saturate_in_training():
    x, w, b, dy = data((32, 32), 8, seed=7)
    x[0, 0] = 1e6
    config = MatmulQuantConfig(fprop=OperandFormats("hifp8", "none"))
    seen = {}
    y = quantized_linear(x, w, None, config,
                         lambda gemm, op, hp, q, fmt, axis: seen.setdefault(op, q))
    assert seen["input"][0, 0].item() == 32768.0 and torch.isfinite(y).all()
    plain = MatmulQuantConfig(fprop=OperandFormats("hifp8", "none"),
                              hifp8=HiFP8Settings(saturate=False))
    assert torch.isinf(quantized_linear(x, w, None, plain)[0]).any()


# ---------------------------------------------------------------------------------------------
# Observer contract
# ---------------------------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, gemm, operand, hp, q, fmt, axis):
        self.calls.append((gemm, operand, hp.detach().clone(), None if q is None else q.clone(),
                           fmt, axis))


def check_observed(recorder, config, expected):
    """expected: [(gemm, operand, hp shape, fmt, axis)], in call order."""
    got = [(g, o, tuple(hp.shape), f, a) for g, o, hp, q, f, a in recorder.calls]
    assert got == expected
    for gemm, operand, hp, q, fmt, axis in recorder.calls:
        if fmt == "none":
            assert q is None
            continue
        assert q.shape == hp.shape
        again = fake_quantize(hp, fmt, axis=axis, scale_mode=config.mx.scale_mode,
                              saturate=config.saturate_for(fmt))
        assert torch.equal(q, again), (gemm, operand)


def test_linear_observer_contract():
    x, w, b, dy = data((5, 7, 64), 48, seed=8)
    config = MatmulQuantConfig(fprop=OperandFormats("mxfp8", "none"), dgrad=MX8,
                               wgrad=OperandFormats("hifp8", "mxfp4"))
    rec = Recorder()
    run_linear(x, w, b, dy, config, rec)
    check_observed(rec, config, [
        ("fprop", "input", (5, 7, 64), "mxfp8_e4m3", 2),
        ("fprop", "weight", (48, 64), "none", 1),
        ("fprop", "output", (5, 7, 48), "none", None),
        ("dgrad", "grad_output", (5, 7, 48), "mxfp8_e4m3", 2),
        ("dgrad", "weight", (48, 64), "mxfp8_e4m3", 0),
        ("dgrad", "grad_input", (5, 7, 64), "none", None),
        ("wgrad", "grad_output", (35, 48), "mxfp4", 0),
        ("wgrad", "input", (35, 64), "hifp8", 0),
        ("wgrad", "grad_weight", (48, 64), "none", None),
    ])
    # hp is the caller-visible tensor; the results are what the GEMMs returned.
    assert torch.equal(rec.calls[0][2], x) and torch.equal(rec.calls[3][2], dy)
    assert torch.equal(rec.calls[6][2], dy.reshape(35, 48))


def test_observer_sees_unquantized_gemms_too():
    x, w, b, dy = data((40, 32), 16, seed=9)
    rec = Recorder()
    y, dx, dw, _ = run_linear(x, w, b, dy, MatmulQuantConfig(), rec)
    assert [c[:2] for c in rec.calls] == [
        ("fprop", "input"), ("fprop", "weight"), ("fprop", "output"),
        ("dgrad", "grad_output"), ("dgrad", "weight"), ("dgrad", "grad_input"),
        ("wgrad", "grad_output"), ("wgrad", "input"), ("wgrad", "grad_weight")]
    assert all(c[3] is None for c in rec.calls)
    assert torch.equal(y, F.linear(x, w, b))
    assert torch.equal(rec.calls[2][2], y) and torch.equal(rec.calls[5][2], dx)


def test_matmul_observer_contract():
    g = torch.Generator().manual_seed(10)
    a, b = torch.randn(2, 3, 40, 64, generator=g), torch.randn(2, 3, 64, 36, generator=g)
    dc = torch.randn(2, 3, 40, 36, generator=g)
    rec = Recorder()
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    quantized_matmul(ar, br, MIXED, rec).backward(dc)
    check_observed(rec, MIXED, [
        ("fprop", "a", (2, 3, 40, 64), "mxfp8_e4m3", 3),
        ("fprop", "b", (2, 3, 64, 36), "mxfp4", 2),
        ("fprop", "output", (2, 3, 40, 36), "none", None),
        ("dgrad", "grad_output", (2, 3, 40, 36), "mxfp8_e5m2", 3),
        ("dgrad", "b", (2, 3, 64, 36), "hifp8", 3),
        ("dgrad", "grad_a", (2, 3, 40, 64), "none", None),
        ("wgrad", "a", (2, 3, 40, 64), "mxfp4", 2),
        ("wgrad", "grad_output", (2, 3, 40, 36), "mxfp8_e5m2", 2),
        ("wgrad", "grad_b", (2, 3, 64, 36), "none", None),
    ])


# ---------------------------------------------------------------------------------------------
# quantized_matmul
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full_mxfp4", "mixed", "dgrad_only", "wgrad_only",
                                  "full_hifp8", "full_hifp8_tensor_scaled"])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_matmul_matches_explicit_transpose_reference(name, batch):
    config = CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    a = torch.randn(*batch, 40, 70, generator=g)
    a = a * torch.exp2(torch.randint(-4, 4, (70,), generator=g))
    b = torch.randn(*batch, 70, 36, generator=g)
    dc = torch.randn(*batch, 40, 36, generator=g)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    c = quantized_matmul(ar, br, config)
    c.backward(dc)
    rc, rda, rdb = matmul_reference(a, b, dc, config)
    close(c.detach(), rc, "c")
    close(ar.grad, rda, "da")
    close(br.grad, rdb, "db")


def test_matmul_bf16_and_shape_errors():
    g = torch.Generator().manual_seed(12)
    a = torch.randn(4, 32, 64, generator=g).bfloat16()
    b = torch.randn(4, 64, 32, generator=g).bfloat16()
    c = quantized_matmul(a, b, FULL_MX4)
    assert c.dtype == torch.bfloat16
    expected = torch.matmul(fake_quantize(a, "mxfp4", -1), fake_quantize(b, "mxfp4", -2))
    assert torch.equal(c, expected)
    with pytest.raises(ValueError, match="batch dims"):
        quantized_matmul(a, b[0], FULL_MX4)
    with pytest.raises(ValueError, match="batch dims"):
        quantized_matmul(a, a, FULL_MX4)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def test_config_validation_and_canonical_names():
    assert OperandFormats("mxfp8", "none").a == "mxfp8_e4m3"
    assert MatmulQuantConfig(fprop=OperandFormats("none", "hifp8")).enabled
    assert not MatmulQuantConfig().enabled
    with pytest.raises(ValueError, match="valid formats"):
        OperandFormats("fp8", "none")
    with pytest.raises(ValueError, match="floor, rceil, ceil, even"):
        MatmulQuantConfig(mx=MxSettings(scale_mode="round"))
    with pytest.raises(TypeError):
        MatmulQuantConfig(fprop=("mxfp8", "mxfp8"))
    config = MatmulQuantConfig()
    assert config.saturate_for("hifp8") is True and config.saturate_for("mxfp8_e4m3") is None
    with pytest.raises(AttributeError):
        config.mx = MxSettings(scale_mode="rceil")
    with pytest.raises(AttributeError):
        config.mx.scale_mode = "rceil"


def test_hifp8_tensor_scaling_changes_the_result():
    """The scaled-HiFP8 check above can fail: unscaled HiF8 of small values differs."""
    scaled = CONFIGS["full_hifp8_tensor_scaled"]
    x, w, b, dy = data((40, 70), 48, seed=1)
    x, w, dy = x * 2.0 ** -12, w * 2.0 ** -10, dy * 2.0 ** -14   # deep in HiF8's 1-bit region
    y, dx, dw, _ = run_linear(x, w, b, dy, scaled)
    ry, rdx, rdw, _ = linear_reference(x, w, b, dy, scaled)
    close(y, ry, "y")
    close(dw, rdw, "dw")
    unscaled = CONFIGS["full_hifp8"]
    uy, _, udw, _ = run_linear(x, w, b, dy, unscaled)
    with pytest.raises(AssertionError):
        close(udw, rdw, "dw")
