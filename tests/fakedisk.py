"""A small disk for tests: every file written under one directory draws on a byte budget.

Inside the directory, `open` for writing, `os.open` + `os.write`, truncation and removal
behave like a file system that has `free` bytes left: a write that does not fit writes what
fits and then fails with ENOSPC (a short `os.write`, as the kernel does), truncating or
removing a file gives its bytes back, and `shutil.disk_usage` reports what is left. torch's
serializer therefore fails as it does on a real full disk (RuntimeError "unexpected pos").
Files outside the directory are untouched. Usable without root and on any file system.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import threading


def _enospc(path=None):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class FakeDisk:
    def __init__(self, root: str, free: int):
        self.root = os.path.realpath(root)
        self.free = free
        self._lock = threading.Lock()
        self._real = {}

    # -- accounting ------------------------------------------------------------------------

    def inside(self, path) -> bool:
        try:
            path = os.path.realpath(os.fsdecode(os.fspath(path)))   # bytes too (TensorBoard)
        except TypeError:
            return False
        return path == self.root or path.startswith(self.root + os.sep)

    def take(self, wanted: int) -> int:
        """Bytes granted of `wanted` (all, some, or none once the disk is full)."""
        with self._lock:
            granted = max(0, min(wanted, self.free))
            self.free -= granted
            return granted

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.free += max(0, nbytes)

    # -- patched functions -----------------------------------------------------------------

    def install(self, monkeypatch) -> "FakeDisk":
        self._real = {"open": builtins.open, "os.open": os.open, "os.write": os.write,
                      "os.remove": os.remove, "os.ftruncate": os.ftruncate,
                      "disk_usage": shutil.disk_usage}
        monkeypatch.setattr(builtins, "open", self._open)
        monkeypatch.setattr(os, "write", self._os_write)
        monkeypatch.setattr(os, "remove", self._os_remove)
        monkeypatch.setattr(os, "ftruncate", self._os_ftruncate)
        monkeypatch.setattr(shutil, "disk_usage", self._disk_usage)
        return self

    def _fd_inside(self, fd: int) -> bool:
        try:
            return self.inside(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False

    def _open(self, file, mode="r", *args, **kwargs):
        real = self._real["open"](file, mode, *args, **kwargs)
        if isinstance(file, int) or not any(c in mode for c in "wax+") or not self.inside(file):
            return real
        return _BudgetFile(real, self)

    def _os_write(self, fd, data):
        if not self._fd_inside(fd):
            return self._real["os.write"](fd, data)
        granted = self.take(len(data))
        if granted == 0 and len(data):
            raise _enospc()
        return self._real["os.write"](fd, bytes(data[:granted]))

    def _os_remove(self, path, *args, **kwargs):
        size = os.path.getsize(path) if self.inside(path) and os.path.isfile(path) else 0
        self._real["os.remove"](path, *args, **kwargs)
        self.give_back(size)

    def _os_ftruncate(self, fd, length):
        before = os.fstat(fd).st_size if self._fd_inside(fd) else length
        self._real["os.ftruncate"](fd, length)
        self.give_back(before - length)

    def _disk_usage(self, path):
        usage = self._real["disk_usage"](path)
        if not self.inside(path):
            return usage
        return type(usage)(usage.total, usage.total - self.free, self.free)


class _BudgetFile:
    """A file object under the fake disk: growth beyond its size draws on the budget."""

    def __init__(self, real, disk: FakeDisk):
        self._real = real
        self._disk = disk

    def write(self, data):
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        end = self._real.tell() + len(raw)
        size = os.fstat(self._real.fileno()).st_size
        self._real.flush()
        size = max(size, os.fstat(self._real.fileno()).st_size)
        growth = max(0, end - size)
        granted = self._disk.take(growth)
        if granted < growth:
            fits = len(raw) - (growth - granted)
            if fits > 0:
                self._real.write(data[:fits])
            raise _enospc(getattr(self._real, "name", None))
        return self._real.write(data)

    def truncate(self, size=None):
        self._real.flush()
        before = os.fstat(self._real.fileno()).st_size
        result = self._real.truncate(size)
        self._real.flush()
        self._disk.give_back(before - os.fstat(self._real.fileno()).st_size)
        return result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)
