"""Bad input: the analysis reports a clear problem and still produces what is valid."""

import json
import logging
import os
import shutil

import pytest
import torch

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

ARGS = ["--no-figures", "--no-progress", "--workers", "1", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), ("bf16", "FA_linear_mxfp8"), layers=1, seq=8,
                            hidden=64, ffn=64, attention=False)
    return str(root)


def _copy(capture, tmp_path):
    dest = str(tmp_path / "capture")
    shutil.copytree(capture, dest)
    return dest


def _manifest(directory):
    return os.path.join(directory, next(f for f in os.listdir(directory)
                                        if f.startswith("manifest-")))


def _run(tmp_path, *args):
    out = str(tmp_path / "out")
    code = main(list(args) + ["--output-dir", out] + ARGS)
    doc = load_json(os.path.join(out, "statistics.json")) if code == 0 else None
    return code, doc, out


def _kinds(doc):
    return [p["kind"] for p in doc["problems"]]


def test_truncated_manifest_line_is_skipped_with_a_warning(capture, tmp_path, caplog):
    root = _copy(capture, tmp_path)
    manifest = _manifest(os.path.join(root, "FA_linear_mxfp8"))
    with open(manifest) as f:
        lines = f.readlines()
    with open(manifest, "a") as f:       # a run killed while appending its next line
        f.write(lines[-1][: len(lines[-1]) // 2])
    with caplog.at_level(logging.WARNING, logger="megatron.analysis"):
        code, doc, out = _run(tmp_path, "--tensor-dir", root)
    assert code == 0
    assert _kinds(doc) == ["truncated_manifest_line"]
    assert "manifest line" in doc["problems"][0]["message"]
    assert any("manifest line" in r.getMessage() for r in caplog.records)
    sec = doc["quant_types"]["FA_linear_mxfp8"]
    assert sec["capture"]["manifest_records"] == len(lines)
    assert sec["overall"]["records"] == len(lines)
    assert "manifest line" in open(os.path.join(out, "report.html")).read()


def test_unknown_format_versions_are_skipped(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    manifest = _manifest(directory)
    lines = open(manifest).read().splitlines()
    first = json.loads(lines[0])
    first["format_version"] = 99
    lines[0] = json.dumps(first)
    open(manifest, "w").write("\n".join(lines) + "\n")
    # A record file of an unknown version behind a valid manifest line.
    second = json.loads(lines[1])
    path = os.path.join(directory, second["file"])
    record = torch.load(path, weights_only=True)
    record["format_version"] = 7
    torch.save(record, path)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0
    assert sorted(_kinds(doc)) == ["bad_record", "unknown_format_version"]
    messages = " ".join(p["message"] for p in doc["problems"])
    assert "format_version 99" in messages and "format_version 7" in messages
    assert doc["quant_types"]["FA_linear_mxfp8"]["overall"]["records"] == len(lines) - 2


def test_empty_or_missing_directory_is_a_one_line_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (str(empty), str(tmp_path / "missing")):
        code = main(["--tensor-dir", target, "--output-dir", str(tmp_path / "out")] + ARGS)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1
        assert len(err) == 1 and err[0].startswith("error: nothing could be analysed")
        assert target in err[0]
    assert not (tmp_path / "out" / "report.html").exists()


def test_missing_directory_next_to_a_valid_one(capture, tmp_path):
    code, doc, out = _run(tmp_path, "--tensor-dir", capture, str(tmp_path / "nope"))
    assert code == 0
    assert _kinds(doc) == ["missing_directory"]
    assert os.path.exists(os.path.join(out, "report.html"))


@pytest.mark.parametrize("flag", ["--quant-schemes", "--quant-types"])
def test_requested_scheme_without_data(capture, tmp_path, flag):
    code, doc, _ = _run(tmp_path, "--tensor-dir", capture, flag, "bf16", "linear_hifp8")
    assert code == 0
    assert list(doc["quant_types"]) == ["bf16"]
    assert doc["inputs"]["quant_types_requested"] == ["bf16", "linear_hifp8"]
    assert _kinds(doc) == ["quant_type_without_data"]
    assert "linear_hifp8" in doc["problems"][0]["message"]


def test_missing_record_file_and_stats_mode_lines(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    manifest = _manifest(directory)
    lines = [json.loads(line) for line in open(manifest)]
    os.remove(os.path.join(directory, lines[0]["file"]))      # deleted by hand
    for entry in lines[1:4]:                                    # stats-mode lines
        entry["file"] = None
    open(manifest, "w").write("".join(json.dumps(e) + "\n" for e in lines))
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0
    assert _kinds(doc) == ["unreadable_record"]
    overall = doc["quant_types"]["FA_linear_mxfp8"]["overall"]
    assert overall["records"] == len(lines) - 1
    assert overall["records_with_tensors"] == len(lines) - 4


def test_filters(capture, tmp_path):
    code, doc, _ = _run(tmp_path, "--tensor-dir", capture, "--operations", "forward",
                        "--layers", "1", "--iterations", "1")
    assert code == 0
    assert {g["operation"] for g in doc["groups"]} == {"forward"}


class _Planted:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_planted_and_truncated_records_are_reported_not_loaded(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    lines = [json.loads(line) for line in open(_manifest(directory))]
    planted, truncated = (os.path.join(directory, lines[i]["file"]) for i in (0, 1))
    torch.save({"format_version": 1, "payload": _Planted()}, planted)
    with open(truncated, "r+b") as f:
        f.truncate(64)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0
    messages = sorted(p["message"] for p in doc["problems"] if p["kind"] == "unreadable_record")
    assert len(messages) == 2
    refused = next(m for m in messages if planted in m)
    assert "not a valid capture record (refused to unpickle" in refused
    assert "unreadable record" in next(m for m in messages if truncated in m)
    assert not any("weights_only" in m or "Weights only load failed" in m for m in messages)


def _summary(directory):
    return os.path.join(directory, os.path.basename(_manifest(directory))
                        .replace("manifest-", "summary-").replace(".jsonl", ".json"))


def _killed_without_summary(directory):
    os.remove(_summary(directory))          # what kill -9 leaves: no summary


def _killed_mid_write(directory):
    record = json.loads(open(_manifest(directory)).readline())["file"]
    with open(os.path.join(directory, f".{record.replace('000001', '000099')}.tmp"), "wb") as f:
        f.write(b"PK\x03\x04 half a record")


@pytest.mark.parametrize("kill", [_killed_without_summary, _killed_mid_write])
def test_a_killed_run_is_reported_as_incomplete_everywhere(capture, tmp_path, kill):
    root = _copy(capture, tmp_path)
    kill(os.path.join(root, "FA_linear_mxfp8"))
    code, doc, out = _run(tmp_path, "--tensor-dir", root)
    assert code == 0 and _kinds(doc) == ["unfinished_run"]
    assert doc["problems"][0]["message"].startswith("incomplete run (killed?): ")
    assert doc["quant_types"]["FA_linear_mxfp8"]["capture"]["status"] == \
        "incomplete run (killed?)"
    assert doc["quant_types"]["bf16"]["capture"]["status"] == "complete"
    lines = {name: open(os.path.join(out, name)).read().splitlines()
             for name in ("statistics.txt", "report.html")}
    row = next(line for line in lines["statistics.txt"] if line.startswith("FA_linear_mxfp8 "))
    assert "incomplete run (killed?)" in row
    html = "\n".join(lines["report.html"])
    assert "<b>incomplete run (killed?)</b>: the capture of FA_linear_mxfp8" in html
    assert "<td>incomplete run (killed?)</td>" in html
    # What the manifest lists is complete and still analysed.
    assert doc["quant_types"]["FA_linear_mxfp8"]["overall"]["records"] == \
        doc["quant_types"]["FA_linear_mxfp8"]["capture"]["manifest_records"]


def test_a_record_planted_as_a_symlink_out_of_the_capture_is_refused(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    outside = tmp_path / "elsewhere.pt"
    target = os.path.join(directory, json.loads(open(_manifest(directory)).readline())["file"])
    shutil.move(target, outside)
    os.symlink(outside, target)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0 and _kinds(doc) == ["unreadable_record"]
    assert f"resolves to {outside}, outside the capture directory" in doc["problems"][0]["message"]


def test_a_record_without_the_quantized_copy_its_manifest_announces(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    entry = json.loads(open(_manifest(directory)).readline())
    assert entry["metadata"]["format"] == "mxfp8_e4m3"
    path = os.path.join(directory, entry["file"])
    record = torch.load(path, weights_only=True)
    del record["quantized"]
    torch.save(record, path)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0 and _kinds(doc) == ["bad_record"]
    assert "no quantized tensor" in doc["problems"][0]["message"]


@pytest.mark.parametrize("kind,content,words", [
    ("run", "[1, 2]", "expected a JSON object"),
    ("run", '{"quant_type": "../../etc", "mode": "full"}', "quant_type = '../../etc'"),
    ("summary", '{"records": "many"}', "records = 'many'"),
    ("summary", '{"error": {"nested": 1}}', "error = {'nested': 1}"),
    ("summary", '{"records": 3', "cannot read"),
])
def test_malformed_run_and_summary_files_are_ignored(capture, tmp_path, kind, content, words):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    path = _summary(directory) if kind == "summary" else next(
        os.path.join(directory, f) for f in os.listdir(directory) if f.startswith("run-"))
    with open(path, "w") as f:
        f.write(content)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0 and _kinds(doc) == [f"bad_{kind}_file"]
    assert words in doc["problems"][0]["message"]
    assert doc["quant_types"]["FA_linear_mxfp8"]["overall"]["records"] > 0


def _plant_record(directory, change, manifest_shape=None):
    """Rewrite the first record of `directory` with change(record); optionally make its
    manifest line announce `manifest_shape`."""
    manifest = _manifest(directory)
    lines = open(manifest).read().splitlines()
    entry = json.loads(lines[0])
    path = os.path.join(directory, entry["file"])
    record = torch.load(path, weights_only=True)
    change(record)
    torch.save(record, path)
    if manifest_shape is not None:
        entry["tensor_info"]["shape"] = manifest_shape
        entry["tensor_info"]["numel"] = int(torch.Size(manifest_shape).numel())
        lines[0] = json.dumps(entry)
        open(manifest, "w").write("\n".join(lines) + "\n")
    return path, len(lines)


def test_an_expanded_record_is_refused_fast(capture, tmp_path):
    """A few KB on disk that would be 400 M elements in the analysis (stride-0 view)."""
    import time
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")

    entry = json.loads(open(_manifest(directory)).readline())
    big = [1] * (len(entry["tensor_info"]["shape"]) - 2) + [20000, 20000]

    def expand(record):
        for key in ("tensor", "quantized"):
            record[key] = torch.zeros([1] * len(big), dtype=record[key].dtype).expand(*big)

    path, n = _plant_record(directory, expand, manifest_shape=big)
    assert os.path.getsize(path) < 10_000
    start = time.perf_counter()
    code, doc, out = _run(tmp_path, "--tensor-dir", root)
    assert time.perf_counter() - start < 30
    assert code == 0 and _kinds(doc) == ["bad_record"]
    assert doc["problems"][0]["message"] == (
        f"{path}: record tensor {big} stores 1 of its 400000000 elements (an expanded "
        "view, not a dense tensor); skipped")
    assert doc["quant_types"]["FA_linear_mxfp8"]["overall"]["records"] == n - 1
    assert "expanded view" in open(os.path.join(out, "report.html")).read()


def test_a_record_whose_shape_or_dtype_differs_from_its_manifest_line(capture, tmp_path):
    root = _copy(capture, tmp_path)
    directory = os.path.join(root, "FA_linear_mxfp8")
    entry = json.loads(open(_manifest(directory)).readline())
    shape, dtype = entry["tensor_info"]["shape"], entry["tensor_info"]["dtype"]

    def grow(record):
        record["tensor"] = torch.zeros([2 * shape[0]] + shape[1:], dtype=record["tensor"].dtype)
        record["quantized"] = record["tensor"].clone()

    path, n = _plant_record(directory, grow)
    code, doc, _ = _run(tmp_path, "--tensor-dir", root)
    assert code == 0 and _kinds(doc) == ["bad_record"]
    assert doc["problems"][0]["message"] == (
        f"{path}: record tensor {[2 * shape[0]] + shape[1:]} {dtype} but the manifest says "
        f"{shape} {dtype}; skipped".replace("tensor [", "tensor is [", 1))
    assert doc["quant_types"]["FA_linear_mxfp8"]["overall"]["records"] == n - 1


def _loss_log(path, start):
    lines = [f" [2026-01-01 00:00:00] iteration {i:8d}/      10 | lm loss: {start - 0.1 * i:.6E} |"
             for i in range(1, 11)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_run_name_with_dollars_is_drawn_literally(capture, tmp_path):
    """matplotlib reads `$...$` as mathtext: a run called `cost$x^$ run` (a mathtext error)
    must not abort the figures or the report."""
    from megatron.analysis.plots import mpl_escape
    assert mpl_escape("a$b$c") == r"a\$b\$c" == mpl_escape(r"a\$b\$c")
    runs = [f"bf16={_loss_log(tmp_path / 'a.log', 11.0)}",
            f"cost$x^$ run={_loss_log(tmp_path / 'b.log', 11.2)}"]
    out = str(tmp_path / "out")
    code = main(["--tensor-dir", capture, "--loss-logs", *runs, "--output-dir", out,
                 "--no-progress", "--workers", "1", "--log-level", "WARNING"])
    assert code == 0
    doc = load_json(os.path.join(out, "statistics.json"))
    assert _kinds(doc) == []
    assert "loss_curves.png" in [f["file"] for f in doc["figures"]]
    assert "cost$x^$ run" in open(os.path.join(out, "report.html")).read()


def test_a_figure_that_fails_costs_only_that_figure(capture, tmp_path, monkeypatch):
    from megatron.analysis import plots

    def broken(*args, **kwargs):
        raise ValueError("cannot draw this\nsecond line")

    monkeypatch.setattr(plots, "layer_absmax", broken)
    out = str(tmp_path / "out")
    code = main(["--tensor-dir", capture, "--output-dir", out, "--no-progress", "--workers",
                 "1", "--log-level", "WARNING"])
    assert code == 0
    doc = load_json(os.path.join(out, "statistics.json"))
    assert _kinds(doc) == ["figure_failed"]
    assert doc["problems"][0]["message"] == (
        "figure layer_absmax could not be drawn (ValueError: cannot draw this); the report "
        "goes on without it")
    files = [f["file"] for f in doc["figures"]]
    assert files and "layer_absmax.png" not in files
    assert "figure layer_absmax could not be drawn" in open(
        os.path.join(out, "report.html")).read()
