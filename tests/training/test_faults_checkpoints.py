"""Checkpoint faults: two runs on one --save directory, damage that keeps a file's size,
iter_* entries that resolve outside --load, a full disk while saving, leftovers of dead runs.

Each fault ends in one `error:` line (exit 2 before anything is built, 1 for a failed save)
or, where the run can go on, one `note:`/`warning:` line; never a traceback, never a silent
load of the wrong bytes.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from megatron.training import checkpointing
from megatron.training.checkpoint_files import CHECKSUMS_FILE, file_digest, read_checksums
from megatron.training.cli import main
from megatron.training.run_lock import LOCK_FILE

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env
from fakedisk import FakeDisk

from test_faults import ARGS, MODEL_BUILT, one_error_line


def train(capsys, *argv):
    code = main(pretrain_gpt.forward_step, TINY_MOCK_ARGS + list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def load(root, capsys, *extra):
    return train(capsys, "--train-iters", "3", "--load", root, *extra)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checksummed checkpoints at iterations 1 and 2 (the tracker names 2)."""
    root = tmp_path_factory.mktemp("ckpt")
    code = main(pretrain_gpt.forward_step, ARGS + ["--save", str(root), "--save-interval", "1"])
    assert code == 0
    return str(root)


@pytest.fixture
def checkpoint(saved, tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    return root, os.path.join(root, "iter_0000002")


def spawn(script: str, path, *argv) -> subprocess.Popen:
    """`python path argv...` with `script` written to `path`."""
    with open(path, "w") as f:
        f.write(script)
    env = child_env(
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(path), *argv], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, timeout=240):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the holder exited early:\n{proc.stderr.read()[-3000:]}")
        assert time.time() < deadline, "the holder never got going"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# One run per --save directory
# ---------------------------------------------------------------------------------------------

# A real training run that saves every iteration and waits after iteration 1 (lock held,
# checkpoint 1 written) until the test lets it go on.
PAUSING_RUN = """
import os, sys, time
import pretrain_gpt
from conftest import TINY_MOCK_ARGS
from megatron.training.training import TrainingCallback, pretrain

save, ready, go = sys.argv[1:4]

class Pause(TrainingCallback):
    def on_iteration_end(self, iteration):
        if iteration == 1:
            open(ready, "w").close()
            deadline = time.time() + 300
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.05)

if __name__ == "__main__":
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
        "--train-iters", "3", "--save", save, "--save-interval", "1"], callbacks=[Pause()])
    sys.exit(result.exit_code)
"""


def test_a_second_run_on_the_same_save_dir_is_refused(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    first = spawn(PAUSING_RUN, tmp_path / "pausing_run.py", save, ready, go)
    try:
        wait_for(ready, first)
        code, out, err = train(capsys, "--train-iters", "4", "--save", save,
                               "--save-interval", "2")
        line = one_error_line(err)
        assert code == 2 and MODEL_BUILT not in out
        assert line.startswith(f"error: --save {save} is in use by another run (pid "
                               f"{first.pid} on {socket.gethostname()} since "), line
        assert f"since {time.strftime('%Y-%m-%d')} " in line        # the holder's start
        assert f": {tmp_path}/pausing_run.py {save} " in line        # and its command
        assert "wait for that run to end" in line
    finally:
        open(go, "w").close()
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert stdout.count("saved checkpoint at iteration") == 3
    # The refused run touched nothing: the first run's three checkpoints, checksummed, load.
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]
    assert checkpointing.read_tracker(save) == 3
    for it in (1, 2, 3):
        assert read_checksums(checkpointing.checkpoint_dir(save, it))
    code, out, err = train(capsys, "--train-iters", "4", "--load", save)
    assert code == 0 and "loaded checkpoint" in out and "exiting at iteration 4" in out, err


HOLD_LOCK = """
import sys, time
from megatron.training.run_lock import acquire
lock = acquire(sys.argv[1], command="holder-of-the-lock --save " + sys.argv[1])
open(sys.argv[2], "w").close()
time.sleep(600)
"""


