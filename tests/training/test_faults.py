"""Fault injection in one place: tampered and damaged checkpoints, the fallback to an earlier
checkpoint, a full disk under tensor capture, damaged data files.

Every fault ends in one `error:` line and a clear exit (2 for bad input found before anything
is built, 1 for a capture failure during training), never in a traceback, and a tampered file
never runs its code. The full disk is a byte budget (tests/fakedisk.py): it behaves like a
small file system (short writes, ENOSPC, torch's "unexpected pos"), needs no root, and runs
anywhere.

The fault cases of one subject live beside this file:
- test_faults_checkpoints.py: one run per --save directory (a second run refused, the first's
  checkpoints intact and loadable; a lock left by a dead run, or by a writer it forked, taken),
  stale and failed saves cleaned, checksums (zeroed and flipped shard bytes: one line, no
  training; the fallback), symlinks out of --load, a full disk while saving;
- test_faults_data.py: every kind of bad .idx entry, token ids outside the vocabulary (sidecar
  and scan), tokenizer mismatches, preprocessing's dtype and out-of-vocabulary lines;
- test_faults_logging.py: TensorBoard failing or out of space mid-run, W&B failing: one warning,
  training goes on;
- test_analysis_bad_input.py / test_analysis_manifest_fuzz.py: the stride-0 (non-dense) record,
  shape and dtype mismatches, labels with "$", malformed manifests;
- test_study.py: a study's SIGTERM ends its trainings (no child left) and says how to resume;
- here: tampered and damaged checkpoints, a full disk under capture, damaged data, divergence and
  memory errors.
"""

import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
from datetime import datetime

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.diskio import ReservedFile
from megatron.tensor_capture.load import load_record, read_summaries
from megatron.tensor_capture.records import CaptureItem
from megatron.tensor_capture.writer import CaptureWriter
from megatron.training.checkpoint_files import read_metadata, verify_checkpoint
from megatron.training.cli import main
from megatron.training.data_files import check_dataset
from megatron.training.errors import ConfigError, TrainingError
from megatron.training.training import pretrain

from conftest import REPO_ROOT, TINY_MOCK_ARGS
from fakedisk import FakeDisk

ARGS = TINY_MOCK_ARGS + ["--train-iters", "2"]
MODEL_BUILT = "number of parameters"      # printed once the model exists


