"""The FP4/FP8-recipe pieces inside the quantized GEMMs: the random Hadamard transform leaves
the exact product unchanged, stochastic rounding is reproducible from the seed an observer is
given, 2-D weight tiles give fprop and dgrad the same weight, delayed scaling takes its scale
from the amax history recorded before the step."""

import pytest
import torch
import torch.nn.functional as F

from megatron.quantization.config import (
    Fp8Settings, MatmulQuantConfig, OperandFormats, RhtSettings)
from megatron.quantization.formats import fake_quantize, random_hadamard_transform
from megatron.quantization.gemm import SiteState, quantize_operand, quantized_linear
from megatron.quantization.runtime import QuantRuntime


def _config(fmt="none", **settings):
    ops = OperandFormats(fmt, fmt)
    return MatmulQuantConfig(fprop=ops, dgrad=ops, wgrad=ops, **settings)


class Recorder:
    """Observer that keeps every report (operand, hp, q, fmt, axis, extra)."""

    def __init__(self):
        self.reports = {}

    def __call__(self, gemm, operand, hp, q, fmt, axis, **extra):
        self.reports.setdefault((gemm, operand), []).append(
            (hp.detach().clone(), None if q is None else q.clone(), fmt, axis, extra))


def _run(config, x, w, state=None, observer=None, grad=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(x, w, None, config, observer=observer, state=state)
    y.backward(grad if grad is not None else torch.ones_like(y))
    return y.detach(), x.grad, w.grad


def _data(shape=(3, 7, 40), n=24, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(n, shape[-1], generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(*shape[:-1], n, generator=g, dtype=torch.float64).to(dtype)
    return x, w, grad


@pytest.mark.parametrize("block", [16, 64])
def test_hadamard_transform_leaves_the_exact_product_unchanged(block):
    # K = 40, N = 24 and M = 21 tokens are not multiples of the block: zero padding.
    x, w, grad = _data()
    cfg = _config(rht=RhtSettings(("fprop", "dgrad", "wgrad"), block, 5))
    recorder = Recorder()      # an observer forces the quantized path although nothing rounds
    y, gx, gw = _run(cfg, x, w, observer=recorder, grad=grad)
    y0, gx0, gw0 = _run(_config(), x, w, grad=grad)
    for mine, plain in ((y, y0), (gx, gx0), (gw, gw0)):
        torch.testing.assert_close(mine, plain, rtol=1e-12, atol=1e-12)
    # The wgrad operands the GEMM saw are the rotated, padded token-flattened tensors.
    hp_x = recorder.reports[("wgrad", "input")][0][0]
    padded = F.pad(x.reshape(21, 40), (0, 0, 0, -21 % block))
    torch.testing.assert_close(hp_x, random_hadamard_transform(padded, axis=0, block=block, seed=5),
                               rtol=0, atol=0)
    assert hp_x.shape[0] % block == 0


def test_hadamard_transform_changes_what_is_quantized():
    x, w, grad = _data(dtype=torch.float32)
    plain = _run(_config("mxfp4"), x, w, grad=grad)[2]
    rotated = _run(_config("mxfp4", rht=RhtSettings(("wgrad",), 16)), x, w, grad=grad)[2]
    exact = _run(_config(), x, w, grad=grad)[2]
    assert not torch.equal(plain, rotated)
    # Both are estimates of the same exact gradient.
    for estimate in (plain, rotated):
        assert (estimate - exact).norm() < 0.5 * exact.norm()


def test_stochastic_rounding_is_reproducible_from_the_reported_seed():
    x, w, grad = _data(dtype=torch.float32)
    cfg = _config("mxfp4", stochastic=frozenset({"dgrad.a", "wgrad.b"}))
    state = SiteState("decoder.layers.0.mlp.linear_fc1", cfg)
    state.runtime.start_iteration(seed=7, iteration=3)
    recorder = Recorder()
    first = _run(cfg, x, w, state=state, observer=recorder, grad=grad)
    for (gemm, operand), reports in recorder.reports.items():
        for hp, q, fmt, axis, extra in reports:
            if q is None:
                continue
            stochastic = (gemm, operand) in (("dgrad", "grad_output"), ("wgrad", "grad_output"))
            assert ("seed" in extra) == stochastic, (gemm, operand)
            assert torch.equal(q, quantize_operand(hp, fmt, axis, cfg, **extra)), (gemm, operand)
            if stochastic:   # really stochastic: round to nearest gives other values
                assert not torch.equal(q, fake_quantize(hp, fmt, axis=axis))
    # A second micro-batch of the same iteration draws other bits ...
    second = _run(cfg, x, w, state=state, grad=grad)
    assert torch.equal(first[0], second[0]) and not torch.equal(first[2], second[2])
    # ... and the same iteration started afresh (a resumed run) draws the same ones.
    state.runtime.start_iteration(seed=7, iteration=3)
    again = _run(cfg, x, w, state=state, grad=grad)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    state.runtime.start_iteration(seed=8, iteration=3)
    assert not torch.equal(_run(cfg, x, w, state=state, grad=grad)[2], first[2])


def test_stochastic_draws_are_keyed_by_site_and_shared_by_replicas():
    """Two ranks holding the same site (tensor-parallel replicas) draw the same bits; another
    site, another data-parallel stream or another iteration draws others."""
    seeds = []
    for site, stream, iteration in (("a", 0, 1), ("a", 0, 1), ("b", 0, 1), ("a", 1, 1),
                                    ("a", 0, 2)):
        runtime = QuantRuntime()      # one rank's model
        runtime.start_iteration(seed=1, iteration=iteration, stream=stream)
        seeds.append(runtime.draws.draw_seed(site, "wgrad", "grad_output"))
    assert seeds[0] == seeds[1] and len(set(seeds[1:])) == 4


@pytest.mark.parametrize("fmt,tile", [("nvfp4", 16), ("fp8_e4m3", 128)])
def test_two_dimensional_weight_tiles_make_fprop_and_dgrad_weights_equal(fmt, tile):
    x, w, grad = _data(shape=(2, 5, 2 * tile + 8), n=tile + 8, dtype=torch.float32)
    fp8 = Fp8Settings(recipe="blockwise")
    recorder = Recorder()
    _run(_config(fmt, weight_2d=True, fp8=fp8), x, w, observer=recorder, grad=grad)
    qf = recorder.reports[("fprop", "weight")][0][1]
    qd = recorder.reports[("dgrad", "weight")][0][1]
    assert torch.equal(qf, qd)
    assert recorder.reports[("fprop", "weight")][0][4] == {"weight": True}
    recorder = Recorder()      # 1-D blocks along each GEMM's own axis differ
    _run(_config(fmt, fp8=fp8), x, w, observer=recorder, grad=grad)
    assert not torch.equal(recorder.reports[("fprop", "weight")][0][1],
                           recorder.reports[("dgrad", "weight")][0][1])


def test_delayed_scaling_uses_the_history_before_the_step():
    cfg = _config("fp8_e4m3", fp8=Fp8Settings(recipe="delayed", amax_history_len=2,
                                              amax_compute_algo="max"))
    state = SiteState("site", cfg)
    amaxes = []
    for step, scale in enumerate((1.0, 1000.0, 0.01, 0.01)):
        x, w, grad = _data(dtype=torch.float32, seed=step)
        x = x * scale
        recorder = Recorder()
        _run(cfg, x, w, state=state, observer=recorder, grad=grad)
        hp, q, fmt, axis, extra = recorder.reports[("fprop", "input")][0]
        amaxes.append(float(x.abs().max()))
        used = float(extra["amax"])
        # Step 1: an empty history (amax 0 -> scale 1.0); then the max over the last two steps.
        expected = 0.0 if step == 0 else max(amaxes[max(0, step - 2):step])
        assert used == pytest.approx(expected, rel=0, abs=0)
        assert torch.equal(q, fake_quantize(hp, fmt, axis=axis, scaling="tensor", amax=used))
    # Step 2's input (1000x) exceeded the amax of step 1: it saturated at +-448 * scale_inv.
    assert state.amax.state_dict()["fprop.input"] == [pytest.approx(amaxes[-1]),
                                                      pytest.approx(amaxes[-2])]


def test_delayed_scaling_most_recent_and_state_round_trip():
    cfg = _config("fp8_e4m3", fp8=Fp8Settings(recipe="delayed", amax_history_len=3))
    state = SiteState("site", cfg)
    for step in range(3):
        x, w, grad = _data(dtype=torch.float32, seed=step)
        _run(cfg, x * (step + 1), w, state=state, grad=grad)
    saved = state.amax.state_dict()
    restored = SiteState("site", cfg)
    restored.amax.load_state_dict(saved, torch.device("cpu"))
    x, w, grad = _data(dtype=torch.float32, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(_run(cfg, x, w, state=state, grad=grad),
                                                 _run(cfg, x, w, state=restored, grad=grad)))
    fresh = SiteState("site", cfg)
    assert not torch.equal(_run(cfg, x, w, state=state, grad=grad)[0],
                           _run(cfg, x, w, state=fresh, grad=grad)[0])
