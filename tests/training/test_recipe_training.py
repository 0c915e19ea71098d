"""Training under the FP4/FP8 recipes: what a run quantizes, and that a resumed run repeats
the uninterrupted one bit for bit (stochastic rounding and delayed scaling included)."""

import math

import pytest

import pretrain_gpt
from megatron.quantization.runtime import runtimes
from megatron.training.arguments import ConfigError
from megatron.training.training import TrainingCallback, pretrain

from conftest import TINY_MOCK_ARGS


class _Observing(TrainingCallback):
    """A callback that observes the run's model (its GEMM sites) for the whole run."""

    _runtimes = ()

    def on_train_start(self, model_chunks, iteration):
        self._runtimes = runtimes(model_chunks)
        for runtime in self._runtimes:
            runtime.add_observer(self)

    def on_train_end(self, exit_reason):
        for runtime in self._runtimes:
            runtime.remove_observer(self)


class _Operands(_Observing):
    """Records, per (layer, site kind, gemm, operand): the format and the extra keywords."""

    def __init__(self):
        self.seen = {}

    def __call__(self, site, gemm, operand, hp, q, fmt, axis, **extra):
        if q is not None:
            key = (site.layer_number, site.kind, site.name.rsplit(".", 1)[-1], gemm, operand)
            self.seen.setdefault(key, []).append((fmt, sorted(extra)))


def train(extra, iters=4, callbacks=()):
    return pretrain(pretrain_gpt.forward_step,
                    TINY_MOCK_ARGS + ["--train-iters", str(iters)] + extra, callbacks=callbacks)


def test_nvfp4_recipe_quantizes_what_the_paper_says(capsys):
    seen = _Operands()
    result = train(["--quant-recipe", "nvfp4"], iters=2, callbacks=[seen])
    assert all(math.isfinite(v) for v in result.losses.values())
    out = capsys.readouterr().out
    assert "quantized GEMM sites" in out and "decoder.layers.1.mlp.linear_fc1" in out
    layers = {key[0] for key in seen.seen}
    assert layers == {1}                      # 2 layers: the last (15%, at least one) in BF16
    assert {key[1] for key in seen.seen} == {"linear"}      # attention stays BF16
    for (layer, kind, name, gemm, operand), reports in seen.seen.items():
        formats = {fmt for fmt, _ in reports}
        extras = {tuple(e) for _, e in reports}
        assert formats == {"nvfp4"}
        expected = set()
        if operand == "grad_output":
            expected.add("seed")                              # SR on gradients only
        if operand == "weight":
            expected.add("weight")                            # 16x16 tiles
        assert extras == {tuple(sorted(expected))}, (name, gemm, operand, extras)