def one_error_line(err: str) -> str:
    """The single line a fault may print on stderr (no traceback, nothing else)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: "), lines
    return lines[0]


class _RunsACommand:
    """Unpickling this runs a shell command (what a tampered file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at iterations 1 and 2 (the tracker names 2)."""
    root = tmp_path_factory.mktemp("ckpt")
    pretrain(pretrain_gpt.forward_step, ARGS + ["--save", str(root), "--save-interval", "1"])
    return str(root)


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A private copy: (root for --load, the chosen iteration's directory)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    return root, os.path.join(root, "iter_0000002")


def load(root, capsys, *extra):
    code = main(pretrain_gpt.forward_step, ARGS + ["--train-iters", "3", "--load", root,
                                                   *extra])
    out, err = capsys.readouterr()
    return code, out, err


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
    code, out, err = load(root, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert "refusing to unpickle posix.system" in line and ".metadata" in line
    assert "untrusted sources" in line
    assert not marker.exists()


def test_tampered_common_state_is_refused_and_runs_nothing(checkpoint, tmp_path, capsys):
    root, ckpt = checkpoint
    marker = tmp_path / "pwned"
    torch.save({"iteration": 2, "payload": _RunsACommand(marker)}, os.path.join(ckpt,
                                                                               "common.pt"))
    code, out, err = load(root, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert "common.pt: refusing to unpickle posix.system" in line
    assert "weights_only=False" not in line          # no advice that would run the code
    assert not marker.exists()


DAMAGE = [
    ("remove common.pt", "common.pt is missing"),
    ("remove metadata.json", "metadata.json is missing"),
    ("remove .metadata", ".metadata is missing"),
    ("remove shard", "__0_0.distcp is missing"),
    ("truncate shard", "__0_0.distcp has 100 bytes, the metadata needs at least"),
    ("truncate .metadata", "unreadable checkpoint metadata"),
    ("truncate common.pt", "common.pt: unreadable"),
]


def damage(ckpt, what):
    verb, name = what.split(" ", 1)
    path = os.path.join(ckpt, "__0_0.distcp" if name == "shard" else name)
    if verb == "remove":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(100)


@pytest.mark.parametrize("what,expected", DAMAGE)
def test_damaged_checkpoint_stops_with_one_line(checkpoint, capsys, what, expected):
    root, ckpt = checkpoint
    damage(ckpt, what)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        verify_checkpoint(ckpt)
    code, out, err = load(root, capsys)
    assert code == 2 and expected in one_error_line(err) and MODEL_BUILT not in out


def test_shard_damaged_in_place_stops_with_one_line(checkpoint, capsys):
    """Random bytes over a shard, its size kept: the file checks pass, the load fails, and
    that is one line without torch's advice to unpickle with weights_only=False."""
    root, ckpt = checkpoint
    path = os.path.join(ckpt, "__0_0.distcp")
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(random.Random(0).randbytes(size))
    verify_checkpoint(ckpt)
    code, out, err = load(root, capsys)
    line = one_error_line(err)
    assert code == 2 and "iter_0000002 could not be read" in line and "damaged" in line
    assert "weights_only" not in out + err and "Traceback" not in out + err


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


def test_fallback_loads_the_newest_intact_earlier_checkpoint(checkpoint, capsys):
    root, ckpt = checkpoint
    damage(ckpt, "truncate shard")
    code, out, err = load(root, capsys, "--load-fallback-to-previous")
    assert code == 0, err
    notes = [line for line in out.splitlines() if "--load-fallback-to-previous" in line]
    assert len(notes) == 1 and notes[0].startswith("warning: --load")
    assert "__0_0.distcp has 100 bytes" in notes[0] and "iteration 1" in notes[0]
    assert "iteration        2/       3" in out and "exiting at iteration 3" in out

    # Nothing intact left: still one line, naming the first problem.
    for name in ("iter_0000001", "iter_0000002"):
        damage(os.path.join(root, name), "remove common.pt")
    code, out, err = load(root, capsys, "--load-fallback-to-previous")
    line = one_error_line(err)
    assert code == 2 and "iter_0000002/common.pt is missing" in line
    assert "no intact earlier checkpoint" in line


# ---------------------------------------------------------------------------------------------
# A full disk under tensor capture
# ---------------------------------------------------------------------------------------------


def item(i, numel=1000, full=True):
    t = torch.full((numel,), float(i))
    return CaptureItem(metadata={"counter": i, "tensor_name": "input"},
                       file_name=f"rec{i}.pt" if full else None, tensor=t if full else None,
                       quantized=t.clone() if full else None,
                       tensor_info={"numel": numel, "mean": float(i)},
                       quant_error={"mse": 0.0, "sqnr_db": float("inf")})


def assert_valid_capture(directory):
    """Every manifest line parses and names a complete file; no partial line, no temp file."""
    entries = []
    for manifest in capture_format.manifest_files(str(directory)):
        text = open(manifest, encoding="utf-8").read()
        assert text == "" or text.endswith("\n"), "partial last manifest line"
        for line in text.splitlines():
            entry = json.loads(line)
            if entry["file"] is not None:
                path = os.path.join(directory, entry["file"])
                assert os.path.getsize(path) == entry["bytes"]
                load_record(path)
            entries.append(entry)
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    return entries


def test_full_disk_while_writing_a_record(tmp_path, monkeypatch):
    """torch's serializer reports the full disk as "unexpected pos": still "no space"."""
    FakeDisk(tmp_path, free=30_000).install(monkeypatch)         # room for 3 records
    w = CaptureWriter(str(tmp_path), str(tmp_path / "manifest-r-rank00000.jsonl"))
    accepted = []
    for i in range(8):
        accepted.append(w.submit(item(i)))
        w.drain(timeout=60)
    w.close(timeout=60)
    assert w.error == f"no space left on device ({tmp_path})"
    entries = assert_valid_capture(tmp_path)
    assert [e["file"] for e in entries] == [f"rec{i}.pt" for i in range(w.records)]
    # The failed record was accepted, every later one refused.
    assert 1 <= w.records < 8 and accepted == [True] * (w.records + 1) + \
        [False] * (7 - w.records)
    assert w.summary()["dropped"] == 8 - w.records


def test_full_disk_while_appending_a_manifest_line(tmp_path, monkeypatch):
    """A short write of a manifest line is cut back off: the manifest ends with a full line."""
    manifest = tmp_path / "manifest-r-rank00000.jsonl"
    first = item(0, full=False)
    first.metadata["save_time"] = datetime.now().astimezone().isoformat(timespec="milliseconds")
    line = len(capture_format.json_line(first.manifest_entry(None, 0)))     # as written
    disk = FakeDisk(tmp_path, free=int(2.5 * line)).install(monkeypatch)
    w = CaptureWriter(str(tmp_path), str(manifest))
    for i in range(5):
        w.submit(item(i, full=False))
    w.close(timeout=60)
    assert w.error == f"no space left on device ({tmp_path})" and w.records == 2
    assert len(assert_valid_capture(tmp_path)) == 2
    assert disk.free == int(2.5 * line) - os.path.getsize(manifest)   # the cut bytes came back


def test_the_summary_space_is_reserved(tmp_path, monkeypatch):
    disk = FakeDisk(tmp_path, free=100_000).install(monkeypatch)
    summary = ReservedFile(str(tmp_path / "summary-r-rank00000.json"))
    disk.free = 0                                            # the disk fills up meanwhile
    with pytest.raises(OSError):
        with open(tmp_path / "other", "wb") as f:
            f.write(b"x")
    summary.write(capture_format.json_text({"error": "no space left on device (here)"}))
    assert read_summaries(str(tmp_path))[0]["error"] == "no space left on device (here)"
    assert sorted(os.listdir(tmp_path)) == ["other", "summary-r-rank00000.json"]


SCHEME = "FA_linear_mxfp8"
CAPTURE = TINY_MOCK_ARGS + ["--train-iters", "5", "--quant-scheme", SCHEME, "--save-tensors",
                            "--control-iter", "2", "--collect-micro-batches", "2"]


def test_full_disk_ends_the_run_with_one_line(tmp_path, monkeypatch, capfd):
    FakeDisk(tmp_path, free=600_000).install(monkeypatch)
    result = pretrain(pretrain_gpt.forward_step, CAPTURE + ["--tensor-save-dir", str(tmp_path)])
    directory = tmp_path / SCHEME
    err = capfd.readouterr().err
    monkeypatch.undo()
    # Warned before iteration 1: the estimate exceeds the free space.
    warnings = [line for line in err.splitlines() if line.startswith("warning: tensor capture")]
    assert len(warnings) == 1 and "the capture needs about" in warnings[0], err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: tensor capture: no space left on device ({directory})")
    assert (result.exit_code, result.iteration) == (1, 1)
    assert result.exit_reason == f"error: tensor capture: no space left on device ({directory})"
    entries = assert_valid_capture(directory)
    summary = read_summaries(str(directory))[0]
    assert summary["error"] == f"no space left on device ({directory})"
    assert summary["records"] == len(entries) > 0


def test_continue_on_error_still_ends_at_control_iter(tmp_path, monkeypatch, capfd):
    FakeDisk(tmp_path, free=300_000).install(monkeypatch)
    result = pretrain(pretrain_gpt.forward_step, CAPTURE + [
        "--tensor-save-dir", str(tmp_path), "--tensor-save-continue-on-error"])
    err = capfd.readouterr().err
    monkeypatch.undo()
    assert (result.exit_code, result.exit_reason, result.iteration) == (0, "control-iter", 2)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "continuing training without capture" in errors[0]
    assert_valid_capture(tmp_path / SCHEME)
    assert "no space left" in read_summaries(str(tmp_path / SCHEME))[0]["error"]


# ---------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """An intact indexed dataset of 300 documents (uint16 tokens < 512)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("data") / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 511, size=int(rng.integers(20, 200)))
        builder.add_document(torch.from_numpy(tokens), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def dataset(corpus, tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(corpus + ext, prefix + ext)
    return prefix


def train_on(prefix, capsys):
    argv = [a for a in TINY_MOCK_ARGS if a != "--mock-data"] + [
        "--train-iters", "1", "--data-path", prefix, "--split", "98,2,0"]
    code = main(pretrain_gpt.forward_step, argv)
    out, err = capsys.readouterr()
    return code, out, err


def cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_truncated_bin_is_refused_before_the_model_is_built(dataset, capsys):
    check_dataset(dataset)
    full = os.path.getsize(dataset + ".bin")
    cut(dataset + ".bin", full - 10)
    code, out, err = train_on(dataset, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert line == (f"error: {dataset}.bin has {full - 10} bytes but {dataset}.idx describes "
                    f"{full}: the file is truncated; rebuild it with tools/preprocess_data.py")


@pytest.mark.parametrize("size,expected", [
    (20, "less than the 34-byte index header: the file is truncated"),
    (500, "needs 6042: the file is truncated"),        # 34 + 300 * (4 + 8) + 301 * 8
])
def test_truncated_idx_is_refused_before_the_model_is_built(dataset, capsys, size, expected):
    cut(dataset + ".idx", size)
    code, out, err = train_on(dataset, capsys)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out
    assert f"{dataset}.idx has {size} bytes" in line and expected in line


def test_an_intact_dataset_trains(dataset, capsys):
    code, out, err = train_on(dataset, capsys)
    assert code == 0 and "exiting at iteration 1" in out, err


def test_divergence_is_one_line_naming_the_iteration_and_checkpoint(tmp_path):
    """--lr 1e4 sends the gradients to NaN within a few steps: megatron-core's NaN check
    stops the step; the run says where and what is left, without a traceback."""
    ckpt = str(tmp_path / "ckpt")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *TINY_MOCK_ARGS,
         "--train-iters", "30", "--lr", "1e4", "--lr-warmup-iters", "0", "--save", ckpt,
         "--save-interval", "1"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    match = re.search(r"training diverged at iteration (\d+): NaN in the gradients \(--lr "
                      r"10000\); the last checkpoint is iteration (\d+) in ", lines[0])
    assert match, lines[0]
    assert int(match.group(2)) == int(match.group(1)) - 1


def test_out_of_memory_names_the_flags(monkeypatch):
    """A step that runs out of host memory is one line naming the micro-batch flags."""
    from megatron.training import training

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(training, "train_step", no_memory)
    with pytest.raises(TrainingError, match=r"out of memory at iteration 1 \(MemoryError\): a "
                       r"micro-batch is --micro-batch-size 2 x --seq-length 64 = 128 tokens"):
        pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + ["--train-iters", "2"])


def test_out_of_memory_building_the_datasets_names_the_flags(monkeypatch):
    """--micro-batch-size 100000000 (measured: megatron-core's builder runs out of memory for
    the sample index and re-raises it wrapped in a plain Exception) is one line."""
    from megatron.training import training

    def wrapped_memory_error(*args, **kwargs):
        try:
            raise MemoryError("std::bad_alloc")
        except MemoryError:
            raise Exception("MockGPTDataset failed to build as a mock data generator")

    monkeypatch.setattr(training, "build_datasets", wrapped_memory_error)
    with pytest.raises(TrainingError, match=r"out of memory building the datasets .*"
                       r"--global-batch-size 4 = 8 samples"):
        pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + ["--train-iters", "2"])
