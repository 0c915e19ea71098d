"""Process start-up: torch.distributed, megatron parallel state, random seeds."""

from __future__ import annotations

import datetime
import os
import random
import socket

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from megatron.training.cpu_compat import apply_compat_patches
from megatron.training.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ranks_fit_gpus() -> None:
    """One rank per GPU: more ranks on this node than visible GPUs would share devices (and
    NCCL refuses two ranks on one GPU with an obscure error): stop with one line instead."""
    local = int(os.getenv("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise ConfigError(f"{local} ranks on this node (torchrun --nproc-per-node) but {gpus} "
                          f"visible GPU(s) (CUDA_VISIBLE_DEVICES="
                          f"{os.getenv('CUDA_VISIBLE_DEVICES', 'unset')}): launch at most "
                          f"{gpus} rank(s) per node")


def initialize_distributed(args) -> None:
    """init_process_group (NCCL with CUDA, gloo without) and megatron's parallel groups.

    Works under torchrun (RANK/WORLD_SIZE/MASTER_* set) and as a plain single process.
    """
    apply_compat_patches()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        check_ranks_fit_gpus()
    backend = args.distributed_backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        local_rank = int(os.getenv("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        init_method = None
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            # A plain single process: a private rendezvous, leaving the environment untouched
            # so that child processes never inherit a port this process still holds.
            if args.world_size != 1:
                raise RuntimeError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT "
                                   "(launch with torchrun)")
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        torch.distributed.init_process_group(
            backend=backend, rank=args.rank, world_size=args.world_size,
            init_method=init_method,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        )


PIPELINE_SEED_STRIDE = 100


def set_random_seeds(seed: int) -> None:
    """Seed python, numpy and torch as Megatron-LM does: pipeline stage p uses seed + 100 p
    (its layers are initialised, and its dropout drawn, from streams of its own); the
    tensor-parallel tracker then adds megatron-core's tensor/expert-parallel offsets."""
    if parallel_state.model_parallel_is_initialized():
        seed += PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down parallel state and the process group (tests run several jobs per process)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
