"""Checking a checkpoint directory before any reader opens it: checkpoints are data, not code.

torch's distributed-checkpoint reader unpickles `.metadata` with plain `pickle`, which runs
whatever a tampered file asks for. `verify_checkpoint` first reads that file with an
unpickler that only builds the classes such metadata consists of, then checks that every file
the checkpoint needs is there and as long as the metadata says, and reads `common.pt` with
`weights_only=True` (megatron-core reads it with torch's default, which a
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD environment would turn into plain pickle). Each problem is
one ConfigError line naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
import re

import torch

from megatron.training.errors import ConfigError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
REQUIRED_FILES = ("metadata.json", COMMON_FILE, METADATA_FILE)

# What torch's distributed-checkpoint metadata is made of (torch 2.x): its dataclasses and
# enums, torch.Size, dtypes and the layout helper. Nothing here executes anything on load.
_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        if (module, name) in ALLOWED_GLOBALS or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise ConfigError(f"{self.path}: refusing to unpickle {module}.{name}: checkpoint "
                          "metadata holds no such object; checkpoints from untrusted sources "
                          "cannot be loaded")


def read_metadata(path: str):
    """The Metadata object of a `.metadata` file, built by the restricted unpickler."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except ConfigError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError,
            TypeError, IndexError) as exc:
        raise ConfigError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: "
                          f"{exc}); the checkpoint is damaged") from None


def verify_checkpoint(ckpt_dir: str) -> None:
    """Raise ConfigError (one line) unless `ckpt_dir` is complete and its metadata is data."""
    for name in REQUIRED_FILES:
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is missing: the checkpoint is incomplete or damaged")
    _check_json(os.path.join(ckpt_dir, "metadata.json"))
    metadata = read_metadata(os.path.join(ckpt_dir, METADATA_FILE))
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise ConfigError(f"{os.path.join(ckpt_dir, METADATA_FILE)}: no storage records; the "
                          "checkpoint is damaged")
    needed = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ConfigError(f"{os.path.join(ckpt_dir, METADATA_FILE)}: storage record names "
                              f"{name!r}, not a file of the checkpoint directory")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is missing: the checkpoint is incomplete or damaged")
        actual = os.path.getsize(path)
        if actual < size:
            raise ConfigError(f"{path} has {actual} bytes, the metadata needs at least {size}: "
                              "the file is truncated")
    _check_common_state(os.path.join(ckpt_dir, COMMON_FILE))


def _check_common_state(path: str) -> None:
    """`common.pt` must load as plain data (no code) and be complete."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # Not torch's message: it advises weights_only=False, which would run the file's code.
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"unpickle {found.group(1)}" if found else "load objects other than tensors " \
            "and plain data"
        raise ConfigError(f"{path}: refusing to {what}: a checkpoint's common state holds no "
                          "such object; checkpoints from untrusted sources cannot be "
                          "loaded") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise ConfigError(f"{path}: unreadable ({first_line(exc) or type(exc).__name__}); the "
                          "checkpoint is damaged") from None


def first_line(exc: BaseException) -> str:
    """The first line of exc's message, at most 200 characters ('' when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def _check_json(path: str) -> None:
    try:
        with open(path, "r", encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({type(exc).__name__}: {exc}); the checkpoint "
                          "is damaged") from None
