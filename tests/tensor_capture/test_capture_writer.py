"""The capture writer: atomic files, a manifest of complete records, back-pressure, kills.

A full disk and other injected faults are in test_faults.py."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.load import load_record, read_manifest, read_summaries
from megatron.tensor_capture.records import CaptureItem, HostBufferPool
from megatron.tensor_capture import writer as writer_module
from megatron.tensor_capture.writer import CaptureWriter

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env


def item(i, numel=1000, pool=None):
    t = torch.full((numel,), float(i))
    return CaptureItem(metadata={"counter": i, "tensor_name": "input"}, file_name=f"rec{i}.pt",
                       tensor=t, quantized=t.clone(),
                       tensor_info={"numel": numel, "mean": float(i)},
                       quant_error={"mse": 0.0, "sqnr_db": float("inf")}, pool=pool)


def make_writer(tmp_path, **kw):
    return CaptureWriter(str(tmp_path), str(tmp_path / "manifest.jsonl"), **kw)


def assert_valid_capture(directory, manifest):
    """Every complete manifest line names a loadable file; no temporary file is left."""
    entries = read_manifest(str(manifest))
    for entry in entries:
        record = load_record(entry["path"])
        assert record["metadata"]["counter"] == entry["metadata"]["counter"]
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    return entries


def test_records_are_complete_files_listed_in_order(tmp_path):
    w = make_writer(tmp_path)
    for i in range(20):
        assert w.submit(item(i))
    assert w.close(timeout=60)
    entries = assert_valid_capture(tmp_path, tmp_path / "manifest.jsonl")
    assert [e["metadata"]["counter"] for e in entries] == list(range(20))
    assert entries[3]["quant_error"]["sqnr_db"] == float("inf")   # "inf" in the JSON text
    with open(tmp_path / "manifest.jsonl") as f:
        first = f.readline()
    assert '"sqnr_db":"inf"' in first and json.loads(first)["bytes"] == \
        os.path.getsize(tmp_path / "rec0.pt")
    assert w.summary()["files"] == 20 and w.summary()["error"] is None
    record = torch.load(tmp_path / "rec5.pt", weights_only=True)
    assert torch.equal(record["tensor"], torch.full((1000,), 5.0))


def test_unlisted_when_the_manifest_cannot_be_written(tmp_path, monkeypatch):
    w = make_writer(tmp_path)
    assert w.submit(item(0))
    w.drain(timeout=60)

    def fail(_fd, _line):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "append_line", fail)
    w.submit(item(1))
    w.drain(timeout=60)
    monkeypatch.undo()
    w.close(timeout=60)
    assert w.error == f"no space left on device ({tmp_path})"
    assert [e["file"] for e in assert_valid_capture(tmp_path, tmp_path / "manifest.jsonl")] == \
        ["rec0.pt"]
    assert not os.path.exists(tmp_path / "rec1.pt")


def test_back_pressure_bounds_the_queue(tmp_path, monkeypatch):
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (time.sleep(0.02), real_save(*a, **k)))
    w = make_writer(tmp_path, max_records=2)
    longest = []
    watcher_stop = threading.Event()

    def watch():
        while not watcher_stop.is_set():
            longest.append(len(w._queue))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for i in range(10):
        w.submit(item(i))
    w.close(timeout=60)
    watcher_stop.set()
    watcher.join()
    assert max(longest) <= 2 and w.stall_seconds > 0.05 and w.records == 10


def test_byte_budget_admits_one_large_record(tmp_path):
    w = make_writer(tmp_path, max_records=100, max_bytes=1000)
    assert w.submit(item(0, numel=10_000))    # 80 KB alone in an empty queue
    assert w.close(timeout=60) and w.records == 1


def test_drain_timeout_abandons_and_reports(tmp_path, monkeypatch):
    release = threading.Event()
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (release.wait(), real_save(*a, **k)))
    w = make_writer(tmp_path)
    for i in range(3):
        w.submit(item(i))
    assert not w.close(timeout=0.2)
    assert "did not finish within" in w.error and w.dropped == 2
    release.set()
    # Its owner closes it for good (no exit hook does): the record in flight finishes, the
    # thread stops and the manifest is closed.
    assert w.close(timeout=60)
    assert w._manifest is None and not w._thread.is_alive() and w.dropped == 2


def test_buffers_return_to_the_pool(tmp_path):
    pool = HostBufferPool()
    w = make_writer(tmp_path)
    first = pool.copy(torch.ones(100))
    it = item(0, pool=pool)
    it.tensor, it.quantized = first, None
    w.submit(it)
    w.close(timeout=60)
    second = pool.copy(torch.zeros(100))
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, torch.zeros(100))


def test_manifest_reader_skips_a_truncated_last_line(tmp_path):
    w = make_writer(tmp_path)
    for i in range(3):
        w.submit(item(i))
    w.close(timeout=60)
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write('{"format_version": 1, "file": "rec9.pt", "by')
    with pytest.warns(UserWarning, match="truncated last"):
        entries = read_manifest(str(tmp_path / "manifest.jsonl"))
    assert [e["file"] for e in entries] == ["rec0.pt", "rec1.pt", "rec2.pt"]


def test_json_encoding_is_strict():
    line = capture_format.json_line({"a": float("nan"), "b": [float("-inf"), 1.5]})
    assert line == '{"a":"nan","b":["-inf",1.5]}\n'
    decoded = capture_format.decode_nonfinite(json.loads(line))
    assert math.isnan(decoded["a"]) and decoded["b"] == [-math.inf, 1.5]


def test_killed_run_leaves_a_valid_manifest(tmp_path):
    """SIGKILL a training run in the middle of capturing; what it listed stays loadable."""
    out = tmp_path / "capture"
    # A fresh single-process job: no rendezvous settings inherited from runs in this process.
    env = {k: v for k, v in child_env(OMP_NUM_THREADS="1").items()
           if k not in ("MASTER_ADDR", "MASTER_PORT")}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *TINY_MOCK_ARGS,
         "--train-iters", "200", "--quant-scheme", "linear_mxfp8", "--save-tensors",
         "--control-iter", "0", "--tensor-save-dir", str(out)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    directory = out / "linear_mxfp8"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            manifests = list(directory.glob("manifest-*.jsonl")) if directory.exists() else []
            if manifests and os.path.getsize(manifests[0]) > 200_000:
                break
            time.sleep(0.05)
        else:
            log.close()
            pytest.fail("the run did not start capturing:\n" +
                        (tmp_path / "run.log").read_text()[-3000:])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    with open(manifests[0]) as f:
        lines = f.read().split("\n")
    complete = [json.loads(line) for line in lines[:-1]]     # all but a possible partial tail
    assert len(complete) > 50
    listed = read_manifest(str(directory))
    assert len(listed) >= len(complete)
    for entry in listed:
        load_record(entry["path"])
    assert not read_summaries(str(directory))               # it never ended cleanly