def test_a_lock_left_by_a_dead_run_is_taken(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    holder = spawn(HOLD_LOCK, tmp_path / "hold_lock.py", save, str(tmp_path / "ready"))
    try:
        wait_for(str(tmp_path / "ready"), holder, timeout=60)
        code, out, err = train(capsys, "--train-iters", "1", "--save", save)
        assert code == 2 and f"(pid {holder.pid} on " in one_error_line(err)
        assert f"holder-of-the-lock --save {save})" in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    # The dead holder's record is still in the file; only the flock counted, and it is gone.
    assert json.load(open(os.path.join(save, LOCK_FILE)))["pid"] == holder.pid
    code, out, err = train(capsys, "--train-iters", "1", "--save", save)
    assert code == 0 and "saved checkpoint at iteration 1" in out, err
    assert json.load(open(os.path.join(save, LOCK_FILE)))["pid"] == os.getpid()


# A holder that forks a child which outlives it, as megatron-core's checkpoint writer
# processes (forked during every save) do when the run is killed mid-save.
HOLD_LOCK_AND_FORK = """
import os, sys, time
from megatron.training.run_lock import acquire
lock = acquire(sys.argv[1], command="holder-of-the-lock --save " + sys.argv[1])
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(child))
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(600)
"""


def test_a_lock_dies_with_its_holder_even_when_a_forked_child_lives_on(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    ready = str(tmp_path / "ready")
    holder = spawn(HOLD_LOCK_AND_FORK, tmp_path / "hold_lock_and_fork.py", save, ready)
    try:
        wait_for(ready, holder, timeout=60)
        child = int(open(ready).read())
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)         # (its pipes stay open in the child: no communicate)
        os.kill(child, 0)               # the child lives on
        code, out, err = train(capsys, "--train-iters", "1", "--save", save)
        assert code == 0 and "saved checkpoint at iteration 1" in out, err
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)
        if os.path.exists(ready):
            try:
                os.kill(int(open(ready).read()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        holder.stdout.close()
        holder.stderr.close()


def test_stale_incomplete_directories_are_removed_at_the_next_save(checkpoint, capsys):
    root, _ = checkpoint
    stale = ["iter_0000003.incomplete", "iter_0000003.incomplete.4242-abcdef"]
    for name in stale:
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 1000)
    code, out, err = load(root, capsys, "--save", root)
    assert code == 0, err
    notes = [line for line in out.splitlines() if "incomplete checkpoint" in line]
    assert notes == [f"note: removed 2 incomplete checkpoint directories left in {root} by a "
                     f"run that died while saving: {', '.join(stale)}"]
    assert not [n for n in os.listdir(root) if ".incomplete" in n]
    assert checkpointing.read_tracker(root) == 3


def test_saving_an_iteration_again_replaces_it_whole(checkpoint, capsys):
    """A finished run started again (--load and --save the same, --train-iters reached):
    iteration 2 is saved again; the old directory goes, nothing is left beside the new."""
    root, ckpt = checkpoint
    before = read_checksums(ckpt)
    code, out, err = train(capsys, "--train-iters", "2", "--load", root, "--save", root)
    assert code == 0 and f"saved checkpoint at iteration 2 to {ckpt}" in out, err
    assert sorted(os.listdir(root)) == [LOCK_FILE, "iter_0000001", "iter_0000002",
                                        checkpointing.TRACKER_FILE]
    assert read_checksums(ckpt)["__0_0.distcp"]["size"] == before["__0_0.distcp"]["size"]
    assert checkpointing.checkpoint_to_load(root) == (2, ckpt)


# ---------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------


def test_every_file_is_checksummed(checkpoint):
    _, ckpt = checkpoint
    files = read_checksums(ckpt)
    names = sorted(n for n in os.listdir(ckpt) if n != CHECKSUMS_FILE)
    assert sorted(files) == names and "__0_0.distcp" in names and "common.pt" in names
    for name in names:
        size, digest = file_digest(os.path.join(ckpt, name))
        assert files[name] == {"size": size, "sha256": digest}


@pytest.mark.parametrize("byte", [0x00, 0xFF], ids=["zeroed", "0xff"])
def test_damage_that_keeps_the_size_stops_the_load_with_one_line(checkpoint, capsys, byte):
    root, ckpt = checkpoint
    path = os.path.join(ckpt, "__0_0.distcp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 3)
        f.write(bytes([byte]) * 40960)
    assert os.path.getsize(path) == size
    code, out, err = load(root, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out and "iteration        1/" not in out
    assert line.startswith(f"error: --load {root}: iter_0000002/__0_0.distcp is damaged "
                           "(checksum mismatch); "), line
    assert "--load-fallback-to-previous would load the newest intact earlier" in line


def test_fallback_skips_a_checkpoint_with_a_checksum_mismatch(checkpoint, capsys):
    root, ckpt = checkpoint
    with open(os.path.join(ckpt, "__0_1.distcp"), "r+b") as f:
        f.seek(4096)
        f.write(b"\0" * 40960)
    code, out, err = load(root, capsys, "--load-fallback-to-previous")
    assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: --load")]
    assert len(warnings) == 1 and "iter_0000002/__0_1.distcp is damaged (checksum mismatch)" \
        in warnings[0] and "iteration 1 (--load-fallback-to-previous)" in warnings[0]
    assert f"loaded checkpoint {root}/iter_0000001 (iteration 1)" in out
    assert "iteration        2/       3" in out and "exiting at iteration 3" in out


def test_a_checkpoint_saved_without_checksums_loads_with_a_note(tmp_path, capsys, monkeypatch):
    """As the checkpoints written before checksums existed: no checksums.json, and no mark in
    the common state that there should be one."""
    root = str(tmp_path / "old")
    monkeypatch.setattr(checkpointing, "WRITE_CHECKSUMS", False)
    code, _, err = train(capsys, "--train-iters", "2", "--save", root)
    assert code == 0, err
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(root, "iter_0000002", CHECKSUMS_FILE))
    code, out, err = load(root, capsys)
    assert code == 0 and "exiting at iteration 3" in out, err
    notes = [line for line in (out + err).splitlines() if CHECKSUMS_FILE in line]
    assert notes == [f"note: --load {root}: iter_0000002 has no checksums.json (saved before "
                     "checkpoints were checksummed): its files are checked for completeness "
                     "only, damage that keeps their sizes cannot be found"]


def test_a_removed_or_shortened_checksum_list_is_refused(checkpoint, capsys):
    root, ckpt = checkpoint
    manifest = os.path.join(ckpt, CHECKSUMS_FILE)
    data = json.load(open(manifest))
    del data["files"]["__0_0.distcp"]
    json.dump(data, open(manifest, "w"))
    code, out, err = load(root, capsys)
    assert code == 2 and MODEL_BUILT not in out
    assert "iter_0000002/__0_0.distcp is not in checksums.json" in one_error_line(err)
    os.remove(manifest)
    code, out, err = load(root, capsys)
    assert code == 2 and f"{manifest} is missing" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# iter_* entries outside --load
# ---------------------------------------------------------------------------------------------


def test_a_symlinked_iteration_directory_outside_load_is_refused(saved, tmp_path, capsys):
    root = str(tmp_path / "mine")
    os.makedirs(root)
    shutil.copy(os.path.join(saved, checkpointing.TRACKER_FILE), root)
    os.symlink(os.path.join(saved, "iter_0000002"), os.path.join(root, "iter_0000002"))
    code, out, err = load(root, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert line.startswith(f"error: --load {root}: iter_0000002 resolves to "
                           f"{os.path.realpath(saved)}/iter_0000002, outside --load {root}")


def test_a_symlinked_shard_is_refused(checkpoint, saved, capsys):
    root, ckpt = checkpoint
    os.remove(os.path.join(ckpt, "__0_0.distcp"))
    os.symlink(os.path.join(saved, "iter_0000001", "__0_0.distcp"),
               os.path.join(ckpt, "__0_0.distcp"))
    code, out, err = load(root, capsys)
    assert code == 2 and MODEL_BUILT not in out
    assert f"{ckpt}/__0_0.distcp is a symbolic link" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# A full disk while saving
# ---------------------------------------------------------------------------------------------


def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(tmp_path, capsys,
                                                                 monkeypatch):
    """The disk fills up during the second save (tests/fakedisk.py: 1 MB left, the shard
    writers fail as on a real full disk): the partial directory goes, the first stays."""
    root = str(tmp_path / "ckpt")
    real_save = checkpointing.dist_checkpointing.save

    def save_on_a_full_disk(state, directory, *args, **kwargs):
        if "iter_0000004" in directory:
            FakeDisk(root, free=1_000_000).install(monkeypatch)
        return real_save(state, directory, *args, **kwargs)

    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", save_on_a_full_disk)
    code, out, err = train(capsys, "--train-iters", "4", "--save", root, "--save-interval", "2")
    monkeypatch.undo()
    line = one_error_line(err)
    assert code == 1, err
    assert line.startswith(f"error: saving the checkpoint at iteration 4 to {root} failed: no "
                           "space left on device"), line
    assert line.endswith("; the previous checkpoint (iteration 2) is intact")
    assert sorted(os.listdir(root)) == [LOCK_FILE, "iter_0000002", checkpointing.TRACKER_FILE]
    code, out, err = train(capsys, "--train-iters", "4", "--load", root)
    assert code == 0 and "loaded checkpoint" in out and "exiting at iteration 4" in out, err


def test_an_error_in_any_save_step_removes_its_directory(tmp_path, capsys, monkeypatch):
    """An OSError while hashing (after the shards were written): same one line and cleanup;
    the lock is given back, so the next run on the directory starts."""
    root = str(tmp_path / "ckpt")

    def unreadable(directory, names):
        raise PermissionError(13, "Permission denied", os.path.join(directory, "__0_0.distcp"))

    monkeypatch.setattr(checkpointing, "digest_files", unreadable)
    code, out, err = train(capsys, "--train-iters", "1", "--save", root)
    monkeypatch.undo()
    line = one_error_line(err)
    assert code == 1 and re.fullmatch(
        rf"error: saving the checkpoint at iteration 1 to {re.escape(root)} failed: Permission "
        rf"denied \({re.escape(root)}/iter_0000001\.incomplete\.{os.getpid()}-[0-9a-f]{{6}}"
        r"/__0_0\.distcp\); no earlier checkpoint was saved", line), line
    assert sorted(os.listdir(root)) == [LOCK_FILE]
    code, out, err = train(capsys, "--train-iters", "1", "--save", root)
    assert code == 0 and checkpointing.read_tracker(root) == 1, err


# ---------------------------------------------------------------------------------------------
# The lock cannot be stolen, and a live run's checkpoint is never deleted
# ---------------------------------------------------------------------------------------------


def test_deleting_the_lock_file_does_not_free_the_directory(tmp_path, capsys):
    """Run A holds --save; its .lock is deleted: run C is still refused (the directory itself
    is locked, the holder named from the kernel's lock table), and A's next save writes the
    lock file again and goes on."""
    save = str(tmp_path / "ckpt")
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    first = spawn(PAUSING_RUN, tmp_path / "pausing_run.py", save, ready, go)
    try:
        wait_for(ready, first)
        os.remove(os.path.join(save, LOCK_FILE))
        code, out, err = train(capsys, "--train-iters", "4", "--save", save,
                               "--save-interval", "1")
        line = one_error_line(err)
        assert code == 2 and MODEL_BUILT not in out
        assert line.startswith(f"error: --save {save} is in use by another run (pid "
                               f"{first.pid} on {socket.gethostname()} (its .lock was deleted "
                               "or replaced): "), line
        assert f"pausing_run.py {save} " in line
        assert not os.path.exists(os.path.join(save, LOCK_FILE))     # C created nothing
    finally:
        open(go, "w").close()
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    warnings = [line for line in stdout.splitlines() if line.startswith("warning: --save")]
    assert warnings == [f"warning: --save {save}: its lock file .lock was deleted or replaced "
                        "while this run held the directory; wrote it again (the directory "
                        "itself stayed locked: no other run could start on it)"], stdout[-3000:]
    assert json.load(open(os.path.join(save, LOCK_FILE)))["pid"] == first.pid
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]


def test_an_incomplete_checkpoint_of_a_live_process_is_never_deleted(checkpoint, capsys):
    """Where the lock could be circumvented (a file system without directory locks, another
    host), a directory `iter_X.incomplete.<pid>-<token>` whose writer still runs stays."""
    root, _ = checkpoint
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = f"iter_0000003.incomplete.{writer.pid}-abcdef"
        dead = "iter_0000003.incomplete.999999999-abcdef"
        for name in (live, dead):
            os.makedirs(os.path.join(root, name))
            with open(os.path.join(root, name, "__0_0.distcp"), "wb") as f:
                f.write(b"\0" * 1000)
        code, out, err = load(root, capsys, "--save", root)
        assert code == 0, err
        assert os.path.isfile(os.path.join(root, live, "__0_0.distcp"))
        assert not os.path.exists(os.path.join(root, dead))
        assert f"note: removed 1 incomplete checkpoint directory left in {root} by a run that " \
               f"died while saving: {dead}" in out
        assert f"warning: --save {root}: left {live} in place: the process writing it (pid " \
               f"{writer.pid}) still run(s) on this host" in out
    finally:
        writer.kill()
        writer.wait(timeout=60)


def test_a_directory_deleted_and_created_again_is_locked_again(tmp_path):
    from megatron.training import run_lock
    from megatron.training.errors import ConfigError

    save = str(tmp_path / "ckpt")
    lock = run_lock.acquire(save)
    try:
        shutil.rmtree(save)
        os.makedirs(save)
        assert "deleted and created again" in lock.verify()
        with pytest.raises(ConfigError, match="is in use by another run"):
            run_lock.acquire(save)                       # the new directory is held
        assert lock.verify() is None
    finally:
        lock.release()
    run_lock.acquire(save).release()                     # and free once released


def test_a_fifo_as_the_lock_file_is_one_line(tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    os.mkfifo(save / LOCK_FILE)
    code, out, err = train(capsys, "--train-iters", "1", "--save", str(save))
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --save {save}: its lock file .lock is a FIFO, not a "
                                   "regular file; remove it")
