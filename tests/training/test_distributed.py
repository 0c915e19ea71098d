"""Multi-process runs under torchrun on the CPU (gloo): TP, PP, DP, SP and the distributed optimizer."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import pretrain_gpt
from megatron.training.training import pretrain

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env

LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.eE+-]+) \|")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, argv, timeout=600):
    """Run pretrain_gpt.py under torchrun; returns (losses by iteration, stdout)."""
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), os.path.join(REPO_ROOT, "pretrain_gpt.py"), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(proc.stdout)}
    return losses, proc.stdout


# Vocabulary 1000 pads to 1024 for TP=1 and TP=2 alike (128 x TP), so initial weights agree.
ARGS = TINY_MOCK_ARGS + ["--train-iters", "4", "--vocab-size", "1000"]


@pytest.fixture(scope="module")
def reference_losses():
    return pretrain(pretrain_gpt.forward_step, ARGS).losses


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    [],  # data parallel: 2 ranks, same global batch
], ids=["tp2", "tp2-sp", "dp2"])
def test_two_ranks_match_single_process(reference_losses, extra):
    losses, _ = torchrun(2, ARGS + extra)
    assert sorted(losses) == [1, 2, 3, 4]
    for it, loss in losses.items():
        assert loss == pytest.approx(reference_losses[it], rel=2e-5), it


def test_tp2_delayed_fp8_scaling_matches_single_process():
    """Delayed scaling reduces each operand's amax over the tensor-parallel ranks (as TE does),
    so the shards of a weight or gradient share the whole tensor's scale: TP=2 quantizes as one
    process. The losses agree to summation order for the first iterations (without the
    reduction iteration 1 already differs by 4e-5); later, summation-order differences flip
    a few FP8 roundings, which training amplifies (6e-5 at iteration 4)."""
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "2",
           "--fp8-amax-compute-algo", "max"]
    reference = pretrain(pretrain_gpt.forward_step, ARGS + fp8).losses
    losses, out = torchrun(2, ARGS + fp8 + ["--tensor-model-parallel-size", "2"])
    assert "FP8 delayed (amax history 2, max)" in out
    assert sorted(losses) == [1, 2, 3, 4]
    for it, loss in losses.items():
        assert loss == pytest.approx(reference[it], rel=2e-5 if it <= 2 else 1e-3), it


def test_pipeline_parallel_trains():
    losses, out = torchrun(2, ARGS + ["--pipeline-model-parallel-size", "2", "--train-iters", "6"])
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1]
    # Each stage holds one of the two layers (plus embedding / output layer).
    assert out.count("number of parameters on (tensor, pipeline) model parallel rank") == 2


def test_dp2_bf16_distributed_optimizer_resume(tmp_path):
    args = ARGS + ["--bf16", "--use-distributed-optimizer", "--train-iters", "6"]
    ckpt = str(tmp_path / "ckpt")
    straight, _ = torchrun(2, args)
    torchrun(2, args + ["--save", ckpt, "--exit-interval", "3"])
    resumed, out = torchrun(2, args + ["--load", ckpt])
    assert "loaded checkpoint" in out
    assert [resumed[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)]


def _quant_scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    return {(tag, e.step): e.value for tag in ea.Tags()["scalars"] if tag.startswith("quant/")
            for e in ea.Scalars(tag)}


TELEMETRY_ARGS = TINY_MOCK_ARGS + ["--vocab-size", "1000", "--quant-scheme", "FA_linear_mxfp8"]


@pytest.fixture(scope="module")
def one_iteration_checkpoint(tmp_path_factory):
    """Weights after one single-process iteration. Megatron seeds each pipeline stage
    differently (seed + 100 x stage), so a PP run matches one process only from a checkpoint."""
    ckpt = str(tmp_path_factory.mktemp("telemetry") / "ckpt")
    pretrain(pretrain_gpt.forward_step, TELEMETRY_ARGS + ["--train-iters", "1", "--save", ckpt])
    return ckpt


@pytest.mark.parametrize("extra", [[], ["--pipeline-model-parallel-size", "2"]],
                         ids=["dp2", "pp2"])
def test_telemetry_reduced_over_ranks_equals_one_process(tmp_path, one_iteration_checkpoint,
                                                         extra):
    """--quant-stats-interval over two ranks (DP: each rank half the micro-batches; PP: each
    stage its own sites, agreed by gathering the keys) equals the single process's values at
    iteration 2, where both start from the same weights and compute the same micro-batches."""
    args = TELEMETRY_ARGS + ["--train-iters", "2", "--load", one_iteration_checkpoint,
                             "--no-load-optim", "--no-load-rng", "--quant-stats-interval", "1"]
    # One thread, as each torchrun rank has: with two, the CPU kernels sum in another order,
    # which moves a few MX roundings of the score gradients (SQNR 29.83 vs 29.84 dB).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pretrain(pretrain_gpt.forward_step, args + ["--tensorboard-dir", str(tmp_path / "one")])
    finally:
        torch.set_num_threads(threads)
    torchrun(2, args + extra + ["--tensorboard-dir", str(tmp_path / "two")])
    one, two = _quant_scalars(tmp_path / "one"), _quant_scalars(tmp_path / "two")
    sites = {tag.split("/")[1] for tag, _ in one}
    assert {"L1.linear_qkv", "L2.linear_fc2", "L1.core_attention.qk", "L0.output_layer"} <= sites
    assert {step for _, step in one} == {2}
    assert one.keys() == two.keys()
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_load_into_another_layout_needs_no_load_rng(one_iteration_checkpoint):
    """The RNG states of a one-process checkpoint cannot be given to two pipeline stages: one
    line says so and names the flag, before any training."""
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), os.path.join(REPO_ROOT, "pretrain_gpt.py"),
           *TELEMETRY_ARGS, "--train-iters", "2", "--load", one_iteration_checkpoint,
           "--pipeline-model-parallel-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "checkpoint saved with PP/TP/DP 1/1/1, this run has PP/TP/DP 2/1/1" in out
    assert "add --no-load-rng" in out
    # torchrun reports the failed rank with its own traceback; the ranks print none
    assert not re.search(r'File ".*(megatron/|pretrain_gpt.py)', out)
    assert "iteration        1/" not in out
