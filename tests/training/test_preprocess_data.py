"""megatron.training.preprocess_data (and its tools/ wrapper): JSON lines -> Megatron .bin/.idx,
read back with megatron.core."""

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import pytest

from megatron.training import preprocess_data
from megatron.training.tokenizer import Llama3Tokenizer
from conftest import REPO_ROOT

REPO = Path(REPO_ROOT)

DOCS = [
    {"text": "The capital of France is Paris.", "id": 1},
    {"text": "", "id": 2},                                   # empty: skipped
    {"text": "Unicode: naïve café, 日本語, emoji 🎉.\nSecond line.", "id": 3},
    {"text": "   ", "id": 4},                                # whitespace only: skipped
    {"text": "def f(x):\n    return x * 2\n", "id": 5},
    {"text": "<|end_of_text|> is plain text here", "id": 6},
]
NONEMPTY = [d["text"] for d in DOCS if d["text"].strip()]


def _indexed_dataset(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def tokenizer():
    return Llama3Tokenizer()


def _write_jsonl(path, docs, blank_line_after=0):
    lines = [json.dumps(d, ensure_ascii=False) for d in docs]
    if blank_line_after:
        lines.insert(blank_line_after, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run(tmp_path, input_path, name, *extra):
    prefix = tmp_path / name
    rc = preprocess_data.main(["--input", str(input_path), "--output-prefix", str(prefix),
                               *extra])
    return rc, f"{prefix}_text_document"


def test_round_trip_with_eod(tmp_path, tokenizer, capsys):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS, blank_line_after=2)
    rc, prefix = _run(tmp_path, src, "out", "--append-eod", "--log-interval", "2")
    assert rc == 0
    ds = _indexed_dataset(prefix)
    assert len(ds) == len(NONEMPTY)
    assert ds.index.dtype == numpy.int32
    for i, text in enumerate(NONEMPTY):
        expected = tokenizer.tokenize(text) + [128001]
        assert ds[i].tolist() == expected
        assert tokenizer.detokenize(ds[i][:-1]) == text
    out = capsys.readouterr().out
    assert "docs/s" in out and "MB/s" in out
    assert f"done: 6 documents, {sum(len(ds[i]) for i in range(len(ds)))} tokens, 2 empty skipped" \
        in out
    assert prefix + ".bin" in out


def test_without_eod_and_gzip_input(tmp_path, tokenizer):
    plain = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    gz = tmp_path / "docs.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    rc1, p1 = _run(tmp_path, plain, "plain")
    rc2, p2 = _run(tmp_path, gz, "gz")
    assert rc1 == rc2 == 0
    ds = _indexed_dataset(p1)
    assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.tokenize(t) for t in NONEMPTY]
    assert Path(p1 + ".bin").read_bytes() == Path(p2 + ".bin").read_bytes()
    assert Path(p1 + ".idx").read_bytes() == Path(p2 + ".idx").read_bytes()


def test_two_workers_match_one(tmp_path):
    docs = [{"text": f"Document {i}: " + "word " * (i % 17) + "end."} for i in range(300)]
    src = _write_jsonl(tmp_path / "many.jsonl", docs)
    rc1, p1 = _run(tmp_path, src, "w1", "--append-eod", "--workers", "1")
    rc2, p2 = _run(tmp_path, src, "w2", "--append-eod", "--workers", "2")
    assert rc1 == rc2 == 0
    for ext in (".bin", ".idx"):
        assert Path(p1 + ext).read_bytes() == Path(p2 + ext).read_bytes()
    assert len(_indexed_dataset(p2)) == 300


def test_malformed_line_names_the_line_and_leaves_no_outputs(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops}\n{"text": "x"}\n')
    rc, prefix = _run(tmp_path, src, "bad", "--workers", "2")
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src}:3: invalid JSON") and "--skip-bad-lines" in err
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no final or temp files


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "one"}\n[1, 2]\n{"title": "no text"}\n{"text": 5}\n'
                   '{"text": "two"}\nnot json\n')
    rc, prefix = _run(tmp_path, src, "skip", "--skip-bad-lines")
    assert rc == 0
    assert len(_indexed_dataset(prefix)) == 2
    assert "4 bad lines skipped" in capsys.readouterr().out


