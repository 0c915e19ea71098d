"""Checkpoints through megatron.core.dist_checkpointing (torch_dist format).

Layout under --save:
    latest_checkpointed_iteration.txt   the iteration of the newest COMPLETE checkpoint
    iter_0000010/                       one dist_checkpointing directory per saved iteration

A checkpoint is written into `iter_XXXXXXX.incomplete/`, renamed once every rank has finished,
and only then recorded in the tracker file (itself written to a temporary name and renamed).
A run killed at any moment therefore leaves the tracker pointing at a complete checkpoint.
The common state records the model shape, so `--load` of a checkpoint made with another
shape stops before training with the differing flags named.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron.quantization.delayed_scaling import histories_state, load_histories_state

from megatron.training.checkpoint_files import first_line, verify_checkpoint
from megatron.training.errors import ConfigError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1

# Args that determine parameter shapes; a checkpoint only loads into the same values.
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "padded_vocab_size", "normalization", "swiglu", "add_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type", "qk_layernorm",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--load {root}: {TRACKER_FILE} holds {text!r}, not an iteration "
                          "number; fix or delete the file") from None


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER_FILE))


def model_shape(args) -> dict:
    return {name: getattr(args, name, None) for name in MODEL_SHAPE_ARGS}


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _parallel_layout() -> List[int]:
    """[PP, TP, DP] sizes: the ranks whose RNG states a checkpoint holds."""
    return [parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size()]


def _rng_sharded_object(data) -> ShardedObject:
    """One RNG state per (pp, tp, dp) rank: every rank restores exactly its own generators."""
    pp, tp, dp = _parallel_layout()
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank())
    return ShardedObject("rng_state", data, (pp, tp, dp), offset, replica_id=0)


_READ_ERRORS = (CheckpointException, CheckpointingException, pickle.UnpicklingError,
                RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError, TypeError,
                AttributeError)


def _model_sites(model):
    """The GEMM sites of a built model (model.quant_sites, set by build_gpt_model)."""
    return getattr(model, "quant_sites", None) or []


def _uses_delayed_scaling(model) -> bool:
    return any(s.state is not None and s.state.amax is not None for s in _model_sites(model))


def _histories_sharded_object(data) -> ShardedObject:
    """Delayed-scaling amax histories, one object per (pp, tp, dp) rank like the RNG states
    (after the amax reduction the tensor- and data-parallel replicas hold the same values)."""
    pp, tp, dp = _parallel_layout()
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank())
    return ShardedObject("quant_amax_histories", data, (pp, tp, dp), offset, replica_id=0)


def _read_error(exc: BaseException) -> str:
    """What went wrong in a checkpoint read, in a few words and without torch's advice."""
    if isinstance(exc, CheckpointException):       # failures: {rank: (exception, trace)}
        causes = sorted({_read_error(pair[0]) for pair in exc.failures.values()})
        return "; ".join(causes) or "CheckpointException"
    detail = "" if isinstance(exc, pickle.UnpicklingError) else first_line(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _sharded_state_dict(model, optimizer, scheduler, args, iteration, consumed_samples,
                        is_loading=False, load_histories=True):
    model_sd = model.sharded_state_dict()
    state = {
        "model": model_sd,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "model_shape": model_shape(args),
        "parallel_layout": _parallel_layout(),
    }
    if not (is_loading and args.no_load_rng):
        state["rng_state"] = _rng_sharded_object(None if is_loading else _rng_state())
    if _uses_delayed_scaling(model) and load_histories:
        state["has_amax_histories"] = True
        state["amax_histories"] = _histories_sharded_object(
            None if is_loading else histories_state(_model_sites(model)))
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args,
                    consumed_samples: int, log=print) -> str:
    """Save atomically; every rank calls this. Returns the checkpoint directory."""
    final = checkpoint_dir(root, iteration)
    tmp = final + ".incomplete"
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, scheduler, args, iteration, consumed_samples)
    dist_checkpointing.save(state, tmp)
    torch.distributed.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_tracker(root, iteration)
    torch.distributed.barrier()
    log(f"saved checkpoint at iteration {iteration} to {final}")
    return final


