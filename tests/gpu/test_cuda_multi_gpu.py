"""Two GPUs (`make gpu-check` on a node with two or more; skipped elsewhere): pretrain_gpt.py
under torchrun with NCCL against a one-GPU run -- tensor parallelism with sequence
parallelism, pipeline parallelism, data parallelism with the distributed optimizer, and MoE
expert parallelism with either token dispatcher.

Every run resumes the same one-GPU checkpoint (weights only: --no-load-optim --no-load-rng),
because megatron initialises pipeline stages and expert-parallel ranks from streams of their
own; the losses of the iterations after it are compared. fp32 with TF32 off, so that the runs
differ only in the order fp32 sums are taken.
"""

import pytest
import torch

from conftest import GPU_TESTS, TINY_MOCK_ARGS
from test_distributed import torchrun

pytestmark = pytest.mark.skipif(not GPU_TESTS or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices (make gpu-check)")

# Vocabulary 1000 pads to 1024 for TP=1 and TP=2 alike, so one checkpoint fits both.
DENSE = TINY_MOCK_ARGS + ["--vocab-size", "1000"]
MOE = DENSE + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]
ITERATIONS = 4
# Layouts change only the order of fp32 sums (partial GEMMs reduced across ranks, gradients
# reduce-scattered, micro-batches on other ranks). On the CPU the same changes move these
# losses by at most 1.5e-7 relative (TP=2 against one process); 1e-5 leaves room for the
# GPU's kernels and stays far below what any wrong shard, missed reduction or misrouted token
# changes (percent level).
RTOL = 1e-5


def _without_tf32(env: pytest.MonkeyPatch) -> None:
    """For the torchrun launched after (it inherits the environment): cuBLAS without TF32,
    with its deterministic workspace setting."""
    env.setenv("NVIDIA_TF32_OVERRIDE", "0")
    env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def fp32_without_tf32(monkeypatch):
    _without_tf32(monkeypatch)


def resumed_losses(nproc: int, argv, checkpoint: str, layout=()) -> dict:
    """Losses of iterations 2..ITERATIONS of a run resuming `checkpoint` (saved at 1)."""
    losses, _ = torchrun(nproc, argv + ["--train-iters", str(ITERATIONS), "--load", checkpoint,
                                        "--no-load-optim", "--no-load-rng", *layout])
    assert sorted(losses) == list(range(2, ITERATIONS + 1)), losses
    return losses


def _one_gpu_start(tmp_path_factory, argv, name: str):
    """(checkpoint after one one-GPU iteration, the one-GPU losses resuming it)."""
    with pytest.MonkeyPatch.context() as env:      # module scope: no monkeypatch fixture
        _without_tf32(env)
        checkpoint = str(tmp_path_factory.mktemp(name) / "ckpt")
        torchrun(1, argv + ["--train-iters", "1", "--save", checkpoint])
        return checkpoint, resumed_losses(1, argv, checkpoint)


@pytest.fixture(scope="module")
def dense_start(tmp_path_factory):
    return _one_gpu_start(tmp_path_factory, DENSE, "dense")


@pytest.fixture(scope="module")
def moe_start(tmp_path_factory):
    return _one_gpu_start(tmp_path_factory, MOE, "moe")


def assert_losses_match(losses: dict, reference: dict) -> None:
    assert losses.keys() == reference.keys()
    for it, loss in reference.items():
        assert losses[it] == pytest.approx(loss, rel=RTOL), (it, losses, reference)


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2"],
    ["--use-distributed-optimizer"],                   # data parallel over the two GPUs
], ids=["tp2-sp", "pp2", "dp2-distributed-optimizer"])
def test_two_gpus_train_as_one(dense_start, layout):
    checkpoint, reference = dense_start
    assert_losses_match(resumed_losses(2, DENSE, checkpoint, layout), reference)


def test_expert_parallel_dispatchers_train_as_one_gpu(moe_start):
    """EP=2 (each GPU holds two of the four experts, data parallel for the rest) with the
    all-to-all and the all-gather dispatcher: both route every token to the same experts, so
    both give the one-GPU losses, and each other's."""
    checkpoint, reference = moe_start
    runs = {dispatcher: resumed_losses(2, MOE, checkpoint, [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", dispatcher])
        for dispatcher in ("alltoall", "allgather")}
    assert_losses_match(runs["alltoall"], runs["allgather"])
    assert_losses_match(runs["alltoall"], reference)
    assert_losses_match(runs["allgather"], reference)
