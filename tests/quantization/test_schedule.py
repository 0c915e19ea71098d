"""Precision schedules (megatron/quantization/schedule.py, --quant-schedule): the switches as
iteration counts, the phase of each iteration, and what a site computes in each phase.

The expected iterations are worked out by hand from the flag's definition (a switch PHASE@WHEN
applies from iteration WHEN + 1; a fraction f of --train-iters T is round(f * T)); the
expected GEMM results are torch's plain products of the unquantized operands."""

import pytest
import torch
import torch.nn.functional as F

from megatron.quantization.config import SettingError
from megatron.quantization.gemm import quantized_linear
from megatron.quantization.observers import GemmSite, QuantizationCounter, observer_for
from megatron.quantization.gemm import SiteState
from megatron.quantization.schedule import (
    HIGH_PRECISION, HIGH_PRECISION_FORWARD, QUANTIZED, Switch, describe, history, phase_at,
    phase_config, resolve)
from megatron.quantization.schemes import quant_config


@pytest.mark.parametrize("entries, train_iters, expected", [
    (["high_precision_forward@0.9"], 100, [Switch(90, HIGH_PRECISION_FORWARD)]),
    (["high_precision@0.5", "quantized@0.75"], 10, [Switch(5, HIGH_PRECISION),
                                                    Switch(8, QUANTIZED)]),   # 7.5 -> 8
    (["high_precision_forward@3", "high_precision@.5", "quantized@9"], 12,
     [Switch(3, HIGH_PRECISION_FORWARD), Switch(6, HIGH_PRECISION), Switch(9, QUANTIZED)]),
    (["high_precision@0"], 5, [Switch(0, HIGH_PRECISION)]),
    ([], 5, []),
])
def test_switches_as_iteration_counts(entries, train_iters, expected):
    assert resolve(entries, train_iters) == expected


@pytest.mark.parametrize("entries, train_iters, message", [
    (["bf16@0.9"], 10, "PHASE one of quantized, high_precision_forward, high_precision"),
    (["high_precision"], 10, "expected PHASE@WHEN"),
    (["high_precision@ninety"], 10, "expected PHASE@WHEN"),
    (["high_precision@-3"], 10, "expected PHASE@WHEN"),
    (["high_precision@1.5"], 10, "the fraction 1.5 is not within 0..1"),
    (["high_precision@10"], 10, "ends at --train-iters 10; it would never take effect"),
    (["high_precision@1.0"], 10, "ends at --train-iters 10"),
    (["high_precision@6", "quantized@4"], 10, "not after the previous switch (iteration 6)"),
    (["high_precision@0.5", "quantized@5"], 10, "not after the previous switch (iteration 5)"),
    (["quantized@3"], 10, "the run is already quantized then"),
    (["high_precision@2", "high_precision@4"], 10, "the run is already high_precision then"),
])
def test_schedules_that_cannot_be_followed_are_one_line(entries, train_iters, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(entries, train_iters)


def test_the_flag_checks_each_entry_when_parsed():
    with pytest.raises(SettingError, match="--quant-schedule 'fp8@3'"):
        quant_config(["--quant-scheme", "linear_mxfp8", "--quant-schedule", "fp8@3"])


def test_the_phase_of_each_iteration():
    switches = [Switch(2, HIGH_PRECISION_FORWARD), Switch(3, HIGH_PRECISION), Switch(5, QUANTIZED)]
    # iterations 1-2 quantized, 3 forward in high precision, 4-5 all, 6- quantized again
    expected = {1: QUANTIZED, 2: QUANTIZED, 3: HIGH_PRECISION_FORWARD, 4: HIGH_PRECISION,
                5: HIGH_PRECISION, 6: QUANTIZED, 7: QUANTIZED}
    assert {n: phase_at(switches, n) for n in expected} == expected
    assert describe(switches, 7) == ("iterations 1-2 quantized; iterations 3-3 "
                                     "high_precision_forward; iterations 4-5 high_precision; "
                                     "iterations 6-7 quantized")
    assert history(switches, 3) == switches[:1]       # what the first 3 iterations saw
    assert history(switches, 2) == []


def test_phase_configs_drop_the_phases_gemms_only():
    linear = quant_config(["--quant-recipe", "nvfp4", "--quant-accumulation-bits", "13"],
                          num_layers=8).linear
    assert phase_config(linear, QUANTIZED) is linear
    forward = phase_config(linear, HIGH_PRECISION_FORWARD)
    assert (forward.fprop.a, forward.fprop.b) == ("none", "none")
    assert (forward.dgrad, forward.wgrad) == (linear.dgrad, linear.wgrad)
    assert forward.rht.gemms == linear.rht.gemms == ("wgrad",)
    assert forward.gemm.accumulation_gemms == ("dgrad", "wgrad")
    assert forward.stochastic == linear.stochastic
    everything = phase_config(linear, HIGH_PRECISION)
    assert not everything.enabled and everything.rht.gemms == ()
    assert everything.gemm.accumulation_gemms == ()


def _site(config):
    state = SiteState("decoder.layers.0.mlp.linear_fc1", config)
    return GemmSite("decoder.layers.0.mlp.linear_fc1", "linear", 1, config, state)


@pytest.mark.parametrize("phase, quantized_gemms", [
    (QUANTIZED, {"fprop", "dgrad", "wgrad"}),
    (HIGH_PRECISION_FORWARD, {"dgrad", "wgrad"}),
    (HIGH_PRECISION, set()),
])
def test_a_site_runs_its_runtimes_phase(phase, quantized_gemms):
    """The forward of a high-precision phase is torch's product of the unquantized operands;
    the GEMMs that stay quantized are the ones the counter sees."""
    torch.manual_seed(0)
    config = quant_config(["--quant-scheme", "linear_mxfp4"]).linear
    site = _site(config)
    site.state.runtime.phase = phase
    counter = QuantizationCounter()
    site.state.runtime.add_observer(counter)
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = quantized_linear(x, w, None, site.active_config, observer=observer_for(site),
                         state=site.state)
    exact = F.linear(x, w)
    assert torch.equal(y, exact) == (phase != QUANTIZED)
    y.backward(torch.randn_like(y))
    assert {gemm for _, gemm, _, _ in counter.quantized} == quantized_gemms


@pytest.mark.parametrize("when, train_iters, after", [
    ("0.7", 45, 32),       # 31.5 exactly: halves to even (binary floating point: 31.4999...)
    ("0.545", 100, 54),    # 54.5 -> 54 (floating point: 54.50000000000001 -> 55)
    ("0.35", 90, 32),      # 31.5 -> 32
    ("0.14", 75, 10),      # 10.5 -> 10
])
def test_fractions_round_exactly_halves_to_even(when, train_iters, after):
    assert resolve([f"high_precision@{when}"], train_iters) == [Switch(after, HIGH_PRECISION)]


def test_a_switch_at_zero_shows_no_empty_quantized_range():
    switches = resolve(["high_precision@0."], 4)
    assert describe(switches, 4) == "iterations 1-4 high_precision"
    assert describe(resolve(["high_precision_forward@0", "quantized@2"], 4), 4) == \
        "iterations 1-2 high_precision_forward; iterations 3-4 quantized"


def test_only_ascii_digits_are_iteration_counts():
    with pytest.raises(ValueError, match="expected PHASE@WHEN"):
        resolve(["high_precision@\u0665"], 10)          # ARABIC-INDIC DIGIT FIVE
