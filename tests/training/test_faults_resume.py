"""Resuming with other settings than the run that saved: checkpoints record the quantization
settings (as flags), the run's label, the sha256 of its recipe file, its precision and --seed;
a --load compares them before the model is built.

A difference that changes the numerics is one `error:` line naming every differing setting
(checkpoint value vs this run) and how to go on; --override-checkpoint-settings continues with
one `warning:` line naming them; settings that do not change the results (kernel mode, weight
cache) are one `note:` line; a checkpoint saved before the record existed is one `note:` line
saying that it cannot be compared. Never a silent resume, never a traceback.
"""

import os
import shutil

import pytest

import pretrain_gpt
from megatron.training import checkpointing
from megatron.training.checkpoint_files import load_common_state
from megatron.training.cli import main

from conftest import TINY_MOCK_ARGS
from test_faults import MODEL_BUILT, one_error_line

FP8_DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed",
               "--fp8-amax-history-len", "4", "--bf16"]
RECIPE = ("configs:\n  fp4: {format: nvfp4, weight_2d: true}\n"
          "matchers:\n  fc1: {config: fp4, type: glob, pattern: '*linear_fc1', enabled: true}\n")


def train(capsys, *argv):
    code = main(pretrain_gpt.forward_step, TINY_MOCK_ARGS + list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def resume(root, capsys, *extra):
    return train(capsys, "--train-iters", "3", "--load", root, *extra)


@pytest.fixture(scope="module")
def fp8_saved(tmp_path_factory):
    """A checkpoint of an FP8 run with delayed scaling at iteration 2."""
    root = str(tmp_path_factory.mktemp("fp8") / "ckpt")
    code = main(pretrain_gpt.forward_step,
                TINY_MOCK_ARGS + ["--train-iters", "2", "--save", root] + FP8_DELAYED)
    assert code == 0
    return root


@pytest.fixture
def fp8_ckpt(fp8_saved, tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(fp8_saved, root)
    return root


def test_the_checkpoint_records_the_settings(fp8_saved):
    common = load_common_state(checkpointing.checkpoint_dir(fp8_saved, 2))
    record = common[checkpointing.RUN_SETTINGS_KEY]
    assert record["label"] == "linear_fp8" and record["precision"] == "bf16"
    assert record["seed"] == 1234 and record["recipe_file_sha256"] is None
    flags = record["quantization"]
    assert flags["fp8_format"] == "hybrid" and flags["fp8_recipe"] == "delayed"
    assert flags["fp8_amax_history_len"] == 4 and flags["quant_kernels"] == "auto"
    assert common["has_amax_histories"]


def test_resuming_fp8_delayed_without_its_flags_is_refused(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, "--bf16")
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out and "iteration        3/" not in out
    assert line == (
        f"error: --load {fp8_ckpt}: iter_0000002 was saved with other settings than this "
        "run's (linear_fp8 (checkpoint) vs bf16 (this run)): --quant-scheme linear_fp8 "
        "(checkpoint) vs bf16 (this run); --fp8-format hybrid (checkpoint) vs unset (this "
        "run); --fp8-recipe delayed (checkpoint) vs unset (this run); --fp8-amax-history-len 4 "
        "(checkpoint) vs 1 (this run); resuming would change how it trains without a word and "
        "drop its delayed-scaling amax histories: pass the checkpoint's settings, or add "
        "--override-checkpoint-settings to continue with this run's")


def test_resuming_with_another_seed_is_refused(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, "--seed", "5", *FP8_DELAYED)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert line.startswith(f"error: --load {fp8_ckpt}: iter_0000002 was saved with other "
                           "settings than this run's: --seed 1234 (checkpoint) vs 5 (this "
                           "run); resuming would change how it trains without a word: "), line
    assert "amax histories" not in line        # this run keeps delayed scaling


def test_resuming_with_another_precision_is_refused(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, *FP8_DELAYED[:-1])        # without --bf16
    assert code == 2 and MODEL_BUILT not in out
    assert "precision bf16 (checkpoint) vs fp32 (this run; --bf16, --fp16 or neither)" in \
        one_error_line(err)


def test_the_override_continues_and_names_what_differs(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, "--bf16", "--seed", "5",
                            "--override-checkpoint-settings")
    assert code == 0 and "exiting at iteration 3" in out, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: --load")]
    assert warnings == [
        f"warning: --load {fp8_ckpt}: continuing iter_0000002 with this run's settings, not the "
        "checkpoint's (--override-checkpoint-settings) (linear_fp8 (checkpoint) vs bf16 (this "
        "run)): --quant-scheme linear_fp8 (checkpoint) vs bf16 (this run); --fp8-format hybrid "
        "(checkpoint) vs unset (this run); --fp8-recipe delayed (checkpoint) vs unset (this "
        "run); --fp8-amax-history-len 4 (checkpoint) vs 1 (this run); --seed 1234 (checkpoint) "
        "vs 5 (this run); its delayed-scaling amax histories are not used (this run has no "
        "delayed scaling)"]


def test_settings_that_keep_the_results_are_only_stated(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, *FP8_DELAYED, "--quant-kernels", "eager",
                            "--no-quant-weight-cache")
    assert code == 0 and "exiting at iteration 3" in out, err
    notes = [line for line in out.splitlines() if "was saved with" in line]
    assert notes == [f"note: --load {fp8_ckpt}: iter_0000002 was saved with --quant-kernels auto "
                     "(checkpoint) vs eager (this run); --quant-weight-cache on (checkpoint) vs "
                     "off (this run); these settings do not change the results (bit for bit "
                     "the same)"]


def test_the_same_settings_resume_without_a_word(fp8_ckpt, capsys):
    code, out, err = resume(fp8_ckpt, capsys, *FP8_DELAYED)
    assert code == 0 and "exiting at iteration 3" in out, err
    assert not [line for line in out.splitlines() if "was saved with" in line
                or "cannot be compared" in line or line.startswith("warning:")]


def test_a_checkpoint_without_the_record_says_it_cannot_be_compared(tmp_path, capsys,
                                                                    monkeypatch):
    root = str(tmp_path / "old")
    monkeypatch.setattr(checkpointing, "run_settings", lambda args: None)   # as before
    code, _, err = train(capsys, "--train-iters", "2", "--save", root)
    assert code == 0, err
    monkeypatch.undo()
    assert checkpointing.RUN_SETTINGS_KEY not in load_common_state(
        checkpointing.checkpoint_dir(root, 2))
    code, out, err = resume(root, capsys, "--seed", "5")
    assert code == 0 and "exiting at iteration 3" in out, err
    notes = [line for line in out.splitlines() if "cannot be compared" in line]
    assert notes == [f"note: --load {root}: iter_0000002 records no quantization settings, "
                     "precision or seed (saved before checkpoints recorded them): they cannot "
                     "be compared with this run's (bf16, fp32, --seed 5); resuming takes this "
                     "run's"]


def test_a_recipe_file_with_other_contents_is_refused(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    root = str(tmp_path / "ckpt")
    code, _, err = train(capsys, "--train-iters", "2", "--save", root,
                         "--quant-recipe-file", str(recipe))
    assert code == 0, err
    # Moved, same contents: stated, not refused.
    moved = tmp_path / "moved.yaml"
    shutil.copy(recipe, moved)
    code, out, err = resume(root, capsys, "--quant-recipe-file", str(moved))
    assert code == 0, err
    assert f"note: --load {root}: iter_0000002 was saved with --quant-recipe-file {recipe} " \
           f"(checkpoint) vs {moved} (this run; the same contents)" in out
    # Same path, other contents: refused, naming both digests.
    recipe.write_text(RECIPE.replace("nvfp4", "mxfp4"))
    code, out, err = resume(root, capsys, "--quant-recipe-file", str(recipe))
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert f"--quant-recipe-file {recipe} (sha256 " in line and "(checkpoint) vs " in line
    assert line.count(f"{recipe} (sha256 ") == 2 and "(this run)" in line


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule
# ---------------------------------------------------------------------------------------------


def test_another_learning_rate_schedule_is_stated(fp8_ckpt, capsys):
    """megatron-core keeps the checkpoint's schedule: a resume with another --lr trained on
    the old one without a word."""
    code, out, err = resume(fp8_ckpt, capsys, *FP8_DELAYED, "--lr", "1e-3",
                            "--lr-decay-iters", "30", "--adam-beta2", "0.95")
    assert code == 0 and "exiting at iteration 3" in out, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: --load")]
    assert warnings == [
        f"warning: --load {fp8_ckpt}: the optimizer settings and learning-rate schedule "
        "continue as the checkpoint's, not as this run's flags say: --lr 0.003 (checkpoint) vs "
        "0.001 (this run); --adam-beta2 0.999 (checkpoint) vs 0.95 (this run); "
        "--lr-decay-iters 20 (checkpoint) vs 30 (this run) (--lr-decay-iters defaults to "
        "--train-iters); --override-checkpoint-settings applies this run's"]


def test_the_override_applies_this_runs_schedule(fp8_ckpt, capsys):
    straight, _, err = resume(fp8_ckpt, capsys, *FP8_DELAYED)
    assert straight == 0, err
    code, out, err = resume(fp8_ckpt, capsys, *FP8_DELAYED, "--lr", "1e-3",
                            "--override-checkpoint-settings")
    assert code == 0, err
    assert f"warning: --load {fp8_ckpt}: this run's optimizer settings and learning-rate " \
           "schedule replace the checkpoint's (--override-checkpoint-settings): --lr 0.003 " \
           "(checkpoint) vs 0.001 (this run)" in out
    rates = [line for line in out.splitlines() if "iteration        3/" in line]
    assert rates and "learning rate: 9.946827E-04" in rates[0], rates   # 1e-3, not 3e-3
