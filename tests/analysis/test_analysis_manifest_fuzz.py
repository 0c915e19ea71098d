"""Every malformed manifest field skips its record with one problem line; nothing stops the
analysis. The bad values follow docs/capture-format.md (what each field may hold), not the
validator's tables."""

import copy
import json
import math
import os
import shutil

import pytest

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.loading import Problems, read_capture
from megatron.analysis.statistics import load_json

NAN, INF = math.nan, math.inf
HUGE = 10 ** 30
NESTED = {"nested": {"value": 1}}
# Values wrong for every field of that kind (None is added where a field is not nullable).
BAD = {
    "index": [-1, HUGE, 2 ** 40, 1.5, "3", True, NESTED, [1], NAN, INF],
    "count": [-1, HUGE, 1.5, "12", True, NESTED, [3], NAN],
    "enum": ["bogus", "", 3, NESTED, ["forward"], True],
    "name": ["../x", "/abs/name", "a/b", "..", "", 5, NESTED, "x" * 300],
    "text": [5, NESTED, ["a"], "x" * 5000, True],
    "fraction": [-0.1, 1.5, NAN, INF, "0.5", True, NESTED],
    "finite": [NAN, INF, -INF, "1.0", True, NESTED],
    "nonnegative": [-1.0, NAN, INF, "1", NESTED],
    "flag": [1, "true", NESTED],
    "object": [[], "x", 5, True],
}


def _cases():
    """(path, bad value, line kind) for every field: line kind picks an MX, a HiF8 (scaled)
    or an unquantized manifest line."""
    spec = [
        # top level
        (("bytes",), "count", True, "mx"),
        (("metadata",), "object", False, "mx"),
        (("tensor_info",), "object", False, "mx"),
        (("quant_error",), "object", True, "mx"),
        # metadata
        (("metadata", "layer_idx"), "index", False, "mx"),
        (("metadata", "iteration"), "index", False, "mx"),
        (("metadata", "micro_batch"), "index", False, "mx"),
        (("metadata", "rank"), "index", False, "mx"),
        (("metadata", "tp_rank"), "index", False, "mx"),
        (("metadata", "pp_rank"), "index", False, "mx"),
        (("metadata", "dp_rank"), "index", False, "mx"),
        (("metadata", "counter"), "count", False, "mx"),
        (("metadata", "module"), "text", False, "mx"),
        (("metadata", "save_time"), "text", False, "mx"),
        (("metadata", "run_id"), "text", False, "mx"),
        (("metadata", "name"), "text", False, "mx"),
        (("metadata", "site"), "text", False, "mx"),
        (("metadata", "layout"), "text", False, "mx"),
        (("metadata", "operation"), "enum", False, "mx"),
        (("metadata", "phase"), "enum", False, "mx"),
        (("metadata", "component"), "enum", False, "mx"),
        (("metadata", "layer_type"), "enum", False, "mx"),
        (("metadata", "gemm"), "enum", False, "mx"),
        (("metadata", "format"), "enum", False, "mx"),
        (("metadata", "site_kind"), "enum", False, "mx"),
        (("metadata", "scale_mode"), "enum", True, "mx"),
        (("metadata", "saturate"), "flag", True, "hifp8"),
        (("metadata", "hifp8_scaling"), "enum", False, "hifp8"),
        (("metadata", "tensor_name"), "name", False, "mx"),
        (("metadata", "operand"), "name", False, "mx"),
        (("metadata", "quant_type"), "name", False, "mx"),
        # tensor_info
        (("tensor_info", "numel"), "count", False, "mx"),
        (("tensor_info", "dtype"), "enum", False, "mx"),
        (("tensor_info", "device"), "text", False, "mx"),
        (("tensor_info", "requires_grad"), "flag", False, "mx"),
        (("tensor_info", "is_leaf"), "flag", False, "mx"),
        (("tensor_info", "min"), "finite", True, "mx"),
        (("tensor_info", "max"), "finite", True, "mx"),
        (("tensor_info", "mean"), "finite", True, "mx"),
        (("tensor_info", "std"), "nonnegative", True, "mx"),
        (("tensor_info", "absmax"), "nonnegative", True, "mx"),
        (("tensor_info", "zero_fraction"), "fraction", False, "mx"),
        (("tensor_info", "nan_count"), "count", False, "mx"),
        (("tensor_info", "inf_count"), "count", False, "mx"),
        # quant_error
        (("quant_error", "flushed_fraction"), "fraction", False, "mx"),
        (("quant_error", "saturated_fraction"), "fraction", False, "mx"),
        (("quant_error", "nonfinite_fraction"), "fraction", False, "mx"),
        (("quant_error", "nan_blocks"), "count", False, "mx"),
    ]
    cases = []
    for path, kind, nullable, line in spec:
        values = list(BAD[kind]) + ([] if nullable else [None])
        cases += [(path, value, line) for value in values]
    # Fields with their own rules.
    special = {
        ("format_version",): [2, "1", None, True, 1.5, NESTED],
        ("file",): ["../escape.pt", "/etc/passwd", "sub/x.pt", "..", ".", "", 5, NESTED,
                    ["x.pt"]],
        ("metadata", "world_size"): [0, -1, HUGE, "1", None, NESTED],
        ("metadata", "axis"): [-1, 3, 99, 1.5, "1", True, NESTED],     # inputs are 3-d
        ("metadata", "dims"): [[1], {"b": -1}, {"b": "2"}, {"b": 1.5}, "b=2", None],
        ("metadata", "hifp8_scale_exponent"): [128, -128, HUGE, 1.5, "3", None, True, NESTED],
        ("tensor_info", "shape"): [[-1, 2], [2, "a"], "3x3", [2 ** 40, 2 ** 40], None, 5,
                                   [[2]], [1] * 17],
        ("quant_error", "mse"): [-1.0, NAN, "x", NESTED],
        ("quant_error", "sqnr_db"): [NAN, "x", NESTED, True],
        ("quant_error", "relative_error"): [-1.0, NAN, "x"],
        ("quant_error", "scale_exponent_hist"): [
            {"min": -200, "counts": [1]}, {"min": 127, "counts": [1, 1]},
            {"min": 0, "counts": [-1]}, {"min": 0}, {"min": 1.5, "counts": [1]},
            {"min": None, "counts": [4]}, [], "x"],
    }
    for path, values in special.items():
        line = "hifp8" if "hifp8" in path[-1] else "mx"
        cases += [(path, value, line) for value in values]
    cases += [(("quant_error", "hifp8_regions"), value, "hifp8")
              for value in ({"mant3": 1.5}, {"bogus": 0.1}, [], {"mant1": "0.2"})]
    return cases


