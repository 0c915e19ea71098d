"""One owner per `--save` directory: an exclusive `flock` on the directory itself and on
`<save>/.lock`, for the whole run.

The locks are taken before anything is built and kept until the run ends; the kernel releases
them when the holding process dies, however it dies, so a lock left by a dead run is simply
taken by the next one (the file stays; only the flocks count). The holder writes its host,
pid, start time and command into `.lock`, so that a refused run can name it:

    --save DIR is in use by another run (pid P on HOST since T: CMD); ...

The lock that counts is the one on the directory: deleting or replacing `.lock` cannot free
the directory while its holder lives (a run that finds the directory locked names the holder
from `.lock`, or from the kernel's lock table when `.lock` is gone). `RunLock.verify`, called
before every save, finds a `.lock` deleted or replaced (it writes it again) and a directory
deleted and created again (it locks the new one, or stops when another run got there first).
On a file system without directory locks the file lock alone keeps runs apart, as before.

A process forked by the holder (megatron-core's checkpoint writers fork one process per file
they write) shares the locks' open file descriptions, and a flock lasts until the last
descriptor of it is closed: a writer left behind by a holder killed mid-save would keep the
directory locked in the name of a dead run. Every forked child therefore closes its copies of
the held locks' descriptors as it starts (os.register_at_fork), so the lock dies with its
holder.

flock is advisory and per host on file systems without lock support across clients (most
network file systems support it; some FUSE mounts do not): it keeps out every run of this
program on the same host, and on shared file systems with working locks, every run anywhere.
`pid_alive` tells whether a process of this host still runs, for the checks before anything
in a locked directory is deleted (checkpointing.remove_stale_incomplete).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
from datetime import datetime
from typing import Optional

from megatron.training.checkpoint_files import file_kind
from megatron.training.errors import ConfigError

LOCK_FILE = ".lock"
# The most of a lock file read for its holder record (a few hundred bytes are written).
RECORD_BYTES = 1 << 16

# The locks this process holds (their descriptors are closed in forked children).
_held: "set[RunLock]" = set()


class RunLock:
    """A held lock: `release()` (or the process's end) gives it back."""

    def __init__(self, directory: str, fd: int, dir_fd: Optional[int] = None,
                 flag: str = "--save", command: Optional[str] = None):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.flag = flag
        self.command = command
        self._fd: Optional[int] = fd
        self._dir_fd: Optional[int] = dir_fd
        _held.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def locks_directory(self) -> bool:
        """Whether the directory itself is locked (not only `.lock`)."""
        return self._dir_fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fds = [fd for fd in (self._fd, self._dir_fd) if fd is not None]
        self._fd = self._dir_fd = None
        _held.discard(self)
        for fd in fds:
            try:
                # LOCK_UN, not just close: a forked child (data loader, checkpoint writer)
                # that inherited the descriptor would otherwise keep the lock alive.
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def verify(self) -> Optional[str]:
        """Check that this run still holds the directory as it took it, before anything in
        it is deleted or replaced. Returns None when nothing changed, or a sentence saying
        what was repaired (`.lock` deleted or replaced: written again; the directory deleted
        and created again: locked again). Raises ConfigError when another run now holds it
        (possible only where directories cannot be locked)."""
        if self._fd is None:
            raise ConfigError(f"{self.flag} {self.directory}: this run no longer holds its lock")
        repaired = []
        if self._dir_fd is not None and not _same_file(self._dir_fd, self.directory):
            fresh = acquire(self.directory, self.flag, self.command)
            self._replace_with(fresh)
            return (f"{self.directory} was deleted and created again while this run held it; "
                    "locked it again")
        if not _same_file(self._fd, self.path, follow=False):
            fd = _open_lock_file(self.path, self.flag, self.directory)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise ConfigError(
                    f"{self.flag} {self.directory}: its lock file {LOCK_FILE} was replaced and "
                    f"is held by another run ({describe_holder(read_holder(self.path))}); "
                    "two runs are writing into one directory: this run stops saving "
                    "there") from None
            _write_record(fd, self.command)
            old, self._fd = self._fd, fd
            try:
                fcntl.flock(old, fcntl.LOCK_UN)
            finally:
                os.close(old)
            repaired.append(f"its lock file {LOCK_FILE} was deleted or replaced while this run "
                            "held the directory; wrote it again" +
                            (" (the directory itself stayed locked: no other run could start "
                             "on it)" if self._dir_fd is not None else ""))
        return "; ".join(repaired) or None

    def _replace_with(self, fresh: "RunLock") -> None:
        """Take over `fresh`'s descriptors (a lock taken again), giving back the old ones."""
        old = [fd for fd in (self._fd, self._dir_fd) if fd is not None]
        self._fd, self._dir_fd = fresh._fd, fresh._dir_fd
        fresh._fd = fresh._dir_fd = None
        _held.discard(fresh)
        for fd in old:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            except OSError:
                pass

    def _forget_in_child(self) -> None:
        """In a forked child: close this copy of the descriptors without unlocking (LOCK_UN
        would release the parent's lock; a plain close leaves it to the parent)."""
        fds = [fd for fd in (self._fd, self._dir_fd) if fd is not None]
        self._fd = self._dir_fd = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _same_file(fd: int, path: str, follow: bool = True) -> bool:
    """Whether `path` still names the file open as `fd` (not deleted, not replaced)."""
    try:
        here = os.stat(path, follow_symlinks=follow)
        held = os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


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
    where = f"pid {record.get('pid')} on {record.get('host', '?')}"
    if "since" in record:
        where += f" since {str(record['since']).replace('T', ' ')}"
    if record.get("note"):
        where += f" ({record['note']})"
    return f"{where}: {command}"


def read_holder(path: str, attempts: int = 10) -> Optional[dict]:
    """The record in a lock file held by someone else. The holder writes it right after
    taking the lock, so an empty or half-written file is read again for up to a second. Only
    a regular file is read, and only its first 64 KiB (a FIFO or device put there would
    block or never end)."""
    for attempt in range(attempts):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return None                 # gone (deleted while its holder lives), or a link
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return json.loads(os.pread(fd, RECORD_BYTES, 0).decode("utf-8"))
        except (OSError, ValueError):
            if attempt + 1 < attempts:
                time.sleep(0.1)
        finally:
            os.close(fd)
    return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a process of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _lock_table_holder(path: str) -> Optional[dict]:
    """The holder of the flock on `path` from the kernel's lock table (Linux /proc/locks):
    {"pid", "host", "command"}, or None when unknown."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read(1 << 20)
    except OSError:
        return None
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
            try:
                pid = int(parts[4])
            except ValueError:
                continue
            record = {"pid": pid, "host": socket.gethostname()}
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read(1 << 16).split(b"\0")
                record["command"] = shlex.join(a.decode("utf-8", "replace") for a in argv if a)
            except OSError:
                pass
            return record
    return None


def _open_lock_file(path: str, flag: str, directory: str) -> int:
    """The lock file opened for writing (created if missing); ConfigError when it is not a
    regular file of the directory (a link, a FIFO, a directory, a device)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise ConfigError(f"{flag} {directory}: cannot open the lock file {LOCK_FILE} ({what}); "
                          "remove it, or choose a directory you can write to") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"{flag} {directory}: its lock file {LOCK_FILE} is "
                          f"{file_kind(mode)}, not a regular file; remove it")
    return fd


