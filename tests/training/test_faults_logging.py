"""Fault injection for the run's scalar writers: a TensorBoard event file or a W&B run that
stops taking writes (a full disk, a lost connection) costs one warning line and that writer's
scalars from then on; training runs to --train-iters and exits 0. A full disk under
--tensorboard-dir is a byte budget (tests/fakedisk.py) or an add_scalar that fails after k
calls (deterministic: the failure surfaces at a known iteration)."""

import errno
import io
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import pretrain_gpt
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS
from fakedisk import FakeDisk

ITERS = 5
ARGS = TINY_MOCK_ARGS + ["--train-iters", str(ITERS)]
PER_ITERATION = 5     # learning-rate, lm loss, grad-norm, throughput, iteration time


def _scalars(directory):
    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def _warnings(out):
    return [line for line in out.splitlines() if line.startswith("warning: writing")]


def test_tensorboard_failing_mid_run_costs_one_warning(tmp_path, monkeypatch, capsys):
    tb = tmp_path / "tb"
    real_add_scalar = SummaryWriter.add_scalar
    calls = {"n": 0}

    def add_scalar(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3 * PER_ITERATION:      # the disk fills during iteration 4
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_add_scalar(self, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    result = pretrain(pretrain_gpt.forward_step, ARGS + ["--tensorboard-dir", str(tb)])
    assert result.exit_code == 0 and result.iteration == ITERS
    assert result.exit_reason == "train-iters" and len(result.losses) == ITERS
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert _warnings(captured.out) == [
        f"warning: writing TensorBoard scalars to {tb} failed at iteration 4 (No space left "
        "on device): training goes on without them"]
    assert calls["n"] == 3 * PER_ITERATION + 1       # the writer is not used again
    # what was written before the failure is intact, and nothing after it
    scalars = _scalars(tb)
    assert sorted(scalars["lm loss"]) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(scalars["lm loss"][step] - result.losses[step]) < 1e-5 * result.losses[step]
    assert sorted(scalars["iteration-time-ms"]) == [1, 2, 3]


def test_tensorboard_on_a_full_disk_costs_one_warning(tmp_path, monkeypatch, capsys):
    """A real write path: the event file lives on a disk with room for its first flush only
    (TensorBoard writes through io.open, so the fake disk is put under it too)."""
    tb = tmp_path / "tb"
    tb.mkdir()
    disk = FakeDisk(str(tb), free=200).install(monkeypatch)
    monkeypatch.setattr(io, "open", disk._open)
    result = pretrain(pretrain_gpt.forward_step, ARGS + ["--tensorboard-dir", str(tb),
                                                         "--eval-interval", "2"])
    monkeypatch.undo()
    assert result.exit_code == 0 and result.iteration == ITERS
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    [line] = _warnings(captured.out)
    assert line.startswith(f"warning: writing TensorBoard scalars to {tb} failed at iteration ")
    assert line.endswith(" (No space left on device): training goes on without them")
    assert disk.free == 0


def test_wandb_failing_mid_run_costs_one_warning(tmp_path, monkeypatch, capsys):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "wandb.py").write_text(
        "import errno, os\n"
        "calls = []\n"
        "class Run:\n"
        "    def log(self, values, step):\n"
        "        if step >= 3:\n"
        "            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "        calls.append(('log', step))\n"
        "    def finish(self): calls.append(('finish',))\n"
        "def init(**kwargs):\n"
        "    return Run()\n")
    monkeypatch.syspath_prepend(str(stub))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    result = pretrain(pretrain_gpt.forward_step, ARGS + ["--wandb-project", "lowp"])
    assert result.exit_code == 0 and result.iteration == ITERS
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert _warnings(captured.out) == [
        "warning: writing W&B scalars to project lowp failed at iteration 3 (No space left on "
        "device): training goes on without them"]
    import wandb
    assert {step for _, *rest in wandb.calls for step in rest} == {1, 2}
    assert wandb.calls[-1] == ("finish",)
