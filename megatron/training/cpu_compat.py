"""Everything megatron-core 0.16.1 needs to run without CUDA or without TransformerEngine.

megatron-core assumes a CUDA device in a few dozen places. On a CPU-only machine (every
development and CI machine of this project) we answer each of them here, and nowhere else:

* `apply_cpu_patches()` is called only when `torch.cuda.is_available()` is False.
* `apply_no_te_patches()` is called whenever TransformerEngine is not importable (CPU, or a GPU
  machine without TE): it fixes megatron-core code paths that misbehave when TE is absent.

Each workaround names the megatron-core behaviour it answers. None of them changes numerics.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_cpu_patched = False
_no_te_patched = False
_device_mode: "CudaToCpuMode | None" = None


def _cpu_device(*_args, **_kwargs) -> torch.device:
    return torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made inside the mode.

    Answers literal `device="cuda"` arguments (pipeline schedules' token counts, optimizer
    scalars, clip_grads' norm buffers, MoE utilities, dist_checkpointing exchanges),
    `Tensor.cuda()` calls (language_module, tensor_parallel.data), and `Tensor.type()` string
    checks such as `param.type() == 'torch.cuda.FloatTensor'` in the Float16 and distributed
    optimizers and in clip_grads, which otherwise reject CPU parameters.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,) and args and _is_cuda_device(args[1] if len(args) > 1 else None):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Stand-in for megatron's CudaRNGStatesTracker that forks the CPU generator.

    Answers `DotProductAttention.forward` always entering `get_cuda_rng_tracker().fork()` (even
    with dropout 0) and `model_parallel_cuda_manual_seed`, which both require CUDA generators.
    """

    def __init__(self, *_args, **_kwargs):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_manual_seed(seed: int, *_args, tp_rank=None, ep_rank=None, etp_rank=None, **_kwargs):
    """CPU version of tensor_parallel.model_parallel_cuda_manual_seed (same seed offsets)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrand

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tracker = CpuRNGStatesTracker()
    tracker.add(mrand._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrand._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrand._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrand._CUDA_RNG_STATE_TRACKER = tracker
    mrand._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def apply_cpu_patches() -> None:
    """Make megatron-core run on a machine without CUDA. Idempotent."""
    global _cpu_patched, _device_mode
    if _cpu_patched:
        return
    # rotary_pos_embedding (`inv_freq.to(torch.cuda.current_device())` on every forward),
    # GlobalMemoryBuffer, param_and_grad_buffer, p2p_communication and the MoE router all
    # place tensors on `torch.cuda.current_device()`.
    torch.cuda.current_device = _cpu_device
    # p2p_communication and parallel_state call torch.cuda.synchronize().
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrand

    # get_cuda_rng_tracker().fork() and model_parallel_cuda_manual_seed need CUDA generators.
    mrand.model_parallel_cuda_manual_seed = _cpu_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = _cpu_manual_seed
    mrand._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrand._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute (CheckpointFunction) saves and restores the CUDA generator's state
    # besides the CPU generator's and the tracker's; without CUDA there is none to keep.
    mrand._get_cuda_rng_state = lambda *_a, **_k: None
    mrand._set_cuda_rng_state = lambda *_a, **_k: None

    # Literal device="cuda" arguments, Tensor.cuda() and Tensor.type() checks (see the class).
    _device_mode = CudaToCpuMode()
    _device_mode.__enter__()
    _cpu_patched = True
    logger.info("CUDA not available: megatron-core CPU compatibility patches applied")


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def apply_no_te_patches() -> None:
    """Fix megatron-core paths that break when TransformerEngine is absent. Idempotent."""
    global _no_te_patched
    if _no_te_patched or transformer_engine_available():
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # multi_latent_attention sets HAVE_TE=True because megatron.core.extensions.transformer_engine
    # exports MagicMock stand-ins without TE; isinstance() against them then raises TypeError.
    multi_latent_attention.HAVE_TE = False
    # moe_utils' `import transformer_engine` fails before `te_general_gemm` is bound, so the
    # router's gating linear raises NameError instead of taking its torch path.
    moe_utils.te_general_gemm = None
    _no_te_patched = True


def apply_compat_patches() -> None:
    """Apply every patch this machine needs (none on a CUDA machine with TE)."""
    if not torch.cuda.is_available():
        apply_cpu_patches()
    apply_no_te_patches()
