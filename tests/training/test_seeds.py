"""Random seeds as Megatron-LM sets them: pipeline stage p draws from seed + 100 p."""

import random

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron.training.initialize import set_random_seeds


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_each_pipeline_stage_is_seeded_with_its_offset(world_size_one, monkeypatch, stage):
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: stage)
    set_random_seeds(1234)
    expected = 1234 + 100 * stage
    assert torch.initial_seed() == expected
    assert random.random() == random.Random(expected).random()
    assert np.random.rand() == np.random.RandomState(expected).rand()
    # The tensor-parallel tracker (dropout in TP regions, CPU initialisation) is seeded from
    # the offset seed too: megatron-core's tracker seed is seed + 2718 (+ TP rank).
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        drawn = torch.rand(4)
    generator = torch.Generator().manual_seed(expected + 2718)
    assert torch.equal(drawn, torch.rand(4, generator=generator))


def test_more_ranks_than_gpus_is_one_line(monkeypatch, capsys):
    """On a GPU node, 4 ranks for 2 visible GPUs stop before any device is touched."""
    import torch

    from megatron.training.cli import main
    from conftest import TINY_MOCK_ARGS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main(None, TINY_MOCK_ARGS + ["--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: 4 ranks on this node (torchrun --nproc-per-node) but 2 visible "
                   "GPU(s) (CUDA_VISIBLE_DEVICES=0,1): launch at most 2 rank(s) per node")


def test_the_cpu_suite_hides_gpus():
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
