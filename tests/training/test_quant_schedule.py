"""--quant-schedule in training: each iteration runs the phase the schedule gives it, the
switches are logged, and a run resumed from a checkpoint saved before, between or after the
switches repeats the uninterrupted run bit for bit (the NVFP4 recipe, so stochastic rounding
and the Hadamard transform take part); a resume whose past phases differ is refused."""

import os

import pytest

import pretrain_gpt
from megatron.training.arguments import ConfigError
from megatron.training.checkpoint_files import TRACKER_FILE
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS
from test_recipe_training import _Observing

ITERS = 6
# Iteration 1 quantized, 2-3 forward in BF16, 4 all BF16, 5-6 quantized again.
SCHEDULE = ["high_precision_forward@1", "high_precision@0.5", "quantized@4"]
EXPECTED_GEMMS = {1: {"fprop", "dgrad", "wgrad"}, 2: {"dgrad", "wgrad"},
                  3: {"dgrad", "wgrad"}, 4: set(), 5: {"fprop", "dgrad", "wgrad"},
                  6: {"fprop", "dgrad", "wgrad"}}
RECIPE = ["--quant-recipe", "bf16_with_nvfp4_mixed", "--bf16", "--train-iters", str(ITERS)]


class _GemmsPerIteration(_Observing):
    """The GEMMs whose operands were quantized, per iteration."""

    def __init__(self):
        self.iteration, self.seen = None, {}

    def on_iteration_start(self, iteration):
        self.iteration = iteration
        self.seen[iteration] = set()

    def __call__(self, site, gemm, operand, hp, q, fmt, axis, **extra):
        if q is not None:
            self.seen[self.iteration].add(gemm)


def train(extra, callbacks=()):
    return pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + RECIPE + extra,
                    callbacks=callbacks)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run, saving a checkpoint after every iteration."""
    ckpt = str(tmp_path_factory.mktemp("schedule") / "ckpt")
    gemms = _GemmsPerIteration()
    result = train(["--quant-schedule", *SCHEDULE, "--save", ckpt, "--save-interval", "1"],
                   callbacks=[gemms])
    return result, gemms.seen, ckpt


def resume(ckpt, iteration, extra, callbacks=()):
    """A run resumed from the straight run's checkpoint of `iteration` (the tracker pointed
    at it)."""
    with open(os.path.join(ckpt, TRACKER_FILE), "w") as f:
        f.write(str(iteration))
    return train(["--load", ckpt] + extra, callbacks=callbacks)


def test_each_iteration_runs_its_phase(straight):
    result, seen, _ = straight
    assert seen == EXPECTED_GEMMS
    assert sorted(result.losses) == list(range(1, ITERS + 1))


def test_the_start_up_and_the_switches_say_it(tmp_path, capsys):
    train(["--quant-schedule", *SCHEDULE, "--train-iters", "5"])
    out = capsys.readouterr().out
    assert ("precision schedule (--quant-schedule): iterations 1-1 quantized; iterations 2-2 "
            "high_precision_forward; iterations 3-4 high_precision; iterations 5-5 quantized"
            ) in out           # --train-iters 5: 0.5 is iteration 2.5 -> 2 (round half even)
    assert "--quant-schedule: from iteration 2, high_precision_forward (forward GEMMs in the " \
           "run's precision, backward as configured)" in out
    assert "--quant-schedule: from iteration 3, high_precision (every GEMM" in out
    assert "--quant-schedule: from iteration 5, quantized (every GEMM as configured)" in out


def test_the_schedule_changes_the_run_only_from_its_first_switch(straight):
    result, _, _ = straight
    # Observed as the straight run was (an observer sends attention down its unfused path).
    plain = train([], callbacks=[_GemmsPerIteration()])
    assert plain.losses[1] == result.losses[1]
    assert all(plain.losses[it] != result.losses[it] for it in range(2, ITERS + 1))


@pytest.mark.parametrize("at", [1, 3, 4])
def test_a_resume_before_between_or_after_the_switches_is_bit_exact(straight, at):
    result, _, ckpt = straight
    gemms = _GemmsPerIteration()
    resumed = resume(ckpt, at, ["--quant-schedule", *SCHEDULE], callbacks=[gemms])
    assert sorted(resumed.losses) == list(range(at + 1, ITERS + 1))
    for it in resumed.losses:
        assert resumed.losses[it] == result.losses[it], it
    assert gemms.seen == {it: EXPECTED_GEMMS[it] for it in range(at + 1, ITERS + 1)}


def test_a_resume_whose_past_phases_differ_is_refused(straight):
    _, _, ckpt = straight
    with pytest.raises(ConfigError, match=r"--quant-schedule high_precision_forward@1 "
                       r"high_precision@3 quantized@4 \(checkpoint\) vs high_precision@2 "
                       r"\(this run; the phases of iterations 1-3 differ\)"):
        resume(ckpt, 3, ["--quant-schedule", "high_precision@2"])
    with pytest.raises(ConfigError, match=r"vs none \(this run; the phases of iterations 1-3"):
        resume(ckpt, 3, [])


def test_a_resume_that_changes_only_the_future_says_so(straight, capsys):
    result, _, ckpt = straight
    other = ["high_precision_forward@1", "quantized@3"]     # iteration 4 quantized, not BF16
    resumed = resume(ckpt, 3, ["--quant-schedule", *other], callbacks=[_GemmsPerIteration()])
    out = capsys.readouterr().out
    assert ("note: the checkpoint's precision schedule (high_precision_forward@1 "
            "high_precision@3 quantized@4, as iteration counts) agrees with this run's "
            "(high_precision_forward@1 quantized@3) on the 3 iterations trained") in out
    assert resumed.losses[4] != result.losses[4]


def test_a_schedule_needs_something_quantized_and_a_reachable_switch():
    base = TINY_MOCK_ARGS + ["--train-iters", "4"]
    with pytest.raises(ConfigError, match="this run quantizes nothing"):
        pretrain(pretrain_gpt.forward_step, base + ["--quant-schedule", "high_precision@2"])
    with pytest.raises(ConfigError, match="it would never take effect"):
        pretrain(pretrain_gpt.forward_step, base + ["--quant-scheme", "linear_mxfp8",
                                                    "--quant-schedule", "high_precision@4"])
