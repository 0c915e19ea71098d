"""Checkpoints through megatron.core.dist_checkpointing (torch_dist format).

Layout under --save:
    .lock                               held (flock) by the run that owns the directory
    latest_checkpointed_iteration.txt   the iteration of the newest COMPLETE checkpoint
    iter_0000010/                       one dist_checkpointing directory per saved iteration,
                                        with checksums.json (SHA-256 of every file)

One run owns a --save directory: global rank 0 locks the directory and `<save>/.lock`
(run_lock.py) before anything is built and keeps them until the run ends; a second run stops
with one line naming the holder. A checkpoint is written into
`iter_XXXXXXX.incomplete.<pid>-<token>/` (a name of this save alone), its files are hashed into
`checksums.json`, and only then is the directory renamed and recorded in the tracker file
(itself written to a temporary name and renamed). A run killed at any moment therefore leaves
the tracker pointing at a complete, checksummed checkpoint; the `.incomplete*` directories of
dead runs are removed by the next save of the lock holder (after it checked that it still holds
the directory, and never one whose writer still runs), and a save that fails (a full disk, ...)
removes its own before it reports one line (CheckpointSaveError). The common state records the
model shape, so `--load` of a checkpoint made with another shape stops before training with the
differing flags named, the model arguments (model_args.py), which `--load` takes as the
defaults of the model flags, and the run's settings (run_settings: quantization flags, label,
recipe-file hash, precision, seed), which a resume must share or override
(--override-checkpoint-settings; compare_run_settings).
A weights-only checkpoint (an imported one, hf_llama.py) holds no optimizer, scheduler or RNG
state: `--load` starts them afresh and says so.

`--load` verifies the checkpoint before anything is built: structure (checkpoint_files.py),
no `iter_*` entry resolving outside the --load directory, and the checksums (hashing shared
out over the ranks); with --load-fallback-to-previous a damaged chosen checkpoint gives way
to the newest intact earlier one.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import stat
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron.quantization import schedule
from megatron.quantization.delayed_scaling import histories_state, load_histories_state

from megatron.training import run_lock
from megatron.training.checkpoint_files import (
    CHECKSUMS_FILE, CHECKSUMS_KEY, SIZE_LIMITS, TRACKER_FILE, check_files, checkpoint_dir,
    digest_files, file_kind, file_problem, first_line, list_files, load_common_state,
    read_checksums, read_small_file, verify_checkpoint, write_checksums)
from megatron.training.errors import ConfigError, TrainingError
from megatron.training.model_args import (
    HF_CONFIG_KEY, MODEL_ARGS_KEY, MODEL_SHAPE_ARGS, TOKENIZER_VOCAB_KEY, model_args, model_shape)

CHECKPOINT_VERSION = 1
INCOMPLETE = ".incomplete"
# Every directory a save may leave behind when its process dies: the legacy shared name
# `iter_X.incomplete` and the per-save `iter_X.incomplete.<pid>-<token>[-replaced]`.
_INCOMPLETE_RE = re.compile(r"iter_\d{7,}\.incomplete(\..*)?")
# Checksums are written by every save (False only to measure their cost, or to make a
# checkpoint like those saved before checksums existed).
WRITE_CHECKSUMS = True
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointSaveError(TrainingError):
    """A save that failed; its partial directory is gone, the previous checkpoint intact."""


# The common-state key of a checkpoint that holds the model alone (an imported one): no
# optimizer, scheduler, RNG or delayed-scaling state; --load starts those afresh.
WEIGHTS_ONLY_KEY = "weights_only"
# The common-state key of the settings a resume must share with the run that saved: the typed
# quantization settings (as flags), the run's label, the sha256 of its recipe file, its
# precision and --seed (run_settings).
RUN_SETTINGS_KEY = "run_settings"
OVERRIDE_FLAG = "--override-checkpoint-settings"
# The most of a recipe file hashed (recipe files are refused beyond 1 MiB anyway).
_RECIPE_FILE_BYTES = 1 << 24


def read_tracker(root: str) -> Optional[int]:
    """The iteration the tracker names; None without a tracker; ConfigError when it is not a
    small regular file holding an iteration number (a FIFO would block, a device never end,
    and either read as "no checkpoint" would start from scratch in silence)."""
    path = os.path.join(root, TRACKER_FILE)
    problem = file_problem(path, SIZE_LIMITS[TRACKER_FILE])
    if problem == "is missing" and not os.path.islink(path):
        return None
    if problem is not None:
        raise ConfigError(f"--load {root}: {TRACKER_FILE} {problem}; it must hold the "
                          "iteration of the newest checkpoint: fix or delete the file")
    try:
        text = read_small_file(path, SIZE_LIMITS[TRACKER_FILE]).decode("utf-8", "replace")
    except OSError as exc:
        raise ConfigError(f"--load {root}: {TRACKER_FILE} cannot be read ({exc}); fix or "
                          "delete the file") from None
    text = text.strip()
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise ConfigError(f"--load {root}: {TRACKER_FILE} holds {text!r}, not an iteration "
                          "number; fix or delete the file")
    return iteration


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER_FILE))


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
                        is_loading=False, load_histories=True, checksummed=False,
                        weights_only=False):
    model_sd = model.sharded_state_dict()
    state = {
        "model": model_sd,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "model_shape": model_shape(args),
        MODEL_ARGS_KEY: model_args(args),
        TOKENIZER_VOCAB_KEY: getattr(args, "tokenizer_vocab_size", None),
        "parallel_layout": _parallel_layout(),
    }
    if getattr(args, "hf_config", None) is not None:
        state[HF_CONFIG_KEY] = args.hf_config
    if checksummed:
        # A checkpoint that says so cannot lose its checksums.json unnoticed.
        state[CHECKSUMS_KEY] = CHECKSUMS_FILE
    if weights_only:
        state[WEIGHTS_ONLY_KEY] = True
        return state
    settings = run_settings(args)
    if settings is not None:
        state[RUN_SETTINGS_KEY] = settings
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


# ---------------------------------------------------------------------------------------------
# Collectives (all no-ops in a process without torch.distributed)
# ---------------------------------------------------------------------------------------------


def _rank_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * _rank_world()[1]
    torch.distributed.all_gather_object(out, obj)
    return out


def _on_rank_0(fn: Callable):
    """fn() run by global rank 0 alone; every rank returns its result or raises the same
    ConfigError, so that all ranks take the same path through what follows."""
    outcome = None
    if _rank_world()[0] == 0:
        try:
            outcome = ("ok", fn())
        except ConfigError as exc:
            outcome = ("error", str(exc))
        except BaseException as exc:
            _broadcast(("crash", f"{type(exc).__name__}: {first_line(exc)}"))
            raise
    kind, value = _broadcast(outcome)
    if kind == "ok":
        return value
    if kind == "error":
        raise ConfigError(value)
    raise RuntimeError(f"rank 0 failed: {value}")


# ---------------------------------------------------------------------------------------------
# One run per --save directory
# ---------------------------------------------------------------------------------------------

_save_lock: Optional[run_lock.RunLock] = None


def lock_save_dir(root: str) -> None:
    """Take `<root>/.lock` on global rank 0 for the rest of the run (release_save_lock gives
    it back); every rank raises the same one-line ConfigError when another run holds it."""
    def take():
        global _save_lock
        release_save_lock()
        _save_lock = run_lock.acquire(root, "--save")

    _on_rank_0(take)


def release_save_lock() -> None:
    global _save_lock
    if _save_lock is not None:
        lock, _save_lock = _save_lock, None
        lock.release()


def _holds_lock(root: str) -> bool:
    return _save_lock is not None and _save_lock.held and \
        os.path.realpath(_save_lock.directory) == os.path.realpath(root)


def _remove(path: str) -> None:
    """Remove a directory tree, file or link, quietly."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.remove(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _writer_pid(name: str) -> Optional[int]:
    """The pid in an `iter_X.incomplete.<pid>-<token>` name (None for the legacy name)."""
    match = re.search(r"\.incomplete\.(\d+)-", name)
    return int(match.group(1)) if match else None


