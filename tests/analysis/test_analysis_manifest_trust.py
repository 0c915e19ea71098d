"""A hand-edited manifest is checked against the record files it lists: each line's metadata
against the record's own (format, site, shape, run and writer), its file name against the
record it describes, its run against the manifest's name and run file; duplicate lines are
counted once. Every mismatch is one problem line, the record it concerns is left out, and
the analysis goes on."""

import json
import os
import shutil

import pytest

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

ARGS = ["--no-figures", "--no-progress", "--workers", "1", "--log-level", "ERROR"]
SCHEME = "FA_linear_mxfp8"


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), ("bf16", SCHEME), layers=2, seq=8, hidden=64, ffn=64,
                            attention=False, modules=("linear_fc1", "linear_fc2"))
    return str(root)


@pytest.fixture
def root(capture, tmp_path):
    dest = str(tmp_path / "capture")
    shutil.copytree(capture, dest)
    return dest


def _manifest(root, scheme=SCHEME):
    directory = os.path.join(root, scheme)
    return os.path.join(directory, next(f for f in sorted(os.listdir(directory))
                                        if f.startswith("manifest-")))


def _lines(root, scheme=SCHEME):
    return [json.loads(line) for line in open(_manifest(root, scheme))]


def _write(root, lines, scheme=SCHEME):
    with open(_manifest(root, scheme), "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


def _run(root, tmp_path, *extra):
    out = str(tmp_path / "out")
    assert main(["--tensor-dir", root, "--output-dir", out] + ARGS + list(extra)) == 0
    return load_json(os.path.join(out, "statistics.json"))


def _problems(doc, kind):
    return [p["message"] for p in doc["problems"] if p["kind"] == kind]


def _records(doc, scheme=SCHEME):
    return doc["quant_types"][scheme]["overall"]["records"]


def _same_shape_pair(lines):
    """Two quantized records of different sites (layer or module) with the same shape."""
    quantized = [(i, line) for i, line in enumerate(lines)
                 if line["metadata"]["format"] != "none"]
    for i, a in quantized:
        for j, b in quantized:
            if j > i and a["tensor_info"]["shape"] == b["tensor_info"]["shape"] and \
                    a["metadata"]["tensor_name"] == b["metadata"]["tensor_name"] and \
                    a["metadata"]["layer_idx"] != b["metadata"]["layer_idx"]:
                return i, j
    raise AssertionError("the synthetic capture has no two same-shape records")


def test_an_untouched_capture_has_no_problems(root, tmp_path):
    doc = _run(root, tmp_path)
    assert doc["problems"] == []
    assert _records(doc) == len(_lines(root))


def test_an_edited_format_is_a_mismatch_and_the_record_is_left_out(root, tmp_path):
    lines = _lines(root)
    index = next(i for i, line in enumerate(lines) if line["metadata"]["format"] == "mxfp8_e4m3")
    lines[index]["metadata"]["format"] = "mxfp4"            # MXFP4 with MXFP8's numbers
    _write(root, lines)
    doc = _run(root, tmp_path)
    (message,) = _problems(doc, "manifest_mismatch")
    assert lines[index]["file"] in message
    assert "format 'mxfp4'" in message and "'mxfp8_e4m3'" in message
    assert "\n" not in message
    assert _records(doc) == len(lines) - 1
    assert "mxfp4" not in doc["quant_types"][SCHEME]["by_format"]
    assert [p["kind"] for p in doc["problems"]] == ["manifest_mismatch"]


def test_swapped_record_files_do_not_move_statistics_between_sites(root, tmp_path):
    lines = _lines(root)
    i, j = _same_shape_pair(lines)
    directory = os.path.join(root, SCHEME)
    a, b = (os.path.join(directory, lines[k]["file"]) for k in (i, j))
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)
    doc = _run(root, tmp_path)
    messages = _problems(doc, "manifest_mismatch")
    assert len(messages) == 2
    assert all("layer_idx" in m for m in messages)
    assert _records(doc) == len(lines) - 2


@pytest.mark.parametrize("manifest_only", [False, True])
def test_swapped_file_fields_of_two_lines_are_mismatches(root, tmp_path, manifest_only):
    lines = _lines(root)
    i, j = _same_shape_pair(lines)
    lines[i]["file"], lines[j]["file"] = lines[j]["file"], lines[i]["file"]
    _write(root, lines)
    doc = _run(root, tmp_path, *(["--manifest-only"] if manifest_only else []))
    messages = _problems(doc, "manifest_mismatch")
    assert len(messages) == 2 and all("file name" in m for m in messages)
    assert _records(doc) == len(lines) - 2


@pytest.mark.parametrize("manifest_only", [False, True])
def test_duplicated_lines_count_once(root, tmp_path, manifest_only):
    lines = _lines(root)
    _write(root, [line for line in lines for _ in range(2)])
    doc = _run(root, tmp_path, *(["--manifest-only"] if manifest_only else []))
    messages = _problems(doc, "duplicate_manifest_line")
    assert len(messages) == len(lines)
    assert all("counted once" in m for m in messages)
    assert _records(doc) == len(lines)
    assert doc["quant_types"][SCHEME]["capture"]["manifest_records"] == len(lines)


def test_a_copied_manifest_counts_its_records_once(root, tmp_path):
    manifest = _manifest(root)
    shutil.copyfile(manifest, manifest.replace("-rank00000", "-rank00001"))
    shutil.copyfile(manifest.replace("manifest-", "summary-").replace(".jsonl", ".json"),
                    manifest.replace("manifest-", "summary-").replace("-rank00000.jsonl",
                                                                      "-rank00001.json"))
    doc = _run(root, tmp_path)
    lines = _lines(root)
    assert _records(doc) == len(lines)
    # each copied line is named once, as a duplicate or as a line of another rank
    assert len(doc["problems"]) == len(lines)


def test_an_edited_scheme_or_site_is_a_mismatch(root, tmp_path):
    lines = _lines(root)
    lines[0]["metadata"]["tensor_name"] = "weight" if \
        lines[0]["metadata"]["tensor_name"] != "weight" else "input"
    lines[1]["metadata"]["quant_type"] = "linear_mxfp4"
    lines[2]["metadata"]["iteration"] = 7
    _write(root, lines)
    doc = _run(root, tmp_path)
    messages = _problems(doc, "manifest_mismatch")
    assert len(messages) == 3
    assert "linear_mxfp4" not in doc["quant_types"]
    assert _records(doc) == len(lines) - 3


def test_a_line_of_another_run_is_a_mismatch(root, tmp_path):
    lines = _lines(root)
    lines[0]["metadata"]["run_id"] = "20251231_235959"
    _write(root, lines)
    doc = _run(root, tmp_path, "--manifest-only")
    (message,) = _problems(doc, "manifest_mismatch")
    assert "20251231_235959" in message and "run" in message
    assert _records(doc) == len(lines) - 1


def test_a_record_of_the_wrong_shape_in_manifest_only_mode_is_still_named(root, tmp_path):
    """--manifest-only opens no record, so it can only check what the lines say about
    themselves; the report says so once."""
    doc = _run(root, tmp_path, "--manifest-only")
    assert doc["problems"] == []
