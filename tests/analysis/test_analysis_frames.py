"""The notebook API: load_frame (one row per manifest record) and load_tensors."""

import json
import os
import shutil

import pandas as pd
import pytest
import torch

from megatron.analysis import load_frame, load_tensors, synthetic
from megatron.analysis.frames import FRAME_COLUMNS


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), ("bf16", "FA_linear_mxfp8"), layers=2, iterations=(1, 2),
                            seq=8, batch=1, hidden=32, ffn=32, modules=("linear_fc1",))
    return str(root)


def _manifest_entries(root, scheme):
    directory = os.path.join(root, scheme)
    manifest = next(f for f in os.listdir(directory) if f.startswith("manifest-"))
    return [json.loads(line) for line in open(os.path.join(directory, manifest))]


def test_one_row_per_manifest_record(capture):
    frame = load_frame(capture)
    assert list(frame.columns) == list(FRAME_COLUMNS)
    # No column hides behind a pandas attribute (row.shape would be the row's own shape).
    assert not [c for c in frame.columns if hasattr(pd.DataFrame, c) or hasattr(pd.Series, c)]
    assert frame.attrs["problems"] == []
    for scheme in ("bf16", "FA_linear_mxfp8"):
        entries = _manifest_entries(capture, scheme)
        mine = frame[frame.scheme == scheme].set_index("path")
        assert len(mine) == len(entries)
        for entry in entries:
            row = mine.loc[os.path.join(capture, scheme, entry["file"])]
            m, info, err = entry["metadata"], entry["tensor_info"], entry["quant_error"]
            assert (row.iteration, row.micro_batch, row.layer) == (
                m["iteration"], m["micro_batch"], m["layer_idx"])
            assert (row.tensor_name, row.gemm, row.operand, row.format) == (
                m["tensor_name"], m["gemm"], m["operand"], m["format"])
            assert row.module == m["module"].rsplit(".", 1)[-1]
            assert row.tensor_shape == tuple(info["shape"]) and row.numel == info["numel"]
            assert row.tensor_dtype == info["dtype"]
            assert row.absmax == pytest.approx(info["absmax"])
            if err is None:
                assert pd.isna(row.sqnr_db) and pd.isna(row.scale_mode)    # not quantized
            else:
                assert row.sqnr_db == pytest.approx(err["sqnr_db"])
                assert row.flushed_fraction == pytest.approx(err["flushed_fraction"])
                assert row.scale_mode == m["scale_mode"] and row.axis == m["axis"]


def test_filters(capture):
    frame = load_frame(capture, schemes=["FA_linear_mxfp8"], iterations=[2], layers=[1])
    assert set(frame.scheme) == {"FA_linear_mxfp8"}
    assert set(frame.iteration) == {2} and set(frame.layer) == {1}
    expected = [e for e in _manifest_entries(capture, "FA_linear_mxfp8")
                if e["metadata"]["iteration"] == 2 and e["metadata"]["layer_idx"] == 1]
    assert len(frame) == len(expected)


def test_groupby_like_a_notebook(capture):
    frame = load_frame(capture)
    quantized = frame[frame.format != "none"]
    by_tensor = quantized.groupby("tensor_name").sqnr_db.mean()
    inputs = [e["quant_error"]["sqnr_db"] for e in _manifest_entries(capture, "FA_linear_mxfp8")
              if e["metadata"]["tensor_name"] == "input"]
    assert by_tensor["input"] == pytest.approx(sum(inputs) / len(inputs))


def test_load_tensors_of_selected_rows(capture):
    frame = load_frame(capture)
    rows = frame[(frame.tensor_name == "input") & (frame.layer == 1) & (frame.iteration == 1)]
    assert sorted(rows.scheme) == ["FA_linear_mxfp8", "bf16"]
    records = load_tensors(rows)
    assert len(records) == 2
    for (_, row), record in zip(rows.iterrows(), records):
        saved = torch.load(row.path, weights_only=True)
        assert torch.equal(record["hp"], saved["tensor"])
        if row.format == "none":
            assert record["quantized"] is None
        else:
            assert torch.equal(record["quantized"], saved["quantized"])
        assert record["metadata"]["tensor_name"] == "input"
    single = load_tensors(rows.iloc[0])
    assert len(single) == 1 and torch.equal(single[0]["hp"], records[0]["hp"])


class _Planted:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_load_tensors_refuses_what_is_not_a_record(capture, tmp_path):
    root = str(tmp_path / "capture")
    shutil.copytree(capture, root)
    frame = load_frame(root, schemes=["bf16"])
    row = frame.iloc[0]
    torch.save({"format_version": 1, "payload": _Planted()}, row.path)
    with pytest.raises(ValueError, match=r"not a valid capture record \(refused to unpickle"):
        load_tensors(row)
    stats_row = frame.iloc[1].copy()
    stats_row["path"] = None
    with pytest.raises(ValueError, match="stats mode"):
        load_tensors(stats_row)


def test_bad_lines_are_skipped_and_listed(capture, tmp_path):
    root = str(tmp_path / "capture")
    shutil.copytree(capture, root)
    directory = os.path.join(root, "bf16")
    manifest = next(os.path.join(directory, f) for f in os.listdir(directory)
                    if f.startswith("manifest-"))
    lines = open(manifest).read().splitlines()
    entry = json.loads(lines[0])
    entry["metadata"]["iteration"] = "first"
    lines[0] = json.dumps(entry)
    open(manifest, "w").write("\n".join(lines) + "\n")
    frame = load_frame(root, schemes=["bf16"])
    assert len(frame) == len(lines) - 1
    assert [p["kind"] for p in frame.attrs["problems"]] == ["bad_manifest_line"]
    assert "metadata.iteration = 'first'" in frame.attrs["problems"][0]["message"]
