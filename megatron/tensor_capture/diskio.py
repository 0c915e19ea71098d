"""File operations of capture that stay correct when the disk fills up.

- `atomic_write_text`: a small file under a temporary name, renamed into place.
- `append_line`: one manifest line in ONE `write`; a failed or short write is cut back off,
  so a manifest never ends in a partial line.
- `ReservedFile`: a file whose space is claimed when capture starts (the run summary), so
  it can still be written after the disk has filled up.
- `describe_error`: one line for a failed write; a full disk always reads
  "no space left on device (<dir>)", also when torch's serializer hides the ENOSPC behind
  "RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...".
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

from megatron.tensor_capture.format import temporary_name as hidden_temporary

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save may need this much beyond the tensor bytes (zip headers, pickled metadata).
SERIALIZER_SLACK = 1 << 20


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def atomic_write_text(path: str, text: str) -> None:
    """Write a small text file under a temporary name and rename it into place."""
    tmp = hidden_temporary(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def free_bytes(directory: str) -> Optional[int]:
    """Bytes an unprivileged writer can still use in `directory`'s file system (None if
    unknown)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def no_space_message(directory: str) -> str:
    return f"no space left on device ({directory})"


def is_no_space(exc: BaseException, directory: str, needed: int = 0) -> bool:
    """Whether a failed write ran out of disk space.

    An OSError says so by its errno. torch's serializer turns the OSError of a full disk into
    a RuntimeError ("unexpected pos"), so for other exceptions the free space decides: call
    this before the partial file is removed, while it still occupies the disk.
    """
    if isinstance(exc, OSError):
        return exc.errno in NO_SPACE_ERRNOS
    free = free_bytes(directory)
    return free is not None and free < needed + SERIALIZER_SLACK


def describe_error(exc: BaseException, path: Optional[str] = None,
                   directory: Optional[str] = None, no_space: Optional[bool] = None) -> str:
    """One line: what failed, where, and why. `no_space` overrides the errno check."""
    directory = directory or (os.path.dirname(path) if path else None)
    if no_space is None:
        no_space = isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS
    if no_space and directory:
        return no_space_message(directory)
    if isinstance(exc, OSError):
        where = exc.filename or path
        reason = exc.strerror or str(exc)
        return f"cannot write {where}: {reason} (errno {exc.errno})" if where else \
            f"write failed: {reason} (errno {exc.errno})"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {reason}" + (f" while writing {path}" if path else "")


def open_for_append(path: str) -> int:
    """A file descriptor appending to `path` (created if missing)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def append_line(fd: int, data: bytes) -> None:
    """Append `data` (one complete line) with a single write; if the write fails or is
    short, truncate the file back to its previous length and raise OSError."""
    start = os.lseek(fd, 0, os.SEEK_END)      # one writer per file: nobody appends meanwhile
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} bytes")
    except BaseException:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


class ReservedFile:
    """A small file whose disk space is claimed now and which is written (and renamed into
    place) later, even if the disk is full by then.

    The reservation is the hidden file `.name.reserved` filled with `size` spaces; `write`
    overwrites it in place, which needs no new blocks, truncates it to the text and renames
    it. A text longer than the reservation is still written (then it needs free space).
    """

    def __init__(self, path: str, size: int = 64 << 10):
        self.path = path
        self.tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.reserved")
        try:
            with open(self.tmp, "wb") as f:
                f.write(b" " * size)
        except BaseException:
            remove_quietly(self.tmp)
            raise

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        try:
            with open(self.tmp, "r+b") as f:
                f.write(data)
                f.truncate(len(data))
            os.replace(self.tmp, self.path)
        except FileNotFoundError:
            atomic_write_text(self.path, text)

    def discard(self) -> None:
        remove_quietly(self.tmp)