REQUIRED = [("format_version",), ("metadata",), ("tensor_info",),
            ("metadata", "layer_idx"), ("metadata", "iteration"), ("metadata", "micro_batch"),
            ("metadata", "module"), ("metadata", "operation"), ("metadata", "phase"),
            ("metadata", "component"), ("metadata", "tensor_name"), ("metadata", "gemm"),
            ("metadata", "operand"), ("metadata", "format"), ("tensor_info", "shape"),
            ("tensor_info", "numel"), ("tensor_info", "dtype")]
OPTIONAL = [("bytes",), ("quant_error",), ("metadata", "quant_type"), ("metadata", "axis"),
            ("metadata", "save_time"), ("metadata", "rank"),
            ("metadata", "scale_mode"), ("metadata", "hifp8_scaling"),
            ("tensor_info", "absmax"), ("tensor_info", "std"),
            ("quant_error", "scale_exponent_hist"), ("quant_error", "sqnr_db")]


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    common = dict(layers=1, seq=8, batch=1, hidden=32, ffn=32, modules=("linear_fc1",))
    synthetic.write_capture(str(root), ("FA_linear_mxfp8",), **common)
    synthetic.write_capture(str(root), ("linear_hifp8",), hifp8_scaling="tensor",
                            attention=False, **common)
    return str(root)


def _manifest(directory):
    return os.path.join(directory, next(f for f in os.listdir(directory)
                                        if f.startswith("manifest-")))


def _lines(capture, scheme):
    with open(_manifest(os.path.join(capture, scheme))) as f:
        return [json.loads(line) for line in f]


def _target(lines, kind):
    """Index of the first quantized input line of that kind (a 3-d tensor)."""
    fmt = {"mx": "mxfp8_e4m3", "hifp8": "hifp8"}[kind]
    return next(i for i, e in enumerate(lines)
                if e["metadata"]["format"] == fmt and e["metadata"]["tensor_name"] == "input")


def _set(entry, path, value):
    node = entry
    for key in path[:-1]:
        node = node[key]
    if value is _MISSING:
        del node[path[-1]]
    else:
        node[path[-1]] = value


_MISSING = object()


def _copy(capture, tmp_path, kind):
    """A copy of one scheme's capture: (directory, its manifest lines, the target line)."""
    scheme = "FA_linear_mxfp8" if kind == "mx" else "linear_hifp8"
    directory = str(tmp_path / scheme)
    shutil.copytree(os.path.join(capture, scheme), directory)
    lines = _lines(capture, scheme)
    return directory, lines, _target(lines, kind)


def _write_lines(directory, texts):
    with open(_manifest(directory), "w") as f:
        f.write("\n".join(texts) + "\n")


def _write(capture, tmp_path, kind, path, value):
    """A copy of the capture with one field of one line replaced; returns (directory, lines,
    index of the changed line)."""
    directory, lines, index = _copy(capture, tmp_path, kind)
    changed = copy.deepcopy(lines[index])
    _set(changed, path, value)
    text = [json.dumps(e) for e in lines]
    text[index] = json.dumps(changed)       # NaN/Infinity tokens: what a broken writer emits
    _write_lines(directory, text)
    return directory, lines, index


