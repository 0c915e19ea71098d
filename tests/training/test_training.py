"""End-to-end training runs in this process (world size 1, gloo, CPU)."""

import math
import os
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from megatron.quantization.observers import QuantizationCounter
from megatron.quantization.runtime import runtimes
from megatron.training import checkpointing
from megatron.training.arguments import ConfigError
from megatron.training.corpora import ensure_embedded_dataset
from megatron.training.cli import main
from megatron.training.training import TrainingCallback, pretrain

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env


def run(argv, callbacks=()):
    return pretrain(pretrain_gpt.forward_step, argv, callbacks=callbacks)


def test_llama_tiny_learns_embedded_wikipedia(tmp_path):
    prefix = ensure_embedded_dataset("wikipedia")
    result = run([
        "--model-preset", "llama-tiny", "--data-path", prefix, "--split", "98,2,0",
        "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--log-interval", "5", "--eval-interval", "30",
        "--eval-iters", "2", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache")])
    losses = [result.losses[i] for i in sorted(result.losses)]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    # Uniform over the Llama 3 vocabulary is ln(128256) = 11.76; the model must learn well below.
    assert losses[0] > 10.5
    assert sum(losses[-5:]) / 5 < losses[0] - 3.0
    assert result.val_losses[30] < losses[0] - 3.0


def test_deepseek_tiny_mla_moe_trains():
    result = run(["--model-preset", "deepseek-tiny", "--seq-length", "64", "--micro-batch-size",
                  "2", "--global-batch-size", "4", "--mock-data", "--tokenizer-type",
                  "NullTokenizer", "--vocab-size", "512", "--train-iters", "6", "--lr", "3e-3",
                  "--log-interval", "1", "--eval-interval", "1000", "--num-workers", "0"])
    losses = [result.losses[i] for i in sorted(result.losses)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_resume_matches_uninterrupted_run(tmp_path):
    args = TINY_MOCK_ARGS + ["--train-iters", "20"]
    straight = run(args)
    ckpt = str(tmp_path / "ckpt")
    first = run(args + ["--save", ckpt, "--save-interval", "10", "--exit-interval", "10"])
    assert first.exit_reason == "exit-interval" and first.iteration == 10
    assert checkpointing.read_tracker(ckpt) == 10
    resumed = run(args + ["--load", ckpt])
    assert sorted(resumed.losses) == list(range(11, 21))
    for it in range(11, 21):
        assert resumed.losses[it] == straight.losses[it], it
    for it in range(1, 11):
        assert first.losses[it] == straight.losses[it], it


def test_bf16_distributed_optimizer_resume(tmp_path):
    args = TINY_MOCK_ARGS + ["--train-iters", "6", "--bf16", "--use-distributed-optimizer"]
    straight = run(args)
    ckpt = str(tmp_path / "ckpt")
    run(args + ["--save", ckpt, "--exit-interval", "3"])
    resumed = run(args + ["--load", ckpt])
    assert [resumed.losses[i] for i in (4, 5, 6)] == [straight.losses[i] for i in (4, 5, 6)]


class _SendSigterm(TrainingCallback):
    def on_iteration_end(self, iteration):
        if iteration == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    result = run(TINY_MOCK_ARGS + ["--train-iters", "50", "--save", ckpt],
                 callbacks=[_SendSigterm()])
    assert (result.exit_reason, result.exit_code, result.iteration) == ("signal", 0, 3)
    assert checkpointing.read_tracker(ckpt) == 3


def test_exit_duration(tmp_path):
    result = run(TINY_MOCK_ARGS + ["--train-iters", "50", "--exit-duration-in-mins", "0"])
    assert result.exit_reason == "exit-duration-in-mins" and result.iteration == 1


def test_interrupted_save_never_becomes_latest(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    args = TINY_MOCK_ARGS + ["--train-iters", "4", "--save", ckpt, "--save-interval", "2"]
    real_save = checkpointing.dist_checkpointing.save

    def crash_on_second_save(state, directory, *a, **k):
        if "iter_0000004" in directory:
            real_save(state, directory, *a, **k)  # files written, but the run dies before commit
            raise RuntimeError("killed while saving")
        return real_save(state, directory, *a, **k)

    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", crash_on_second_save)
    with pytest.raises(RuntimeError, match="killed while saving"):
        run(args)
    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", real_save)
    assert checkpointing.read_tracker(ckpt) == 2
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))
    resumed = run(TINY_MOCK_ARGS + ["--train-iters", "4", "--load", ckpt])
    assert sorted(resumed.losses) == [3, 4]


def test_load_with_other_shape_fails_before_training(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run(TINY_MOCK_ARGS + ["--train-iters", "1", "--save", ckpt])
    with pytest.raises(ConfigError, match=r"--hidden-size 128 \(checkpoint\) vs 256"):
        run(TINY_MOCK_ARGS + ["--train-iters", "2", "--load", ckpt, "--hidden-size", "256"])


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    result = run(TINY_MOCK_ARGS + ["--train-iters", "3", "--tensorboard-dir", tb])
    events = EventAccumulator(tb)
    events.Reload()
    scalars = events.Scalars("lm loss")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert [s.value for s in scalars] == pytest.approx([result.losses[i] for i in (1, 2, 3)])
    assert "learning-rate" in events.Tags()["scalars"]


def test_cli_errors_are_one_line(capsys, tmp_path):
    argv = [a for a in TINY_MOCK_ARGS if a != "--mock-data"]
    code = main(pretrain_gpt.forward_step, argv + ["--train-iters", "1", "--data-path",
                                                  str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "missing.bin" in err[0] and err[0].startswith("error:")
    llama = [("Llama3Tokenizer" if a == "NullTokenizer" else a) for a in TINY_MOCK_ARGS]
    code = main(pretrain_gpt.forward_step, llama + [
        "--tokenizer-model", str(tmp_path / "tok.model"), "--train-iters", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tok.model" in err[0]


def test_pretrain_gpt_script_runs(tmp_path):
    env = child_env(OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *TINY_MOCK_ARGS,
         "--train-iters", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("lm loss:") == 2
    assert "exiting at iteration 2: train-iters" in proc.stdout


def test_a_long_validation_reports_its_progress(monkeypatch, capsys):
    from megatron.training import training
    monkeypatch.setattr(training, "EVAL_PROGRESS_SECONDS", 0.0)
    run(TINY_MOCK_ARGS + ["--train-iters", "1", "--eval-iters", "3"])
    out = capsys.readouterr().out
    assert "validation: 1/3 batches (--eval-iters)" in out
    assert "validation: 2/3 batches (--eval-iters)" in out and "3/3 batches" not in out


class _Ends(TrainingCallback):
    """Observes the model's GEMMs from the start of training (and leaves the observer to the
    run to remove); records the exit reasons it is ended with."""

    def __init__(self):
        self.counter = QuantizationCounter()
        self.runtimes = []
        self.ended = []

    def on_train_start(self, model_chunks, iteration):
        self.runtimes = runtimes(model_chunks)
        for runtime in self.runtimes:
            runtime.add_observer(self.counter)

    def on_train_end(self, exit_reason):
        self.ended.append(exit_reason)


class _EndRaises(_Ends):
    def on_train_end(self, exit_reason):
        super().on_train_end(exit_reason)
        raise ValueError("cannot finish either")


class _RaiseAtIteration2(_Ends):
    def on_iteration_start(self, iteration):
        if iteration == 2:
            raise RuntimeError("callback failed at iteration 2")


def test_an_exception_in_the_loop_still_ends_every_callback(capsys):
    """A run that raises inside the training loop ends every started callback with exit
    reason "exception" and leaves no observer on the model's runtime; the run's own exception
    propagates, also when a callback's on_train_end raises too (a warning line instead)."""
    first, failing_end, raising = _Ends(), _EndRaises(), _RaiseAtIteration2()
    with pytest.raises(RuntimeError, match="callback failed at iteration 2"):
        run(TINY_MOCK_ARGS + ["--train-iters", "4", "--quant-scheme", "linear_mxfp8"],
            callbacks=[first, failing_end, raising])
    for cb in (first, failing_end, raising):
        assert cb.ended == ["exception"], type(cb).__name__
        # The observer watched iteration 1 and is gone from the model's runtime now.
        assert len(cb.runtimes) == 1 and sum(cb.counter.quantized.values()) > 0
        assert cb.runtimes[0].observers == []
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if line.startswith("warning:") and "_EndRaises" in line]
    assert len(warnings) == 1 and "cannot finish either" in warnings[0], warnings