def test_missing_key_error_names_key(tmp_path):
    src = tmp_path / "k.jsonl"
    src.write_text('{"body": "text"}\n')
    with pytest.raises(preprocess_data.PreprocessError,
                       match=r"k.jsonl:1: missing key 'text' \(keys: body\)"):
        preprocess_data.preprocess(str(src), str(tmp_path / "k"),
                                   {"tokenizer_type": "Llama3Tokenizer"}, log=lambda m: None)


def test_missing_input_is_one_line_error(tmp_path, capsys):
    rc, _ = _run(tmp_path, tmp_path / "absent.jsonl", "x")
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --input {tmp_path / 'absent.jsonl'}: file not found; pass an existing "
                   "JSON-lines file (.jsonl or .jsonl.gz)")


def test_multiple_keys_and_null_tokenizer(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "1 2 3", "other": "7 8"}\n{"text": "4", "other": ""}\n')
    prefix = tmp_path / "ids"
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(prefix),
                               "--json-keys", "text", "other", "--tokenizer-type", "NullTokenizer",
                               "--vocab-size", "1000", "--append-eod"])
    assert rc == 0
    text = _indexed_dataset(f"{prefix}_text_document")
    other = _indexed_dataset(f"{prefix}_other_document")
    assert text.index.dtype == numpy.uint16  # vocab 1001 < 65500
    assert [text[i].tolist() for i in range(len(text))] == [[1, 2, 3, 1000], [4, 1000]]
    assert [other[i].tolist() for i in range(len(other))] == [[7, 8, 1000]]


def test_failure_keeps_previous_outputs_and_removes_temp_files(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", DOCS)
    rc, prefix = _run(tmp_path, good, "keep")
    before = Path(prefix + ".bin").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    rc, _ = _run(tmp_path, bad, "keep")
    assert rc == 2
    assert Path(prefix + ".bin").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_help_lists_the_flags():
    text = preprocess_data.build_parser().format_help()
    for flag in ("--input", "--output-prefix", "--json-keys", "--append-eod", "--workers",
                 "--log-interval", "--tokenizer-type", "--tokenizer-model", "--vocab-size"):
        assert flag in text


def test_tools_wrapper_runs_from_any_directory(tmp_path):
    # The wrapper finds the package itself: run it by absolute path from outside the checkout.
    script = str(REPO / "tools" / "preprocess_data.py")
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n')
    proc = subprocess.run([sys.executable, script, "--input", "ids.jsonl", "--output-prefix",
                           "out/ids", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ds = _indexed_dataset(str(tmp_path / "out" / "ids_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3]]
    proc = subprocess.run([sys.executable, script, "--input", "absent.jsonl", "--output-prefix",
                           "x"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # main()'s exit code reaches the shell
    assert proc.stderr.strip().endswith("error: --input absent.jsonl: file not found; pass an "
                                        "existing JSON-lines file (.jsonl or .jsonl.gz)")


def test_sidecar_records_the_tokenizer_and_the_largest_id(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    rc, prefix = _run(tmp_path, src, "side", "--append-eod")
    assert rc == 0
    sidecar = json.loads(Path(prefix + ".json").read_text())
    ds = _indexed_dataset(prefix)
    assert sidecar["tokenizer"] == {"type": "Llama3Tokenizer", "vocab_size": 128256,
                                    "eod": 128001, "sha256": tokenizer.sha256}
    assert sidecar["max_token_id"] == max(int(ds[i].max()) for i in range(len(ds))) == 128001
    assert (sidecar["dtype"], sidecar["sequences"], sidecar["documents"], sidecar["tokens"],
            sidecar["bin_bytes"], sidecar["append_eod"], sidecar["source"]) == (
        "int32", len(ds), len(ds), sum(len(ds[i]) for i in range(len(ds))),
        Path(prefix + ".bin").stat().st_size, True, "docs.jsonl")


def test_write_sidecar_flags(tmp_path, capsys):
    for argv, message in (
            (["--write-sidecar", "x", "--input", "y"], "--write-sidecar PREFIX takes no --input"),
            (["--input", "y"], "required: --output-prefix (or --write-sidecar PREFIX)")):
        with pytest.raises(SystemExit) as exc:
            preprocess_data.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert preprocess_data.main(["--write-sidecar", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --write-sidecar {tmp_path / 'absent'}: {tmp_path / 'absent'}.bin not found; "
        "pass the prefix of an existing dataset (PREFIX.bin and PREFIX.idx)")
