"""The capture-format module and the drivers' progress entry point, on hand-written files."""

import json
import math
import os
import subprocess
import sys

import pytest

from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture import progress

from conftest import child_env


def _line(file_name, nbytes, **stats):
    return json.dumps({"format_version": 1, "file": file_name, "bytes": nbytes,
                       "metadata": {"quant_type": "bf16"}, "tensor_info": stats,
                       "quant_error": None}) + "\n"


def test_non_finite_round_trip():
    entry = capture_format.manifest_entry("r.pt", 3, {"quant_type": "bf16"},
                                          {"min": -math.inf, "max": math.inf, "mean": math.nan,
                                           "std": 1.5}, None)
    line = capture_format.json_line(entry)
    assert "NaN" not in line and "Infinity" not in line and line.endswith("}\n")
    assert json.loads(line)["tensor_info"] == {"min": "-inf", "max": "inf", "mean": "nan",
                                               "std": 1.5}


def test_parse_manifest_reports_bad_lines_and_decodes_stats(tmp_path):
    path = tmp_path / "manifest-r1-rank00000.jsonl"
    path.write_text(_line("a.pt", 10, max="inf") + "[1, 2]\n" + _line("b.pt", 20)
                    + '{"format_version": 1, "fi')
    parsed = list(capture_format.parse_manifest(str(path)))
    assert [(n, e is not None) for n, e, _ in parsed] == [(1, True), (2, False), (3, True),
                                                         (4, False)]
    assert parsed[0][1]["tensor_info"]["max"] == math.inf
    assert parsed[1][2][0] == "bad_manifest_line"
    assert parsed[3][2] == ("truncated_manifest_line",
                            f"{path}:4: skipping truncated last manifest line")
    assert capture_format.count_complete(str(path)) == (2, 30)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.pt", "a/b.pt", "..", "", None, 3])
def test_record_path_only_accepts_plain_file_names(tmp_path, name):
    with pytest.raises(ValueError, match="not a file name inside the capture directory"):
        capture_format.record_path(str(tmp_path), name)
    assert capture_format.record_path("/d", "x.pt") == os.path.join("/d", "x.pt")


def test_file_names_follow_the_documented_pattern(tmp_path):
    assert capture_format.manifest_file("/d", "20260101_000000", 3) == \
        "/d/manifest-20260101_000000-rank00003.jsonl"
    assert capture_format.manifest_run_id("/d/manifest-20260101_000000-2-rank00003.jsonl") == \
        "20260101_000000-2"
    assert capture_format.manifest_run_id("/d/notes.jsonl") is None
    assert capture_format.summary_file("/d", "r", 0) == "/d/summary-r-rank00000.json"


def test_progress_counts_only_new_runs(tmp_path):
    capture = tmp_path / "bf16"
    capture.mkdir()
    (capture / "manifest-old-rank00000.jsonl").write_text(_line("o.pt", 1000))
    before = tmp_path / "before.txt"
    before.write_text("\n".join(progress.snapshot(str(capture))) + "\n")
    (capture / "manifest-new-rank00000.jsonl").write_text(_line("a.pt", 1536) + _line("b.pt", 512))
    (capture / "manifest-new-rank00001.jsonl").write_text(_line("c.pt", 2048) + '{"trunc')
    (capture / "summary-new-rank00001.json").write_text(json.dumps({"error": "disk full"}))
    (capture / "summary-old-rank00000.json").write_text(json.dumps({"error": "old error"}))
    assert progress.count(str(capture), str(before)) == (3, 4096)
    assert progress.errors(str(capture), str(before)) == ["disk full"]
    assert progress.count(str(capture), None) == (4, 5096)
    assert progress.snapshot(str(tmp_path / "missing")) == []

    def cli(*argv):
        done = subprocess.run([sys.executable, "-m", "megatron.tensor_capture.progress", *argv],
                              capture_output=True, text=True, cwd=str(tmp_path),
                              env=child_env())
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert cli("count", str(capture), "--since", str(before)) == "3 4096 4.0 KiB\n"
    assert cli("errors", str(capture), "--since", str(before)) == "disk full\n"
    assert cli("snapshot", str(capture)).split() == ["manifest-new-rank00000.jsonl",
                                                     "manifest-new-rank00001.jsonl",
                                                     "manifest-old-rank00000.jsonl"]
    assert [cli("human", n).strip() for n in ("0", "1023", "1024", "5000000")] == \
        ["0 B", "1023 B", "1.0 KiB", "4.8 MiB"]


def test_summary_for_manifest():
    assert capture_format.summary_for_manifest("/d/manifest-20260101_000000-2-rank00003.jsonl") \
        == "/d/summary-20260101_000000-2-rank00003.json"
    assert capture_format.summary_for_manifest("/d/notes.jsonl") is None