def _resume_matches(extra, tmp_path):
    straight = train(extra)
    ckpt = str(tmp_path / "ckpt")
    first = train(extra + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"])
    assert first.iteration == 2
    resumed = train(extra + ["--load", ckpt])
    assert sorted(resumed.losses) == [3, 4]
    for it in (1, 2):
        assert first.losses[it] == straight.losses[it], it
    for it in (3, 4):
        assert resumed.losses[it] == straight.losses[it], it
    return straight


def test_resume_with_stochastic_rounding_is_bit_exact(tmp_path):
    straight = _resume_matches(["--quant-scheme", "linear_mxfp4", "--quant-stochastic-rounding",
                                "all", "--quant-rht", "16", "--bf16"], tmp_path)
    # The draws really matter: round to nearest trains to other losses.
    nearest = train(["--quant-scheme", "linear_mxfp4", "--quant-rht", "16", "--bf16"])
    assert nearest.losses[4] != straight.losses[4]


def test_resume_with_delayed_scaling_is_bit_exact(tmp_path, capsys):
    extra = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
             "--fp8-amax-compute-algo", "max", "--bf16"]
    straight = _resume_matches(extra, tmp_path)
    # The histories are what makes it exact: a resumed run without them starts at scale 1.0.
    tensorwise = train(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--bf16"])
    assert tensorwise.losses[4] != straight.losses[4]


class _Amaxes(_Observing):
    """The amax each delayed-scaled operand's scale came from, in call order, per operand."""

    def __init__(self):
        self.used = {}

    def __call__(self, site, gemm, operand, hp, q, fmt, axis, **extra):
        if "amax" in extra:
            self.used.setdefault((site.name, gemm, operand), []).append(
                (float(extra["amax"]), float(hp.detach().abs().max())))


def test_delayed_scaling_starts_at_the_initial_scale_then_follows_the_history():
    amaxes = _Amaxes()
    train(["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--bf16"], iters=2,
          callbacks=[amaxes])
    assert amaxes.used and all(site.startswith("decoder.layers") for site, *_ in amaxes.used)
    for key, steps in amaxes.used.items():
        # 2 iterations x 2 micro-batches, each a step, plus the final validation's forwards.
        assert len(steps) >= 4, key
        assert steps[0][0] == 0.0, key               # empty history: TE's initial scale 1.0
        for (used, _), (_, previous) in zip(steps[1:], steps[:-1]):
            # --fp8-amax-history-len 1, most_recent: the amax of the step before (reduced
            # over no other rank here).
            assert used == previous, key


def test_fp8_mxfp8_recipe_trains_exactly_as_the_mxfp8_scheme():
    a = train(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--bf16"], iters=3)
    b = train(["--quant-scheme", "linear_mxfp8", "--mx-grad-format", "e5m2", "--mx-scale-mode",
               "rceil", "--bf16"], iters=3)
    assert a.losses == b.losses and a.val_losses == b.val_losses


@pytest.mark.parametrize("recipe", ["mxfp4_rht_sr"])
def test_mxfp4_rht_sr_recipe_trains(recipe):
    seen = _Operands()
    result = train(["--quant-recipe", recipe, "--bf16"], iters=2, callbacks=[seen])
    assert all(math.isfinite(v) for v in result.losses.values())
    gemms = {key[3] for key in seen.seen}
    assert gemms == {"dgrad", "wgrad"}                      # forward in BF16
    assert all(extras == ["seed"] for reports in seen.seen.values() for _, extras in reports)


def test_recipe_file_run_and_a_file_that_matches_nothing(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("configs:\n  fp4: {format: nvfp4, weight_2d: true}\n"
                    "matchers:\n  fc1: {config: fp4, type: glob, pattern: '*linear_fc1', "
                    "enabled: true}\n")
    seen = _Operands()
    train(["--quant-recipe-file", str(path)], iters=1, callbacks=[seen])
    assert {key[2] for key in seen.seen} == {"linear_fc1"}
    assert {key[0] for key in seen.seen} == {1, 2}
    path.write_text("configs:\n  fp4: {format: nvfp4}\n"
                    "matchers:\n  x: {config: fp4, type: glob, pattern: 'encoder.*', "
                    "enabled: true}\n")
    with pytest.raises(ConfigError, match=r"matcher\(s\) x decide no GEMM site of this model"):
        train(["--quant-recipe-file", str(path)], iters=1)
    # A dead matcher next to a live one: the layer it was meant to keep in BF16 would not be.
    path.write_text("configs:\n  fp4: {format: nvfp4}\n  hp: {format: none}\n"
                    "matchers:\n"
                    "  last: {config: hp, type: glob, pattern: 'decoder.layer.1.*', enabled: true}\n"
                    "  all: {config: fp4, type: glob, pattern: '*linear_*', enabled: true}\n")
    with pytest.raises(ConfigError, match=r"matcher\(s\) last decide no GEMM site"):
        train(["--quant-recipe-file", str(path)], iters=1)


def test_quant_kernels_compile_trains_the_recipes_exactly_as_eager():
    """--quant-kernels compile (torch.compile of fake_quantize) on the NVFP4 recipe (stochastic
    rounding, 16x16 weight tiles, RHT) and on delayed FP8: bit for bit the eager losses."""
    for extra in (["--quant-recipe", "nvfp4"], ["--fp8-format", "hybrid", "--bf16"]):
        eager = train(extra + ["--quant-kernels", "eager"], iters=2)
        compiled = train(extra + ["--quant-kernels", "compile"], iters=2)
        assert compiled.losses == eager.losses, extra
