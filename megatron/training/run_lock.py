"""One owner per `--save` directory: an exclusive `flock` on `<save>/.lock` for the whole run.

The lock is taken before anything is built and kept until the run ends; the kernel releases
it when the holding process dies, however it dies, so a lock left by a dead run is simply
taken by the next one (the file stays; only the flock counts). The holder writes its host,
pid, start time and command into the file, so that a refused run can name it:

    --save DIR is in use by another run (pid P on HOST since T: CMD); ...

A process forked by the holder (megatron-core's checkpoint writers fork one process per file
they write) shares the lock's open file description, and a flock lasts until the last
descriptor of it is closed: a writer left behind by a holder killed mid-save would keep the
directory locked in the name of a dead run. Every forked child therefore closes its copies of
the held locks' descriptors as it starts (os.register_at_fork), so the lock dies with its
holder.

flock is advisory and per host on file systems without lock support across clients (most
network file systems support it; some FUSE mounts do not): it keeps out every run of this
program on the same host, and on shared file systems with working locks, every run anywhere.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from datetime import datetime
from typing import Optional

from megatron.training.errors import ConfigError

LOCK_FILE = ".lock"

# The locks this process holds (their descriptors are closed in forked children).
_held: "set[RunLock]" = set()


class RunLock:
    """A held lock: `release()` (or the process's end) gives it back."""

    def __init__(self, directory: str, fd: int):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: Optional[int] = fd
        _held.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _held.discard(self)
        try:
            # LOCK_UN, not just close: a forked child (data loader, checkpoint writer) that
            # inherited the descriptor would otherwise keep the lock alive.
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        """In a forked child: close this copy of the descriptor without unlocking (LOCK_UN
        would release the parent's lock; a plain close leaves it to the parent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _close_held_locks_in_child() -> None:
    for lock in list(_held):
        lock._forget_in_child()
    _held.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


def holder_record(command: Optional[str] = None) -> dict:
    """What the lock file says about its holder."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command if command is not None else shlex.join(sys.argv),
    }


def describe_holder(record: Optional[dict]) -> str:
    """`pid P on HOST since T: CMD`, from a lock file's record (or what is known of it)."""
    if not isinstance(record, dict) or "pid" not in record:
        return "holder unknown: the lock file names no process yet"
    command = str(record.get("command", "?"))
    if len(command) > 300:
        command = command[:297] + "..."
    since = str(record.get("since", "?")).replace("T", " ")
    return f"pid {record.get('pid')} on {record.get('host', '?')} since {since}: {command}"


def read_holder(path: str, attempts: int = 10) -> Optional[dict]:
    """The record in a lock file held by someone else. The holder writes it right after
    taking the lock, so an empty or half-written file is read again for up to a second."""
    for attempt in range(attempts):
        try:
            with open(path, "r", encoding="utf-8") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            if attempt + 1 < attempts:
                time.sleep(0.1)
    return None


def acquire(directory: str, flag: str = "--save", command: Optional[str] = None) -> RunLock:
    """Take the exclusive lock of `directory` (created if missing) or raise a one-line
    ConfigError naming the run that holds it."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"{flag} {directory}: cannot create the lock file {LOCK_FILE} "
                          f"({exc.strerror or exc}); choose a directory you can write to") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"{flag} {directory}: cannot lock {LOCK_FILE} "
                              f"({exc.strerror or exc}); the file system may not support "
                              "locks: choose another directory") from None
        raise ConfigError(
            f"{flag} {directory} is in use by another run ({describe_holder(read_holder(path))})"
            f"; two runs writing into one directory would overwrite each other's "
            f"{'checkpoints' if flag == '--save' else 'results'}: wait for that run to end or "
            f"choose another {flag} directory") from None
    try:
        data = (json.dumps(holder_record(command)) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError:
        pass        # the lock is held; only the description of the holder is missing
    return RunLock(directory, fd)