def check_model_shape(load_dir: str, ckpt_dir: str, args) -> None:
    """A clear error when the checkpoint's model, or (when its RNG states are to be
    restored) its parallel layout, differs from this run's."""
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    saved_layout, layout = common.get("parallel_layout"), _parallel_layout()
    if not args.no_load_rng and saved_layout is not None and list(saved_layout) != layout:
        sizes = "PP/TP/DP {}/{}/{}"
        raise ConfigError(
            f"--load {load_dir}: checkpoint saved with {sizes.format(*saved_layout)}, this run "
            f"has {sizes.format(*layout)}; its RNG states belong to the saved ranks: "
            "add --no-load-rng to load the weights into this layout")
    saved = common.get("model_shape", {})
    current = model_shape(args)
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)} (checkpoint) vs {current[k]} (this run)"
             for k in MODEL_SHAPE_ARGS if k in saved and saved[k] != current[k]]
    if diffs:
        raise ConfigError(f"--load {load_dir}: checkpoint has another model shape: "
                          + "; ".join(diffs) + "; use the same model flags or another --load")


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter the Adam step count recorded in its param group.

    megatron-core 0.16's DistributedOptimizer with the torch-AdamW fallback (no apex/TE) keeps
    the step in its param groups; loading a dp_reshardable checkpoint restores exp_avg and
    exp_avg_sq but leaves the per-parameter 'step' at the value of the freshly initialised
    state, which changes Adam's bias correction after a resume.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def checkpoint_iterations(root: str) -> List[int]:
    """Iterations of the complete checkpoint directories (`iter_XXXXXXX`) in `root`, sorted."""
    found = []
    for name in os.listdir(root):
        match = re.fullmatch(r"iter_(\d{7,})", name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def _verified(root: str, iteration: int) -> str:
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise ConfigError(f"--load {root}: {TRACKER_FILE} names iteration {iteration} but {ckpt} "
                          "does not exist; fix the tracker file or use another --load")
    verify_checkpoint(ckpt)
    return ckpt


def checkpoint_to_load(root: str, fallback: bool = False,
                       log=print) -> Optional[Tuple[int, str]]:
    """(iteration, directory) of the checkpoint --load will read, verified (complete, metadata
    that is data and not code: checkpoint_files.py); None when `root` holds none yet.

    With `fallback` (--load-fallback-to-previous), a chosen checkpoint that fails
    verification is replaced by the newest intact earlier one, which `log` announces.
    """
    try:
        iteration = read_tracker(root)
        if iteration is None:
            return None
        return iteration, _verified(root, iteration)
    except ConfigError as exc:
        if not fallback:
            raise
        problem = exc
    chosen = read_tracker_quietly(root)
    for earlier in reversed(checkpoint_iterations(root)):
        if chosen is not None and earlier >= chosen:
            continue
        try:
            ckpt = _verified(root, earlier)
        except ConfigError:
            continue
        log(f"warning: --load {root}: the chosen checkpoint is unusable ({problem}); loading "
            f"the previous intact one, iteration {earlier} (--load-fallback-to-previous)")
        return earlier, ckpt
    raise ConfigError(f"{problem}; no intact earlier checkpoint in {root} to fall back to")


def read_tracker_quietly(root: str) -> Optional[int]:
    """The tracker's iteration, or None when it is missing or unreadable."""
    try:
        return read_tracker(root)
    except ConfigError:
        return None


def load_checkpoint(root: str, found: Optional[Tuple[int, str]], model, optimizer, scheduler,
                    args, log=print):
    """Restore model (and optimizer, scheduler, RNG unless disabled) from `found`, what
    checkpoint_to_load(root) returned before the model was built.

    Returns (iteration, consumed_samples); (0, 0) when `root` holds no checkpoint yet.
    """
    if found is None:
        log(f"no checkpoint found in {root} ({TRACKER_FILE} missing): starting from scratch")
        return 0, 0
    iteration, ckpt = found
    check_model_shape(root, ckpt, args)
    use_optim = optimizer is not None and not args.no_load_optim
    if use_optim:
        with torch.no_grad():
            # The torch-AdamW fallback has no state before its first step; the distributed
            # optimizer's sharded_state_dict needs it, so materialise it (the load overwrites it).
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
                if init is not None:
                    init()
    # Delayed-scaling histories are restored when the checkpoint has them in this layout
    # (a checkpoint of another scheme or layout starts them afresh, as a new run does).
    common = dist_checkpointing.load_common_state_dict(ckpt)
    histories = (_uses_delayed_scaling(model) and common.get("has_amax_histories", False)
                 and list(common.get("parallel_layout") or []) == _parallel_layout())
    if _uses_delayed_scaling(model) and not histories:
        log("note: the checkpoint has no delayed-scaling amax histories for this layout: they "
            "start afresh (initial scale 1.0)")
    state = _sharded_state_dict(model, optimizer if use_optim else None, scheduler, args,
                                iteration, 0, is_loading=True, load_histories=histories)
    try:
        loaded = dist_checkpointing.load(state, ckpt)
    except _READ_ERRORS as exc:
        # Shard bytes damaged in place (sizes intact, so the file checks passed), or another
        # program's files. Never torch's text for unpickling errors: it advises
        # weights_only=False, which would run whatever a planted file asks for.
        raise ConfigError(f"--load {root}: {ckpt} could not be read ({_read_error(exc)}); "
                          "a shard is damaged or was not written by this program") from None
    model.load_state_dict(loaded["model"])
    if use_optim:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if not args.no_load_rng:
        _set_rng_state(loaded["rng_state"])
    if histories:
        load_histories_state(_model_sites(model), loaded["amax_histories"], _device_of(model))
    log(f"loaded checkpoint {ckpt} (iteration {iteration})")
    return loaded["iteration"], loaded["consumed_train_samples"]


def _device_of(model) -> torch.device:
    return next(model.parameters()).device