def _read(directory):
    problems = Problems()
    capture = read_capture(directory, problems)
    return capture, problems.items


CASES = _cases()


@pytest.mark.parametrize("path,value,kind", CASES,
                         ids=[f"{'.'.join(p)}={str(v)[:20]!r}" for p, v, _ in CASES])
def test_a_malformed_field_skips_only_its_record(capture, tmp_path, path, value, kind):
    directory, lines, index = _write(capture, tmp_path, kind, path, value)
    result, problems = _read(directory)
    assert len(problems) == 1, problems
    message = problems[0]["message"]
    assert "\n" not in message
    assert path[-1] in message
    assert problems[0]["kind"] in ("bad_manifest_line", "unknown_format_version")
    assert len(result.entries) == len(lines) - 1
    skipped = lines[index]["metadata"]["counter"]
    assert skipped not in [e.metadata["counter"] for e in result.entries]


@pytest.mark.parametrize("path", REQUIRED, ids=[".".join(p) for p in REQUIRED])
def test_a_missing_required_field_skips_its_record(capture, tmp_path, path):
    directory, lines, _ = _write(capture, tmp_path, "mx", path, _MISSING)
    result, problems = _read(directory)
    assert len(problems) == 1 and path[-1] in problems[0]["message"]
    assert "missing" in problems[0]["message"] or "format_version" in path
    assert len(result.entries) == len(lines) - 1


@pytest.mark.parametrize("path", OPTIONAL, ids=[".".join(p) for p in OPTIONAL])
def test_a_missing_optional_field_is_fine(capture, tmp_path, path):
    kind = "hifp8" if "hifp8" in path[-1] else "mx"
    directory, lines, _ = _write(capture, tmp_path, kind, path, _MISSING)
    result, problems = _read(directory)
    assert problems == [] and len(result.entries) == len(lines)


@pytest.mark.parametrize("change,words", [
    (lambda e: e["tensor_info"].update(numel=e["tensor_info"]["numel"] + 1), "numel"),
    (lambda e: e["metadata"].update(format="mxfp8_e4m3", hifp8_scaling="tensor"),
     "hifp8_scaling"),
    (lambda e: e["metadata"].pop("hifp8_scale_exponent"), "hifp8_scale_exponent is missing"),
])
def test_fields_that_contradict_each_other(capture, tmp_path, change, words):
    directory, lines, index = _copy(capture, tmp_path, "hifp8")
    entries = copy.deepcopy(lines)
    change(entries[index])
    _write_lines(directory, [json.dumps(e) for e in entries])
    result, problems = _read(directory)
    assert len(problems) == 1 and words in problems[0]["message"]
    assert len(result.entries) == len(lines) - 1


def test_many_bad_lines_end_to_end(capture, tmp_path):
    """One different malformed field on each of many lines: the report is still written,
    with one problem per bad line, and the good lines are analysed."""
    scheme = "FA_linear_mxfp8"
    directory = str(tmp_path / "capture" / scheme)
    shutil.copytree(os.path.join(capture, scheme), directory)
    lines = _lines(capture, scheme)
    mx_cases = [(p, v) for p, v, kind in CASES if kind == "mx"]
    bad = min(len(lines) - 3, len(mx_cases))
    step = max(1, len(mx_cases) // bad)
    chosen = mx_cases[::step][:bad]
    text = []
    for i, entry in enumerate(lines):
        if i < len(chosen):
            entry = copy.deepcopy(entry)
            _set(entry, *chosen[i])
        text.append(json.dumps(entry))
    with open(_manifest(directory), "w") as f:
        f.write("\n".join(text) + "\n")
    out = tmp_path / "out"
    code = main(["--tensor-dir", str(tmp_path / "capture"), "--output-dir", str(out),
                 "--no-figures", "--no-progress", "--workers", "1", "--log-level", "ERROR"])
    assert code == 0
    doc = load_json(str(out / "statistics.json"))
    assert len(doc["problems"]) == len(chosen)
    assert doc["quant_types"][scheme]["overall"]["records"] == len(lines) - len(chosen)
    text_report = (out / "statistics.txt").read_text()
    assert all(p["message"] in text_report for p in doc["problems"])


def test_a_line_nested_too_deeply_for_json_does_not_stop_the_analysis(capture, tmp_path):
    directory, lines, _ = _copy(capture, tmp_path, "mx")
    text = [json.dumps(e) for e in lines]
    text.insert(3, '{"format_version": 1, "metadata": ' + "[" * 100000 + "]" * 100000 + "}")
    _write_lines(directory, text)
    result, problems = _read(directory)
    assert [p["kind"] for p in problems] == ["truncated_manifest_line"]
    assert ":4: skipping unparsable manifest line (the rest of the manifest is used)" in \
        problems[0]["message"]
    assert len(result.entries) == len(lines)      # every other line is used
