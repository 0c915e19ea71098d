"""Shared test set-up: repository on sys.path, quiet warnings, small-model argument lists."""

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
# One folder per package under test; the shared helpers (references, fakedisk, interpreted)
# live here. Test modules import each other's helpers by module name, so every folder is on
# the path (module names are unique across folders).
TEST_FOLDERS = [TESTS_DIR] + sorted(
    os.path.join(TESTS_DIR, name) for name in os.listdir(TESTS_DIR)
    if os.path.isdir(os.path.join(TESTS_DIR, name)) and not name.startswith(("_", ".")))
for _path in [REPO_ROOT] + TEST_FOLDERS:
    if _path not in sys.path:
        sys.path.insert(0, _path)

from megatron.training.child_env import with_repository_path  # noqa: E402


def child_env(**extra) -> dict:
    """The environment of a child process (torchrun, a tool, a script): the repository and the
    test folders put in front of the caller's PYTHONPATH, never in its place (megatron.core may
    come from PYTHONPATH, as on many clusters)."""
    return with_repository_path(REPO_ROOT, *TEST_FOLDERS, **extra)

os.environ.setdefault("OMP_NUM_THREADS", "2")

# The CPU suite runs on the CPU even on a GPU node (its multi-rank tests put several ranks on
# one machine, and its exact expectations are CPU ones): it hides the GPUs from itself, before
# anything initialises CUDA. `make gpu-check` sets MEGATRON_LOWP_GPU_TESTS=1 and runs the
# CUDA tests (tests/gpu) on the device.
GPU_TESTS = os.environ.get("MEGATRON_LOWP_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_sessionfinish(session, exitstatus):
    # Megatron-LM convention: "no tests collected" (5) is not a failure of the suite.
    if exitstatus == 5:
        session.exitstatus = 0


# A small Llama-style model on mock data with a small vocabulary: fast on 2 CPU cores.
TINY_MOCK_ARGS = [
    "--model-preset", "llama-tiny", "--num-layers", "2", "--hidden-size", "128",
    "--ffn-hidden-size", "384", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--min-lr", "3e-4",
    "--lr-decay-style", "cosine",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0",
]


@pytest.fixture
def tiny_args():
    return list(TINY_MOCK_ARGS)


@pytest.fixture
def world_size_one(monkeypatch):
    """A world-size-1 gloo group and megatron parallel state, torn down afterwards."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import (
        destroy_distributed, initialize_distributed, set_random_seeds)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1"]), check_paths=False)
    initialize_distributed(args)
    set_random_seeds(args.seed)
    yield args
    destroy_distributed()
