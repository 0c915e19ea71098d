"""Checking a checkpoint directory before any reader opens it: checkpoints are data, not code.

torch's distributed-checkpoint reader unpickles `.metadata` with plain `pickle`, which runs
whatever a tampered file asks for. `verify_checkpoint` first reads that file with an
unpickler that only builds the classes such metadata consists of, then checks that every file
the checkpoint needs is there and as long as the metadata says, and reads `common.pt` with
`weights_only=True` (megatron-core reads it with torch's default, which a
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD environment would turn into plain pickle). Every file it
names must be a regular file of the directory (no symbolic links). Each problem is one
ConfigError line naming the file.

Damage that keeps a file's size is found by checksums: at save, `digest_files` hashes every
file of the checkpoint (SHA-256 of the bytes on disk, after dist_checkpointing wrote them)
and `write_checksums` records them in `checksums.json` before the directory gets its final
name; `check_files` compares them at --load.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from megatron.training.errors import ConfigError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
REQUIRED_FILES = ("metadata.json", COMMON_FILE, METADATA_FILE)
CHECKSUMS_FILE = "checksums.json"
CHECKSUM_ALGORITHM = "sha256"          # hashlib name; `sha256sum FILE` prints the same digest
CHECKSUMS_FORMAT = "megatron-lowp checkpoint checksums"
# The key of the common state (common.pt) saying that the save wrote checksums.json.
CHECKSUMS_KEY = "checksums_file"
_CHUNK = 8 << 20

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


# The most a checkpoint's small files may hold: what they record is bounded (the tracker a
# number, metadata.json a few keys, common.pt the run's arguments and records, checksums.json
# one line per file, .metadata one record per tensor shard); a larger one is not a checkpoint
# file of this program (a device, a file put in its place) and is not read.
SIZE_LIMITS = {TRACKER_FILE: 64, "metadata.json": 1 << 20, COMMON_FILE: 1 << 26,
               CHECKSUMS_FILE: 1 << 26, METADATA_FILE: 1 << 30}


def file_kind(mode: int) -> str:
    """'a FIFO', 'a directory', ... of an st_mode (what a path that should be a regular file
    is instead)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def file_problem(path: str, limit: Optional[int] = None, follow: bool = True) -> Optional[str]:
    """Why `path` cannot be read as a regular file of at most `limit` bytes: 'is missing',
    'is a FIFO, not a regular file' (a FIFO blocks its reader forever, a device never ends),
    'has N bytes, more than the M ...'; None when it can. Links are followed unless
    `follow` is False (then a link is the problem)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a regular file"
    if limit is not None and st.st_size > limit:
        return f"has {st.st_size:,} bytes, more than the {limit:,} such a file holds"
    return None


def read_small_file(path: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (OSError otherwise), opened so
    that a FIFO swapped in after a check cannot block the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"{path} has more than {limit} bytes")
    return data


def loadable_checkpoint_files(load_dir: str) -> bool:
    """Whether the tracker of `load_dir` and the common.pt of the iteration it names are
    regular files of their sizes, so that reading them cannot block or run away (model_args
    reads them while the flags are parsed; verify_checkpoint names any problem later)."""
    tracker = os.path.join(load_dir, TRACKER_FILE)
    if file_problem(tracker, SIZE_LIMITS[TRACKER_FILE]) is not None:
        return False
    try:
        iteration = int(read_small_file(tracker, SIZE_LIMITS[TRACKER_FILE]).strip())
    except (OSError, ValueError):
        return False
    common = os.path.join(checkpoint_dir(load_dir, iteration), COMMON_FILE)
    return iteration >= 0 and file_problem(common, SIZE_LIMITS[COMMON_FILE]) is None


def checkpoint_dir(root: str, iteration: int) -> str:
    """The directory of iteration `iteration`'s checkpoint in a --save/--load directory."""
    return os.path.join(root, f"iter_{iteration:07d}")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        import torch  # here: the file helpers above serve torch-free start-up paths too

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


@dataclass
class CheckpointFiles:
    """What verify_checkpoint found: the files a load reads, and the common state."""
    needed: List[str] = field(default_factory=list)
    common: dict = field(default_factory=dict)


def _regular_file(ckpt_dir: str, name: str) -> str:
    """The path of `name` in `ckpt_dir`; ConfigError when missing, a symbolic link, not a
    regular file (a FIFO would block the reader) or larger than such a file can be."""
    path = os.path.join(ckpt_dir, name)
    if os.path.islink(path):
        raise ConfigError(f"{path} is a symbolic link (to {os.path.realpath(path)}): a "
                          "checkpoint holds only its own regular files; copy the file in "
                          "instead of linking it")
    problem = file_problem(path, SIZE_LIMITS.get(name), follow=False)
    if problem == "is missing":
        raise ConfigError(f"{path} is missing: the checkpoint is incomplete or damaged")
    if problem is not None:
        raise ConfigError(f"{path} {problem}: the checkpoint is damaged or not this "
                          "program's")
    return path