def _write_record(fd: int, command: Optional[str]) -> None:
    try:
        data = (json.dumps(holder_record(command)) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError:
        pass        # the lock is held; only the description of the holder is missing


def _in_use(flag: str, directory: str, record: Optional[dict]) -> ConfigError:
    return ConfigError(
        f"{flag} {directory} is in use by another run ({describe_holder(record)}); two runs "
        f"writing into one directory would overwrite each other's "
        f"{'checkpoints' if flag == '--save' else 'results'}: wait for that run to end or "
        f"choose another {flag} directory")


def _lock_directory(directory: str, flag: str) -> Optional[int]:
    """The directory's descriptor, flocked; None where the file system cannot lock
    directories. ConfigError naming the holder when another run holds it."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(dir_fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None                     # no directory locks here: the file lock decides
        path = os.path.join(directory, LOCK_FILE)
        record = read_holder(path)
        holder = _lock_table_holder(directory)
        if holder is not None and (not isinstance(record, dict)
                                   or record.get("pid") != holder["pid"]):
            # .lock was deleted or replaced: the kernel knows the holder.
            record = dict(holder, note=f"its {LOCK_FILE} was deleted or replaced")
        raise _in_use(flag, directory, record) from None
    return dir_fd


def acquire(directory: str, flag: str = "--save", command: Optional[str] = None) -> RunLock:
    """Take the exclusive lock of `directory` (created if missing) or raise a one-line
    ConfigError naming the run that holds it."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {directory}: cannot create the directory "
                          f"({exc.strerror or exc}); choose a directory you can write to") \
            from None
    dir_fd = _lock_directory(directory, flag)
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = _open_lock_file(path, flag, directory)
    except ConfigError:
        if dir_fd is not None:
            os.close(dir_fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if dir_fd is not None:
            os.close(dir_fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"{flag} {directory}: cannot lock {LOCK_FILE} "
                              f"({exc.strerror or exc}); the file system may not support "
                              "locks: choose another directory") from None
        raise _in_use(flag, directory, read_holder(path)) from None
    _write_record(fd, command)
    return RunLock(directory, fd, dir_fd, flag, command)