def remove_stale_incomplete(root: str) -> Tuple[List[str], List[str]]:
    """Remove the `iter_*.incomplete*` directories of dead runs in `root`: (names removed,
    names kept because the process that is writing them still runs on this host). Only for
    the holder of root's lock (checked by RunLock.verify just before): any such directory is
    then a dead run's; the liveness check keeps a live writer's directory even where the lock
    could be circumvented (a file system without directory locks)."""
    removed, kept = [], []
    for name in sorted(os.listdir(root)):
        if _INCOMPLETE_RE.fullmatch(name):
            pid = _writer_pid(name)
            if pid is not None and pid != os.getpid() and run_lock.pid_alive(pid):
                kept.append(name)
                continue
            _remove(os.path.join(root, name))
            removed.append(name)
    return removed, kept


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _exception_chain(exc: BaseException):
    """exc, its causes and contexts, and the per-rank failures of a CheckpointException."""
    seen, todo = set(), [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo += [item.__cause__, item.__context__]
        if isinstance(item, CheckpointException):
            todo += [pair[0] for pair in item.failures.values() if isinstance(pair, tuple)]


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _save_error(exc: BaseException, root: str) -> str:
    """Why a save failed, in one line. A full disk reads "no space left on device" however it
    surfaced (torch's serializer turns ENOSPC into "unexpected pos"): called while the partial
    files still fill the disk."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if any(isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS for e in _exception_chain(exc)):
        return "no space left on device"
    free = _free_bytes(root)
    if free is not None and free < (1 << 20):
        return f"no space left on device ({free:,} bytes free; {_read_error(exc)})"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return _read_error(exc)


def _agree(fn: Callable, root: str):
    """fn() on every rank, then the first failure of any rank, the same on all ranks:
    (None, [results by rank]) or (reason, None)."""
    try:
        mine = (None, fn())
    except (Exception, CheckpointException) as exc:     # torch's derives from BaseException
        mine = (_save_error(exc, root), None)
    everyone = _all_gather(mine)
    failures = [reason for reason, _ in everyone if reason is not None]
    if failures:
        return failures[0], None
    return None, [result for _, result in everyone]


_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _drop_writer_error(record: logging.LogRecord) -> bool:
    """megatron-core logs a failed shard write ("Local process N encountered an error: ...")
    before raising it; the save reports it in its own one line."""
    return not str(record.msg).startswith("Local process")


def _writer_rank(name: str) -> Optional[int]:
    """The global rank whose file `name` is (torch_dist names its shards `__<rank>_<n>`)."""
    match = re.search(r"__(\d+)_\d+\.distcp$", name)
    return int(match.group(1)) if match else None


def _hash_own_files(directory: str, rank: int, world: int) -> Dict[str, dict]:
    """Digests of the shards this rank wrote; rank 0 also takes every other file."""
    def mine(name):
        writer = _writer_rank(name)
        return writer == rank or (rank == 0 and (writer is None or writer >= world))
    return digest_files(directory, [n for n in list_files(directory) if mine(n)])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(root: str, tmp: str, final: str, iteration: int,
            digests: Optional[Dict[str, dict]]) -> None:
    """Rank 0: checksums.json (complete before the directory gets its final name), rename,
    tracker."""
    if digests is not None:
        missing = [n for n in list_files(tmp) if n not in digests]
        digests.update(digest_files(tmp, missing))
        write_checksums(tmp, digests)
    _fsync_dir(tmp)
    aside = None
    if os.path.lexists(final):
        # Saving an iteration again (a resumed run): the old directory moves aside under an
        # .incomplete name (removed below, or by the next save if this process dies now).
        aside = f"{tmp}-replaced"
        os.rename(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    _write_tracker(root, iteration)
    _fsync_dir(root)
    if aside is not None:
        _remove(aside)


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args,
                    consumed_samples: int, log=print, checksums: Optional[bool] = None,
                    weights_only: bool = False) -> str:
    """Save atomically; every rank calls this. Returns the checkpoint directory.

    `weights_only`: the model alone (an imported checkpoint; `optimizer` and `scheduler` are
    then unused), marked so that --load starts the rest afresh.

    Raises CheckpointSaveError (one line, the same on every rank) when the save fails; the
    partial directory is removed first and the tracker still names the previous checkpoint.
    """
    checksums = WRITE_CHECKSUMS if checksums is None else checksums
    rank, world = _rank_world()
    final = checkpoint_dir(root, iteration)
    tmp = _broadcast(f"{final}{INCOMPLETE}.{os.getpid()}-{secrets.token_hex(3)}"
                     if rank == 0 else None)

    def prepare():
        if rank != 0:
            return
        os.makedirs(root, exist_ok=True)
        if _holds_lock(root):
            # Still this run's directory (ConfigError when another run took it)?
            repaired = _save_lock.verify()
            if repaired:
                log(f"warning: --save {root}: {repaired}")
            removed, kept = remove_stale_incomplete(root)
            if removed:
                log(f"note: removed {len(removed)} incomplete checkpoint "
                    f"director{'y' if len(removed) == 1 else 'ies'} left in {root} by a run "
                    f"that died while saving: {', '.join(removed)}")
            if kept:
                pids = sorted({str(_writer_pid(n)) for n in kept})
                log(f"warning: --save {root}: left {', '.join(kept)} in place: the "
                    f"process{'es' if len(pids) > 1 else ''} writing "
                    f"{'them' if len(kept) > 1 else 'it'} (pid {', '.join(pids)}) still "
                    "run(s) on this host; another run is saving into this directory")
        os.makedirs(tmp)

    def write():
        state = _sharded_state_dict(model, None if weights_only else optimizer, scheduler,
                                    args, iteration, consumed_samples, checksummed=checksums,
                                    weights_only=weights_only)
        writer_log = logging.getLogger(_WRITER_LOGGER)
        writer_log.addFilter(_drop_writer_error)
        try:
            dist_checkpointing.save(state, tmp)
        finally:
            writer_log.removeFilter(_drop_writer_error)

    problem, _ = _agree(prepare, root)
    if problem is None:
        problem, _ = _agree(write, root)
    digests = None
    if problem is None and checksums:
        problem, parts = _agree(lambda: _hash_own_files(tmp, rank, world), root)
        if problem is None:
            digests = {name: entry for part in parts for name, entry in part.items()}
    if problem is None:
        problem, _ = _agree(lambda: rank == 0 and _commit(root, tmp, final, iteration, digests),
                            root)
    if problem is not None:
        if rank == 0:
            _remove(tmp)
        previous = _broadcast(read_tracker_quietly(root) if rank == 0 else None)
        kept = (f"the previous checkpoint (iteration {previous}) is intact"
                if previous is not None else "no earlier checkpoint was saved")
        raise CheckpointSaveError(f"saving the checkpoint at iteration {iteration} to {root} "
                                  f"failed: {problem}; {kept}")
    log(f"saved checkpoint at iteration {iteration} to {final}")
    return final


# ---------------------------------------------------------------------------------------------
# The settings a resume shares with the run that saved
# ---------------------------------------------------------------------------------------------


def _plain(value):
    """A flag's value as a checkpoint's common state holds it: plain data that common.pt's
    weights_only reader accepts (tuples and sets as lists, anything else as its text)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [_plain(v) for v in sorted(value, key=str)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _file_sha256(path: Optional[str]) -> Optional[str]:
    """sha256 of a regular file's bytes (None without a path, or when it cannot be read)."""
    if not path:
        return None
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            digest.update(f.read(_RECIPE_FILE_BYTES))
    except OSError:
        return None
    finally:
        os.close(fd)
    return digest.hexdigest()


def run_settings(args) -> Optional[dict]:
    """What a checkpoint records of the run that saved it, for a resume to compare: the typed
    quantization settings as flags (QuantSettings.as_flags), the run's label, the sha256 of
    its --quant-recipe-file, its precision and --seed, and the precision schedule's switches
    as iteration counts. None without a quantization config."""
    quant = getattr(args, "quant_config", None)
    if quant is None:
        return None
    flags = quant.settings.as_flags()
    return {
        "quantization": {dest: _plain(value) for dest, value in flags.items()},
        "schedule": [[after, phase] for after, phase in
                     getattr(args, "quant_schedule_switches", [])],
        "label": quant.label,
        "recipe_file_sha256": _file_sha256(flags.get("quant_recipe_file")),
        "precision": getattr(args, "params_dtype_name", None),
        "seed": getattr(args, "seed", None),
    }


def _setting_dests(obj) -> List[str]:
    """The flag dests of a settings dataclass tree (quantization.config's fields)."""
    dests = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            dests += _setting_dests(value)
        elif f.metadata.get("flag"):
            dests.append(f.metadata["flag"].lstrip("-").replace("-", "_"))
    return dests


def _flag_value(value) -> str:
    """How a message shows a flag's value: `--fp8-format hybrid`, `--quant-weight-cache
    off`, `--fp8-recipe unset`."""
    if value is None:
        shown = "unset"
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    elif isinstance(value, list):
        shown = " ".join(map(str, value)) if value else "none"
    else:
        shown = str(value)
    return shown


def _versus(flag: str, saved, current) -> str:
    return f"{flag} {_flag_value(saved)} (checkpoint) vs {_flag_value(current)} (this run)"


def _uses_delayed(quant) -> bool:
    """Whether any site of the run's quantization scales FP8 operands from amax histories."""
    return any(cfg.delayed(f) for cfg in quant.site_configs() for f in cfg.formats)


def compare_run_settings(root: str, ckpt: str, args, iteration: int) -> List[str]:
    """The lines a resume of `ckpt` prints about its settings; ConfigError (one line naming
    every setting that changes the numerics, checkpoint value vs this run's) unless they are
    this run's or --override-checkpoint-settings is given. Settings that do not change the
    results (kernels, weight cache, attention path) are stated in one note. `iteration` is the
    checkpoint's: the precision schedule must give the iterations up to it the same phases."""
    common = load_common_state(ckpt)
    name = os.path.basename(ckpt)
    if common.get(WEIGHTS_ONLY_KEY):
        return []            # an imported model: its training starts afresh in this run
    current = run_settings(args)
    saved = common.get(RUN_SETTINGS_KEY)
    if current is None:
        return []
    if not isinstance(saved, dict) or not isinstance(saved.get("quantization"), dict):
        return [f"note: --load {root}: {name} records no quantization settings, precision or "
                "seed (saved before checkpoints recorded them): they cannot be compared with "
                f"this run's ({current['label']}, {current['precision']}, --seed "
                f"{current['seed']}); resuming takes this run's"]
    quant = args.quant_config
    neutral = set(_setting_dests(quant.settings.backend))
    defaults = {dest: _plain(value) for dest, value in
                type(quant.settings)().as_flags().items()}
    differ, stated = [], []
    saved_q, current_q = saved["quantization"], current["quantization"]
    for dest in list(current_q) + [d for d in saved_q if d not in current_q]:
        if dest in ("quant_recipe_file", "quant_schedule"):     # compared below
            continue
        # A setting unknown to one side had its default there (added or removed since).
        was = saved_q.get(dest, defaults.get(dest))
        now = current_q.get(dest, defaults.get(dest))
        if _plain(was) == _plain(now):
            continue
        text = _versus("--" + dest.replace("_", "-"), was, now)
        (stated if dest in neutral else differ).append(text)
    was_file, now_file = saved_q.get("quant_recipe_file"), current_q.get("quant_recipe_file")
    was_sha, now_sha = saved.get("recipe_file_sha256"), current["recipe_file_sha256"]
    if was_sha != now_sha or (was_file is None) != (now_file is None):
        short = lambda path, sha: "unset" if path is None else \
            f"{path} (sha256 {sha[:12] if sha else 'unreadable'})"
        differ.append(f"--quant-recipe-file {short(was_file, was_sha)} (checkpoint) vs "
                      f"{short(now_file, now_sha)} (this run)")
    elif was_file != now_file:
        stated.append(f"--quant-recipe-file {was_file} (checkpoint) vs {now_file} (this run; "
                      "the same contents)")
    schedule_note = _compare_schedules(saved, current, iteration, differ)
    if saved.get("precision") != current["precision"]:
        differ.append(f"precision {saved.get('precision')} (checkpoint) vs "
                      f"{current['precision']} (this run; --bf16, --fp16 or neither)")
    if saved.get("seed") != current["seed"]:
        differ.append(_versus("--seed", saved.get("seed"), current["seed"]))
    lines = [schedule_note] if schedule_note else []
    if stated:
        lines.append(f"note: --load {root}: {name} was saved with " + "; ".join(stated) +
                     "; these settings do not change the results (bit for bit the same)")
    if not differ:
        return lines
    dropped = common.get("has_amax_histories") and not _uses_delayed(quant)
    labels = (f" ({saved.get('label')} (checkpoint) vs {current['label']} (this run))"
              if saved.get("label") != current["label"] else "")
    if not getattr(args, "override_checkpoint_settings", False):
        raise ConfigError(
            f"--load {root}: {name} was saved with other settings than this run's{labels}: "
            + "; ".join(differ) + "; resuming would change how it trains without a word"
            + (" and drop its delayed-scaling amax histories" if dropped else "")
            + ": pass the checkpoint's settings, or add " + OVERRIDE_FLAG + " to continue "
            "with this run's")
    lines.append(
        f"warning: --load {root}: continuing {name} with this run's settings, not the "
        f"checkpoint's ({OVERRIDE_FLAG}){labels}: " + "; ".join(differ)
        + ("; its delayed-scaling amax histories are not used (this run has no delayed "
           "scaling)" if dropped else ""))
    return lines


def _compare_schedules(saved: dict, current: dict, trained: int,
                       differ: List[str]) -> Optional[str]:
    """A resume must have run its `trained` iterations in the phases this run's schedule gives
    them (a difference in the checkpoint's past changes the numerics: added to `differ`); a
    schedule that differs only later is this run's to choose: the note saying so."""
    was = [schedule.Switch(*s) for s in saved.get("schedule") or []]
    now = [schedule.Switch(*s) for s in current["schedule"]]
    if was == now:
        return None
    shown = lambda switches: " ".join(f"{p}@{a}" for a, p in switches) or "none"  # noqa: E731
    if schedule.history(was, trained) != schedule.history(now, trained):
        differ.append(f"--quant-schedule {shown(was)} (checkpoint) vs {shown(now)} (this run; "
                      f"the phases of iterations 1-{trained} differ)")
        return None
    return (f"note: the checkpoint's precision schedule ({shown(was)}, as iteration counts) "
            f"agrees with this run's ({shown(now)}) on the {trained} iterations trained; this "
            "run's is followed from here")


def check_run_settings(root: str, found: Optional[Tuple[int, str]], args, log=print) -> None:
    """compare_run_settings for the checkpoint checkpoint_to_load found (nothing when there
    is none), on rank 0: every rank raises the same ConfigError; rank 0's lines are logged."""
    if found is None:
        return
    lines = _on_rank_0(lambda: compare_run_settings(root, found[1], args, found[0]))
    for line in lines:
        log(line)


def check_model_shape(load_dir: str, ckpt_dir: str, args) -> None:
    """A clear error when the checkpoint's model, or (when its RNG states are to be
    restored) its parallel layout, differs from this run's."""
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    saved_layout, layout = common.get("parallel_layout"), _parallel_layout()
    if not args.no_load_rng and not common.get(WEIGHTS_ONLY_KEY) and saved_layout is not None \
            and list(saved_layout) != layout:
        sizes = "PP/TP/DP {}/{}/{}"
        raise ConfigError(
            f"--load {load_dir}: checkpoint saved with {sizes.format(*saved_layout)}, this run "
            f"has {sizes.format(*layout)}; its RNG states belong to the saved ranks: "
            "add --no-load-rng to load the weights into this layout")
    saved_vocab = common.get(TOKENIZER_VOCAB_KEY)
    vocab = getattr(args, "tokenizer_vocab_size", None)
    if saved_vocab is not None and vocab is not None and saved_vocab != vocab:
        raise ConfigError(
            f"--load {load_dir}: checkpoint made for a tokenizer of {saved_vocab} entries, "
            f"--tokenizer-type {args.tokenizer_type} has {vocab}; pass the checkpoint's "
            "tokenizer (--tokenizer-type, --tokenizer-model, --vocab-size)")
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


def _inside(root: str, path: str) -> bool:
    real_root = os.path.realpath(root)
    return os.path.realpath(path).startswith(real_root + os.sep)


def _checked_structure(root: str, iteration: int):
    """Rank 0: (directory, checksums or None) of a structurally intact checkpoint."""
    ckpt = checkpoint_dir(root, iteration)
    name = os.path.basename(ckpt)
    if os.path.lexists(ckpt) and not _inside(root, ckpt):
        raise ConfigError(f"--load {root}: {name} resolves to {os.path.realpath(ckpt)}, outside "
                          f"--load {root} (a symbolic link); a checkpoint is read only from "
                          "inside the --load directory: copy it in instead of linking it")
    if not os.path.isdir(ckpt):
        what = (f"is {file_kind(os.lstat(ckpt).st_mode)}, not a checkpoint directory"
                if os.path.lexists(ckpt) else "does not exist")
        raise ConfigError(f"--load {root}: {TRACKER_FILE} names iteration {iteration} but {ckpt} "
                          f"{what}; fix the tracker file or use another --load")
    found = verify_checkpoint(ckpt)
    files = read_checksums(ckpt)
    if files is None and found.common.get(CHECKSUMS_KEY):
        raise ConfigError(f"{os.path.join(ckpt, CHECKSUMS_FILE)} is missing: the checkpoint was "
                          "saved with checksums; it is incomplete or damaged")
    if files is not None:
        unlisted = [n for n in found.needed if n not in files]
        if unlisted:
            raise ConfigError(f"--load {root}: {name}/{unlisted[0]} is not in {CHECKSUMS_FILE}: "
                              "the checkpoint was changed after it was saved")
    return ckpt, files


def _share(files: Dict[str, dict], world: int) -> List[Dict[str, dict]]:
    """The files split over `world` ranks by size (largest first, to the least loaded)."""
    shares = [{} for _ in range(world)]
    loads = [0] * world
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        least = loads.index(min(loads))
        shares[least][name] = files[name]
        loads[least] += files[name]["size"]
    return shares


def _verify_checksums(root: str, ckpt: str, files: Dict[str, dict]) -> None:
    """Every rank hashes its share of the files; the same one-line ConfigError on every rank
    for the first damaged file (by name)."""
    rank, world = _rank_world()
    try:
        mine = check_files(ckpt, _share(files, world)[rank])
    except (Exception, CheckpointException) as exc:
        mine = (sorted(files)[0], f"could not be checked ({_read_error(exc)})")
    problems = sorted(p for p in _all_gather(mine) if p is not None)
    if problems:
        name, problem = problems[0]
        label = os.path.basename(ckpt)
        raise ConfigError(
            f"--load {root}: {label}/{name} {problem}; its bytes differ from what the save "
            f"wrote, so {label} could not be read")


def _verified(root: str, iteration: int) -> Tuple[str, bool]:
    """(directory, checksummed) of an intact checkpoint; ConfigError (the same on every
    rank) otherwise. Rank 0 checks the structure, all ranks share the hashing."""
    ckpt, files = _on_rank_0(lambda: _checked_structure(root, iteration))
    if files is not None:
        _verify_checksums(root, ckpt, files)
    return ckpt, files is not None


def _unverified_note(root: str, ckpt: str) -> str:
    return (f"note: --load {root}: {os.path.basename(ckpt)} has no {CHECKSUMS_FILE} (saved "
            "before checkpoints were checksummed): its files are checked for completeness "
            "only, damage that keeps their sizes cannot be found")


def checkpoint_to_load(root: str, fallback: bool = False,
                       log=print) -> Optional[Tuple[int, str]]:
    """(iteration, directory) of the checkpoint --load will read, verified (complete,
    metadata that is data and not code: checkpoint_files.py; inside `root`; checksums);
    None when `root` holds none yet. Every rank calls this and gets the same answer.

    With `fallback` (--load-fallback-to-previous), a chosen checkpoint that fails
    verification is replaced by the newest intact earlier one, which `log` announces.
    """
    iteration = None
    try:
        iteration = _on_rank_0(lambda: read_tracker(root))
        if iteration is None:
            return None
        ckpt, checksummed = _verified(root, iteration)
        if not checksummed:
            log(_unverified_note(root, ckpt))
        return iteration, ckpt
    except ConfigError as exc:
        if not fallback:
            earlier = iteration is not None and any(
                i < iteration for i in _on_rank_0(lambda: checkpoint_iterations(root)))
            if earlier:
                raise ConfigError(f"{exc}; --load-fallback-to-previous would load the newest "
                                  "intact earlier checkpoint instead") from None
            raise
        problem = exc
    chosen = _on_rank_0(lambda: read_tracker_quietly(root))
    for earlier in reversed(_on_rank_0(lambda: checkpoint_iterations(root))):
        if chosen is not None and earlier >= chosen:
            continue
        try:
            ckpt, checksummed = _verified(root, earlier)
        except ConfigError:
            continue
        log(f"warning: --load {root}: the chosen checkpoint is unusable ({problem}); loading "
            f"the previous intact one, iteration {earlier} (--load-fallback-to-previous)")
        if not checksummed:
            log(_unverified_note(root, ckpt))
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
    common = dist_checkpointing.load_common_state_dict(ckpt)
    if common.get(HF_CONFIG_KEY) is not None:
        args.hf_config = common[HF_CONFIG_KEY]      # kept by this run's saves
    weights_only = bool(common.get(WEIGHTS_ONLY_KEY))
    if weights_only and optimizer is not None:
        log(f"note: --load {root}: {os.path.basename(ckpt)} holds the model weights only (no "
            "optimizer, scheduler or RNG state): the optimizer and learning-rate schedule "
            f"start afresh, the RNG from --seed {args.seed}")
    use_optim = optimizer is not None and not args.no_load_optim and not weights_only
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
    histories = (_uses_delayed_scaling(model) and common.get("has_amax_histories", False)
                 and list(common.get("parallel_layout") or []) == _parallel_layout())
    if _uses_delayed_scaling(model) and not histories:
        log("note: the checkpoint has no delayed-scaling amax histories for this layout: they "
            "start afresh (initial scale 1.0)")
    state = _sharded_state_dict(model, optimizer if use_optim else None, scheduler, args,
                                iteration, 0, is_loading=True, load_histories=histories,
                                weights_only=weights_only)
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
        fresh_groups = _group_values(optimizer)         # what this run's flags set
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer)
        _load_schedule(root, optimizer, scheduler, loaded["opt_param_scheduler"], args, log,
                       fresh_groups)
    if not args.no_load_rng and not weights_only:
        _set_rng_state(loaded["rng_state"])
    if histories:
        load_histories_state(_model_sites(model), loaded["amax_histories"], _device_of(model))
    log(f"loaded checkpoint {ckpt} (iteration {iteration})")
    return loaded["iteration"], loaded["consumed_train_samples"]


# What a checkpoint's optimizer and scheduler state carry of the run's flags, restored by a
# resume in place of the flags: (where, key, flag, counted in samples). megatron-core's
# scheduler keeps the checkpoint's warm-up, decay and weight decay (use_checkpoint_opt_param_
# scheduler), and torch's optimizer.load_state_dict restores every param group's max_lr,
# min_lr, betas and eps.
_RESTORED = (("group", "max_lr", "--lr", False), ("group", "min_lr", "--min-lr", False),
             ("group", "betas.0", "--adam-beta1", False),
             ("group", "betas.1", "--adam-beta2", False), ("group", "eps", "--adam-eps", False),
             ("scheduler", "lr_warmup_steps", "--lr-warmup-iters", True),
             ("scheduler", "lr_decay_steps", "--lr-decay-iters", True),
             ("scheduler", "lr_decay_style", "--lr-decay-style", False),
             ("scheduler", "start_wd", "--weight-decay", False))
_GROUP_KEYS = ("max_lr", "min_lr", "betas", "eps")


def _group_values(optimizer) -> List[dict]:
    """The hyperparameters of each param group that a checkpoint's optimizer state replaces."""
    return [{key: group[key] for key in _GROUP_KEYS if key in group}
            for group in optimizer.param_groups]


def _value(values: dict, key: str):
    name, _, index = key.partition(".")
    value = values.get(name)
    if index and isinstance(value, (list, tuple)):
        return value[int(index)] if int(index) < len(value) else None
    return value


def _load_schedule(root: str, optimizer, scheduler, state: dict, args, log,
                   fresh_groups: List[dict]) -> None:
    """Restore the learning-rate schedule, saying so when what the checkpoint restores differs
    from the run's flags (a resume with another --lr, warm-up, decay, weight decay or Adam
    setting trained on the old ones without a word); --override-checkpoint-settings applies
    the run's own (its param-group values, and megatron-core's override_opt_param_scheduler)."""
    override = bool(getattr(args, "override_checkpoint_settings", False))
    restored_groups = _group_values(optimizer)
    fresh_schedule = {key: getattr(scheduler, key, None) for where, key, _, _ in _RESTORED
                      if where == "scheduler"}
    if override:
        for group, fresh in zip(optimizer.param_groups, fresh_groups):
            group.update(fresh)
        scheduler.override_opt_param_scheduler = True
        scheduler.use_checkpoint_opt_param_scheduler = False
    scheduler.load_state_dict(state)
    gbs = max(1, int(getattr(args, "global_batch_size", 1) or 1))

    def shown(value, in_samples):
        if in_samples and isinstance(value, (int, float)) and value % gbs == 0:
            return str(int(value) // gbs)
        return f"{value:g}" if isinstance(value, float) else str(value)

    changes, seen = [], set()
    for where, key, flag, samples in _RESTORED:
        if where == "scheduler":
            pairs = [(state.get(key), fresh_schedule[key])]
        else:
            pairs = [(_value(saved, key), _value(fresh, key))
                     for saved, fresh in zip(restored_groups, fresh_groups)]
        for saved, fresh in pairs:
            if saved is not None and fresh is not None and saved != fresh and flag not in seen:
                seen.add(flag)
                changes.append(f"{flag} {shown(saved, samples)} (checkpoint) vs "
                               f"{shown(fresh, samples)} (this run)")
    if not changes:
        return
    if override:
        log(f"warning: --load {root}: this run's optimizer settings and learning-rate schedule "
            f"replace the checkpoint's ({OVERRIDE_FLAG}): " + "; ".join(changes))
        return
    hint = " (--lr-decay-iters defaults to --train-iters)" \
        if "--lr-decay-iters" in seen else ""
    log(f"warning: --load {root}: the optimizer settings and learning-rate schedule continue as "
        "the checkpoint's, not as this run's flags say: " + "; ".join(changes) + f"{hint}; "
        f"{OVERRIDE_FLAG} applies this run's")


def _device_of(model) -> torch.device:
    return next(model.parameters()).device