def verify_checkpoint(ckpt_dir: str) -> CheckpointFiles:
    """Raise ConfigError (one line) unless `ckpt_dir` is complete and its metadata is data.

    Structure only (files present, long enough, metadata safe to read); the checksums are
    `check_files`'s."""
    for name in REQUIRED_FILES:
        _regular_file(ckpt_dir, name)
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
        path = _regular_file(ckpt_dir, name)
        actual = os.path.getsize(path)
        if actual < size:
            raise ConfigError(f"{path} has {actual} bytes, the metadata needs at least {size}: "
                              "the file is truncated")
    common = _check_common_state(os.path.join(ckpt_dir, COMMON_FILE))
    return CheckpointFiles(needed=sorted(set(REQUIRED_FILES) | set(needed)),
                           common=common if isinstance(common, dict) else {})


def load_common_state(ckpt_dir: str) -> dict:
    """The common state (common.pt) of a verified checkpoint, read as plain data."""
    common = _check_common_state(os.path.join(ckpt_dir, COMMON_FILE))
    return common if isinstance(common, dict) else {}


def _check_common_state(path: str):
    """`common.pt` must load as plain data (no code) and be complete; returns it."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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


# ---------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------


def file_chunks(path: str):
    """The bytes of `path` as they are on disk, as views of one reused 8 MiB buffer (each
    view is valid until the next one is produced)."""
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return
            yield view[:n]


def file_digest(path: str) -> Tuple[int, str]:
    """(size, hex digest) of the bytes of `path` as they are on disk."""
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    size = 0
    for chunk in file_chunks(path):
        digest.update(chunk)             # hashlib releases the GIL: threads hash in parallel
        size += len(chunk)
    return size, digest.hexdigest()


def hash_threads(jobs: int) -> int:
    """Threads for hashing `jobs` files: the cores of this host shared by its ranks."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(jobs, 8, (os.cpu_count() or 1) // local_ranks))


def digest_files(directory: str, names: Iterable[str]) -> Dict[str, dict]:
    """{name: {"size": bytes, "sha256": hex}} for files of `directory` (relative names)."""
    names = list(names)
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=hash_threads(len(names))) as pool:
        results = list(pool.map(lambda n: file_digest(os.path.join(directory, n)), names))
    return {name: {"size": size, CHECKSUM_ALGORITHM: hexdigest}
            for name, (size, hexdigest) in zip(names, results)}


def list_files(directory: str) -> List[str]:
    """Relative paths ('/'-separated) of the files under `directory`, without the manifest."""
    found = []
    for base, _dirs, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), directory).replace(os.sep, "/")
            if rel != CHECKSUMS_FILE:
                found.append(rel)
    return sorted(found)


def write_checksums(directory: str, files: Dict[str, dict]) -> None:
    """Write `checksums.json` into `directory` (temporary name, fsync, rename)."""
    path = os.path.join(directory, CHECKSUMS_FILE)
    tmp = path + ".tmp"
    text = json.dumps({"format": CHECKSUMS_FORMAT, "version": 1,
                       "algorithm": CHECKSUM_ALGORITHM,
                       "files": {name: files[name] for name in sorted(files)}}, indent=1)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _safe_name(name) -> bool:
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def read_checksums(ckpt_dir: str) -> Optional[Dict[str, dict]]:
    """The {name: {"size", "sha256"}} of `checksums.json`; None when the file is absent (a
    checkpoint saved before checkpoints were checksummed); ConfigError when unusable."""
    path = os.path.join(ckpt_dir, CHECKSUMS_FILE)
    if not os.path.lexists(path):
        return None
    _regular_file(ckpt_dir, CHECKSUMS_FILE)
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({type(exc).__name__}: {first_line(exc)}); the "
                          "checkpoint is damaged") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("algorithm") != CHECKSUM_ALGORITHM:
        raise ConfigError(f"{path}: not a {CHECKSUM_ALGORITHM} checksum list of this program; "
                          "the checkpoint is damaged")
    for name, entry in files.items():
        if not _safe_name(name):
            raise ConfigError(f"{path}: names {name!r}, not a file of the checkpoint "
                              "directory; the checkpoint is damaged")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get(CHECKSUM_ALGORITHM), str)
                and re.fullmatch(r"[0-9a-f]{64}", entry[CHECKSUM_ALGORITHM])):
            raise ConfigError(f"{path}: the entry of {name!r} is not a size and a "
                              f"{CHECKSUM_ALGORITHM} digest; the checkpoint is damaged")
    return files


def check_files(ckpt_dir: str, files: Dict[str, dict]) -> Optional[Tuple[str, str]]:
    """(name, problem) of the first file (by name) whose bytes are not those recorded in
    `files`, or None when all match."""
    for name in sorted(files):
        path = os.path.join(ckpt_dir, *name.split("/"))
        expected = files[name]
        if os.path.islink(path):
            return name, "is a symbolic link; a checkpoint holds only its own regular files"
        problem = file_problem(path, follow=False)
        if problem == "is missing":
            return name, "is missing (checksums.json lists it)"
        if problem is not None:
            return name, problem
        try:
            size = os.path.getsize(path)
            if size != expected["size"]:
                return name, f"is damaged ({size} bytes, the save wrote {expected['size']})"
            _, hexdigest = file_digest(path)
        except OSError as exc:
            return name, f"is unreadable ({exc.strerror or first_line(exc)})"
        if hexdigest != expected[CHECKSUM_ALGORITHM]:
            return name, "is damaged (checksum mismatch)"
    return None
