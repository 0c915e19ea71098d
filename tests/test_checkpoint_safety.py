"""--load of tampered and damaged checkpoints: one line naming the file, exit code 2, and a
tampered `.metadata` never runs code."""

import os
import pickle
import shutil

import pytest

import pretrain_gpt
from megatron.training.checkpoint_files import read_metadata, verify_checkpoint
from megatron.training.cli import main
from megatron.training.errors import ConfigError
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS

ARGS = TINY_MOCK_ARGS + ["--train-iters", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    pretrain(pretrain_gpt.forward_step, ARGS + ["--save", str(root)])
    return str(root)


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A private copy: (root for --load, the iteration directory)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    return root, os.path.join(root, "iter_0000001")


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load(root, capsys):
    code = main(pretrain_gpt.forward_step, ARGS + ["--train-iters", "2", "--load", root])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_an_intact_checkpoint_passes(checkpoint):
    _, ckpt = checkpoint
    verify_checkpoint(ckpt)
    metadata = read_metadata(os.path.join(ckpt, ".metadata"))
    assert type(metadata).__name__ == "Metadata" and metadata.storage_data


def test_tampered_metadata_is_refused_and_runs_nothing(checkpoint, tmp_path, capsys):
    root, ckpt = checkpoint
    marker = tmp_path / "pwned"
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump({"storage_data": _RunsACommand(marker)}, f)
    code, err = _load(root, capsys)
    assert code == 2 and len(err) == 1
    assert "refusing to unpickle posix.system" in err[0] and ".metadata" in err[0]
    assert "untrusted sources" in err[0]
    assert not marker.exists()


@pytest.mark.parametrize("damage,expected", [
    ("remove common.pt", "common.pt is missing"),
    ("remove metadata.json", "metadata.json is missing"),
    ("remove .metadata", ".metadata is missing"),
    ("remove shard", "__0_0.distcp is missing"),
    ("truncate shard", "__0_0.distcp has 100 bytes, the metadata needs at least"),
    ("truncate .metadata", "unreadable checkpoint metadata"),
])
def test_damaged_checkpoints_stop_with_one_line(checkpoint, capsys, damage, expected):
    root, ckpt = checkpoint
    verb, name = damage.split(" ", 1)
    path = os.path.join(ckpt, "__0_0.distcp" if name == "shard" else name)
    if verb == "remove":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(100)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        verify_checkpoint(ckpt)
    code, err = _load(root, capsys)
    assert code == 2 and len(err) == 1 and expected in err[0], err


def test_a_storage_record_cannot_point_outside(checkpoint):
    _, ckpt = checkpoint
    path = os.path.join(ckpt, ".metadata")
    metadata = read_metadata(path)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ConfigError, match="not a file of the checkpoint directory"):
        verify_checkpoint(ckpt)
