"""Files that are not regular files where the training reads one: a FIFO blocks its reader
forever, a device (/dev/zero) never ends, a huge file would be read whole.

Every file pretrain_gpt.py reads is checked first: the data (.bin, .idx, the sidecar, the
corpus's sources.json), the checkpoint (tracker, common.pt, checksums.json, .metadata, the
shards), the --save lock file, --tensor-save-config and --tokenizer-model. Where the run needs
the file it stops with one `error:` line naming it and what it is; where the file is optional
(a sidecar, sources.json) the run says it ignores it, or goes on without it. The cases that
used to hang run in a child process with a timeout.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pretrain_gpt
from megatron.training.checkpoint_files import TRACKER_FILE
from megatron.training.cli import main

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env
from test_faults import ARGS, MODEL_BUILT, one_error_line
from test_faults_data import build_dataset

HANG_SECONDS = 240      # a child that blocks on a FIFO is killed after this


def _base(argv):
    """TINY_MOCK_ARGS, without --mock-data when `argv` gives a --data-path."""
    return [a for a in TINY_MOCK_ARGS if a != "--mock-data" or "--data-path" not in argv]


def child(*argv, timeout=HANG_SECONDS):
    """pretrain_gpt.py in a child process: (exit code, stdout, stderr); a hang fails the test
    with the child killed, not the suite."""
    try:
        proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"),
                               *_base(argv), *argv], capture_output=True, text=True,
                              cwd=REPO_ROOT, env=child_env(OMP_NUM_THREADS="1"),
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pretrain_gpt.py {' '.join(argv)} blocked for {timeout} s")
    return proc.returncode, proc.stdout, proc.stderr


def train(capsys, *argv):
    code = main(pretrain_gpt.forward_step, _base(argv) + list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    assert main(pretrain_gpt.forward_step, ARGS + ["--save", str(root)]) == 0
    return str(root)


@pytest.fixture
def checkpoint(saved, tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    return root, os.path.join(root, "iter_0000002")


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 511, size=int(rng.integers(20, 200))) for _ in range(300)]
    return build_dataset(str(tmp_path / "corpus_text_document"), docs)


def data_args(prefix):
    return ["--data-path", prefix, "--split", "98,2,0", "--train-iters", "1"]


def replace_with_fifo(path):
    os.remove(path)
    os.mkfifo(path)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def test_a_fifo_as_the_tracker_is_one_line(checkpoint):
    """The tracker was read while the flags were parsed (the model arguments it records):
    a FIFO blocked there forever."""
    root, _ = checkpoint
    replace_with_fifo(os.path.join(root, TRACKER_FILE))
    code, out, err = child("--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --load {root}: {TRACKER_FILE} is a FIFO, not a "
                                   "regular file; it must hold the iteration of the newest "
                                   "checkpoint: fix or delete the file")


def test_a_device_as_the_tracker_is_one_line(checkpoint, capsys):
    """/dev/zero as the tracker was read without end (or, as a non-file, taken for "no
    checkpoint": a silent start from scratch)."""
    root, _ = checkpoint
    os.remove(os.path.join(root, TRACKER_FILE))
    os.symlink("/dev/zero", os.path.join(root, TRACKER_FILE))
    code, out, err = train(capsys, "--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err).startswith(f"error: --load {root}: {TRACKER_FILE} is a "
                                          "character device, not a regular file; ")


def test_a_fifo_as_the_iteration_directory_is_one_line(checkpoint, capsys):
    root, ckpt = checkpoint
    shutil.rmtree(ckpt)
    os.mkfifo(ckpt)
    code, out, err = train(capsys, "--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --load {root}: {TRACKER_FILE} names iteration 2 but "
                                   f"{ckpt} is a FIFO, not a checkpoint directory; fix the "
                                   "tracker file or use another --load")


def test_a_fifo_as_the_common_state_is_one_line(checkpoint):
    root, ckpt = checkpoint
    replace_with_fifo(os.path.join(ckpt, "common.pt"))
    code, out, err = child("--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err).startswith(f"error: {ckpt}/common.pt is a FIFO, not a regular "
                                          "file: the checkpoint is damaged")


@pytest.mark.parametrize("name", ["checksums.json", ".metadata", "__0_0.distcp"])
def test_a_fifo_among_the_checkpoint_files_is_one_line(checkpoint, capsys, name):
    root, ckpt = checkpoint
    replace_with_fifo(os.path.join(ckpt, name))
    code, out, err = train(capsys, "--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert f"{name} is a FIFO, not a regular file" in one_error_line(err)


def test_an_oversized_checksum_list_is_not_read(checkpoint, capsys, monkeypatch):
    from megatron.training import checkpoint_files

    root, ckpt = checkpoint
    monkeypatch.setitem(checkpoint_files.SIZE_LIMITS, "checksums.json", 100)
    code, out, err = train(capsys, "--train-iters", "3", "--load", root)
    assert code == 2 and MODEL_BUILT not in out
    assert "checksums.json has " in one_error_line(err) and "more than the 100 such a file " \
        "holds" in err


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_a_fifo_as_a_data_file_is_one_line(data, capsys, ext):
    replace_with_fifo(data + ext)
    code, out, err = train(capsys, *data_args(data))
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --data-path {data}: {data}{ext} is a FIFO, not a "
                                   "regular file (a FIFO or device cannot be memory-mapped); "
                                   "pass the prefix of a preprocessed dataset (PREFIX.bin and "
                                   "PREFIX.idx)")


def test_a_fifo_as_the_sidecar_is_ignored_with_a_note(data, capsys):
    os.mkfifo(data + ".json")
    code, out, err = train(capsys, *data_args(data))
    assert code == 0 and "exiting at iteration 1" in out, err
    assert f"note: ignoring {data}.json (is a FIFO, not a regular file); the .bin is scanned " \
           "instead" in out


def test_a_fifo_as_sources_json_does_not_block(data):
    """The corpora's sources.json beside the data was opened and read: a FIFO blocked."""
    os.mkfifo(os.path.join(os.path.dirname(data), "sources.json"))
    code, out, err = child(*[a for a in data_args(data)], "--eval-iters", "0")
    assert code == 0 and "exiting at iteration 1" in out, err[-3000:]


# ---------------------------------------------------------------------------------------------
# Flags that name files
# ---------------------------------------------------------------------------------------------


def test_a_fifo_as_the_capture_config_is_one_line(tmp_path):
    config = tmp_path / "capture.yaml"
    os.mkfifo(config)
    code, out, err = child("--train-iters", "1", "--save-tensors", "--tensor-save-dir",
                           str(tmp_path / "tensors"), "--tensor-save-config", str(config))
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --tensor-save-config {config} is a FIFO, not a "
                                   "regular file; give a YAML or JSON file of capture rules")


def test_a_device_as_the_capture_config_is_one_line(tmp_path, capsys):
    """/dev/zero was read until the memory ran out (a MemoryError traceback)."""
    code, out, err = train(capsys, "--train-iters", "1", "--save-tensors", "--tensor-save-dir",
                           str(tmp_path / "tensors"), "--tensor-save-config", "/dev/zero")
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == ("error: --tensor-save-config /dev/zero is a character "
                                   "device, not a regular file; give a YAML or JSON file of "
                                   "capture rules")


def test_a_fifo_as_the_tokenizer_model_is_one_line(tmp_path):
    model = tmp_path / "tokenizer.json"
    os.mkfifo(model)
    code, out, err = child("--train-iters", "1", "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", str(model))
    assert code == 2 and MODEL_BUILT not in out
    assert one_error_line(err) == (f"error: --tokenizer-model {model} is a FIFO, not a regular "
                                   "file; give the tokenizer's file (a FIFO would block its "
                                   "reader, a device never end)")
