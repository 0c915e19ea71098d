"""Hostile data files: damaged `.idx` entries, token ids outside the vocabulary, data tokenized
with another tokenizer, and what tools/preprocess_data.py writes and refuses.

Every fault found before anything is built is one `error:` line and exit code 2 (never a
traceback, never a model); a tokenizer other than the one the data was built with is one
`warning:` line naming both and the flags that select the right one.
"""

import json
import os
import re
import shutil
import struct
import time

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.training import corpora, data_files, preprocess_data
from megatron.training.cli import main
from megatron.training.data_files import HEADER_BYTES, check_dataset
from megatron.training.errors import ConfigError
from megatron.training.tokenizer import HuggingFaceTokenizer, Llama3Tokenizer, NullTokenizer

from conftest import TINY_MOCK_ARGS
from test_faults import MODEL_BUILT, dataset  # noqa: F401 (a fixture over this corpus)
DOCS = 300
REBUILD = "; rebuild it with tools/preprocess_data.py"


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: "), lines
    return lines[0]


def _builder():
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder


def build_dataset(prefix, documents, dtype=np.uint16):
    """An indexed dataset written by megatron.core's own builder (no sidecar)."""
    builder = _builder()(prefix + ".bin", dtype=dtype)
    for tokens in documents:
        builder.add_document(torch.from_numpy(np.asarray(tokens, dtype=np.int64)), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 documents of 20..199 uint16 tokens < 511 (no sidecar)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 511, size=int(rng.integers(20, 200))) for _ in range(DOCS)]
    return build_dataset(str(tmp_path_factory.mktemp("data") / "corpus_text_document"), docs)




def train_on(prefix, capsys, vocab=512, iters=1):
    argv = [a for a in TINY_MOCK_ARGS if a != "--mock-data"] + [
        "--train-iters", str(iters), "--data-path", prefix, "--split", "98,2,0"]
    argv[argv.index("--vocab-size") + 1] = str(vocab)
    code = main(pretrain_gpt.forward_step, argv)
    out, err = capsys.readouterr()
    return code, out, err


def arrays(prefix):
    """(lengths, pointers, doc_idx) of the index, as writable copies."""
    lengths, pointers, doc_idx = data_files.index_arrays(prefix + ".idx", DOCS, DOCS + 1)
    return lengths.copy(), pointers.copy(), doc_idx.copy()


def poke(prefix, section, entry, value):
    """Overwrite one entry of the index: section 'length', 'pointer' or 'doc_idx'."""
    offset, fmt = {"length": (HEADER_BYTES + 4 * entry, "<i"),
                   "pointer": (HEADER_BYTES + 4 * DOCS + 8 * entry, "<q"),
                   "doc_idx": (HEADER_BYTES + 12 * DOCS + 8 * entry, "<q")}[section]
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


# ---------------------------------------------------------------------------------------------
# Every .idx entry
# ---------------------------------------------------------------------------------------------


def _damage_cases(prefix):
    """(section, entry, value, the message after 'PREFIX.idx: ') for each kind of bad entry."""
    lengths, pointers, _ = arrays(prefix)
    bin_size = os.path.getsize(prefix + ".bin")
    p5, p4, l4 = int(pointers[5]), int(pointers[4]), int(lengths[4])
    return {
        "negative length": ("length", 0, -100,
                            "sequence 0 has length -100 (lengths must be >= 0)"),
        "pointer decreases": ("pointer", 5, 0,
                              f"sequence 5 starts at byte 0, before sequence 4 (byte {p4}; "
                              "pointers must not decrease)"),
        "pointer inconsistent with lengths": (
            "pointer", 5, p5 + 2,
            f"sequence 5 starts at byte {p5 + 2}, but sequence 4 ends at byte {p5} (its "
            f"pointer {p4} + length {l4} x 2 bytes; each sequence must start where the "
            "previous one ends)"),
        "pointer past the .bin": ("pointer", 5, 10 ** 9,
                                  f"sequence 5 starts at byte 1000000000, past the end of "
                                  f"{prefix}.bin ({bin_size} bytes; sequences must lie inside "
                                  "the .bin)"),
        "negative pointer": ("pointer", 7, -8,
                             "sequence 7 starts at byte -8 (pointers must be >= 0)"),
        "first pointer not 0": ("pointer", 0, 2,
                                "sequence 0 starts at byte 2 (the first sequence must start "
                                "at byte 0)"),
        "doc_idx out of range": ("doc_idx", 5, 10 ** 6,
                                 f"doc_idx entry 5 is 1000000, outside 0..{DOCS} (document "
                                 f"starts must be sequence numbers of this index, which has "
                                 f"{DOCS})"),
        "doc_idx negative": ("doc_idx", 9, -1,
                             f"doc_idx entry 9 is -1, outside 0..{DOCS} (document starts must "
                             f"be sequence numbers of this index, which has {DOCS})"),
        "doc_idx not monotone": ("doc_idx", 5, 1,
                                 "doc_idx entry 5 is 1, less than entry 4, which is 4 "
                                 "(document starts must not decrease)"),
        "doc_idx not starting at 0": ("doc_idx", 0, 3,
                                      "doc_idx entry 0 is 3 (the first document must start at "
                                      "sequence 0)"),
        "doc_idx not ending at N": ("doc_idx", DOCS, DOCS - 1,
                                    f"doc_idx entry {DOCS} (the last) is {DOCS - 1}, but the "
                                    f"index has {DOCS} sequences (the last entry must be "
                                    f"{DOCS})"),
    }


DAMAGE_KINDS = [
    "negative length", "pointer decreases", "pointer inconsistent with lengths",
    "pointer past the .bin", "negative pointer", "first pointer not 0", "doc_idx out of range",
    "doc_idx negative", "doc_idx not monotone", "doc_idx not starting at 0",
    "doc_idx not ending at N"]


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_a_bad_index_entry_is_one_line_before_the_model(dataset, capsys, kind):
    section, entry, value, message = _damage_cases(dataset)[kind]
    poke(dataset, section, entry, value)
    expected = f"{dataset}.idx: {message}{REBUILD}"
    with pytest.raises(ConfigError) as info:
        check_dataset(dataset)
    assert str(info.value) == expected
    code, out, err = train_on(dataset, capsys)
    assert code == 2 and one_error_line(err) == f"error: {expected}"
    assert MODEL_BUILT not in out


def test_negative_first_length_with_intact_header_and_last_entry(dataset):
    """The case that trained silently: the .bin size check passes, megatron.core would read
    document 0 with a negative length (a slice of the whole .bin)."""
    poke(dataset, "length", 0, -100)
    assert data_files.expected_bin_size(dataset + ".idx") == os.path.getsize(dataset + ".bin")
    with pytest.raises(ConfigError, match=r"sequence 0 has length -100 \(lengths must be >= 0\)"):
        check_dataset(dataset)


def test_more_bad_entries_are_counted(dataset):
    for entry in (3, 10, 200):
        poke(dataset, "length", entry, -1)
    with pytest.raises(ConfigError, match=r"sequence 3 has length -1 \(lengths must be >= 0; "
                                          r"2 more negative length\(s\) after it\)"):
        check_dataset(dataset)


@pytest.mark.parametrize("section,entry", [("length", 5), ("length", 14), ("pointer", 7),
                                           ("pointer", 14), ("doc_idx", 14), ("doc_idx", 21)])
def test_chunk_boundaries_do_not_hide_a_bad_entry(dataset, monkeypatch, section, entry):
    """The checks run in chunks: with 7 entries per chunk an intact index passes and a bad
    entry inside a chunk (5) or first in one (7, 14, 21) is found with the right number."""
    monkeypatch.setattr(data_files, "CHUNK", 7)
    assert check_dataset(dataset, NullTokenizer(512)) == []
    lengths, pointers, doc_idx = arrays(dataset)
    value, message = {
        "length": (-3, f"sequence {entry} has length -3 (lengths must be >= 0)"),
        "pointer": (int(pointers[entry]) + 2,
                    f"sequence {entry} starts at byte {int(pointers[entry]) + 2}, but sequence "
                    f"{entry - 1} ends at byte {int(pointers[entry])}"),
        "doc_idx": (1, f"doc_idx entry {entry} is 1, less than entry {entry - 1}, which is "
                       f"{entry - 1}"),
    }[section]
    poke(dataset, section, entry, value)
    with pytest.raises(ConfigError) as info:
        check_dataset(dataset)
    assert str(info.value).startswith(f"{dataset}.idx: {message}")


def _write_index(prefix, lengths, code=8):
    """An index of len(lengths) one-sequence documents and a matching (sparse) .bin."""
    n = len(lengths)
    item = data_files.DTYPE_SIZES[code]
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * item, out=pointers[1:])
    with open(prefix + ".idx", "wb") as f:
        f.write(data_files.INDEX_HEADER + struct.pack("<QBQQ", 1, code, n, n + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(pointers[-1]) + int(lengths[-1]) * item)


def test_a_million_documents_are_checked_in_well_under_a_second(tmp_path):
    """Vectorised: about 10 ms per million documents on 2 CPU cores (README)."""
    prefix = str(tmp_path / "big")
    lengths = np.random.default_rng(1).integers(1, 50, size=1_000_000)
    _write_index(prefix, lengths)
    code, n, d = data_files.index_counts(prefix + ".idx")
    start = time.perf_counter()
    data_files.check_index_entries(prefix + ".idx", prefix + ".bin", code, n, d,
                                   os.path.getsize(prefix + ".bin"))
    assert time.perf_counter() - start < 1.0
    # The bad entry near the end is still found.
    with open(prefix + ".idx", "r+b") as f:
        f.seek(HEADER_BYTES + 4 * 999_990)
        f.write(struct.pack("<i", -7))
    with pytest.raises(ConfigError, match="sequence 999990 has length -7"):
        check_dataset(prefix)


# ---------------------------------------------------------------------------------------------
# Token ids vs the run's vocabulary
# ---------------------------------------------------------------------------------------------


def _first_token_at_or_above(prefix, limit):
    """(sequence, id) of the first token >= limit, the slow obvious way."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    for i in range(len(ds)):
        seq = ds[i]
        bad = np.flatnonzero(seq >= limit)
        if bad.size:
            return i, int(seq[bad[0]])
    raise AssertionError("no such token")


def test_ids_above_the_vocabulary_found_by_scanning(dataset, capsys):
    """No sidecar: the .bin is scanned; the line names the sequence, the id, the range."""
    assert not os.path.exists(dataset + ".json")
    sequence, value = _first_token_at_or_above(dataset, 257)
    expected = (f"error: {dataset}.bin: sequence {sequence} holds token id {value}, outside the "
                "run's vocabulary (0..256: NullTokenizer (--vocab-size 256: 257 ids)); ids in "
                "the file: 0..510; train with the tokenizer the data was built with, or rebuild "
                "the data with this one (tools/preprocess_data.py)")
    code, out, err = train_on(dataset, capsys, vocab=256)
    assert code == 2 and one_error_line(err) == expected and MODEL_BUILT not in out


def test_an_id_in_the_last_token_is_found(tmp_path):
    prefix = build_dataset(str(tmp_path / "d"), [[1, 2, 3], [4, 5, 600]])
    with pytest.raises(ConfigError, match=r"d\.bin: sequence 1 holds token id 600, outside "
                                          r"the run's vocabulary \(0\.\.512"):
        check_dataset(prefix, NullTokenizer(512))
    assert check_dataset(prefix, NullTokenizer(600)) == []


def test_negative_ids_of_a_signed_dtype_are_found(tmp_path):
    prefix = build_dataset(str(tmp_path / "d"), [[1, 2, 3], [4, -5, 6]], dtype=np.int32)
    with pytest.raises(ConfigError, match=r"sequence 1 holds token id -5, .* ids in the file: "
                                          r"-5\.\.6"):
        check_dataset(prefix, NullTokenizer(512))


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _preprocess_null(tmp_path, texts, vocab, name="ids", *extra):
    src = _jsonl(tmp_path / f"{name}.jsonl", texts)
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / name),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                               *extra])
    assert rc == 0
    return str(tmp_path / f"{name}_text_document")


def _doc_texts(rng, count, high):
    return [" ".join(str(int(i)) for i in rng.integers(0, high, size=int(rng.integers(20, 120))))
            for _ in range(count)]


def test_ids_above_the_vocabulary_found_in_the_sidecar(tmp_path, capsys, monkeypatch):
    """Built with NullTokenizer --vocab-size 1000 (eod 1000), trained with 512: the sidecar
    says so without scanning the .bin."""
    prefix = _preprocess_null(tmp_path, _doc_texts(np.random.default_rng(2), 200, 1000), 1000,
                              "ids", "--append-eod")
    capsys.readouterr()
    sidecar = json.loads(open(prefix + ".json").read())
    assert sidecar["max_token_id"] == 1000 and sidecar["vocab_size"] == 1001
    monkeypatch.setattr(data_files, "scan_token_range", _no_scan)
    expected = (f"error: {prefix}.json records token ids up to 1000, outside the run's "
                "vocabulary (0..512: NullTokenizer (--vocab-size 512: 513 ids)); the data was "
                "tokenized with NullTokenizer (--vocab-size 1000: 1001 ids): train with "
                "--tokenizer-type NullTokenizer --vocab-size 1000")
    code, out, err = train_on(prefix, capsys, vocab=512)
    assert code == 2 and one_error_line(err) == expected and MODEL_BUILT not in out


def _no_scan(*args, **kwargs):
    raise AssertionError("the .bin was scanned although a sidecar describes it")


def _lying_sidecar(tmp_path):
    """Data with ids up to 999 built with NullTokenizer --vocab-size 1000, whose sidecar was
    edited to record a largest id of 100 made with --vocab-size 512 (the run's tokenizer)."""
    prefix = _preprocess_null(tmp_path, _doc_texts(np.random.default_rng(3), 200, 1000), 1000)
    sidecar = json.loads(open(prefix + ".json").read())
    sidecar["max_token_id"] = 100
    sidecar["vocab_size"] = 513
    sidecar["tokenizer"] = {"type": "NullTokenizer", "vocab_size": 513, "eod": 512}
    with open(prefix + ".json", "w") as f:
        json.dump(sidecar, f)
    return prefix


def test_a_sidecar_that_hides_ids_outside_the_vocabulary_is_one_line(tmp_path, capsys):
    """The run's embedding has 640 rows (513 padded): ids up to 999 were an IndexError in the
    embedding at the first step, the sidecar's record trusted."""
    prefix = _lying_sidecar(tmp_path)
    capsys.readouterr()
    code, out, err = train_on(prefix, capsys, vocab=512)
    line = one_error_line(err)
    assert code == 2 and MODEL_BUILT not in out and "lm loss" not in out
    assert line.startswith(f"error: {prefix}.bin: sequence 0 holds token id "), line
    assert line.endswith(", although its sidecar ids_text_document.json records ids up to 100: "
                         "the sidecar is wrong; rebuild it with tools/preprocess_data.py"), line
    assert "outside the run's vocabulary (0..512: NullTokenizer (--vocab-size 512: 513 ids)); " \
           "ids in the file: 0..999" in line


def test_a_wrong_sidecar_of_a_bin_too_large_to_scan_stops_at_the_first_batch(
        tmp_path, capsys, monkeypatch):
    """Above SIDECAR_VERIFY_BYTES the record is trusted at start; the training loop checks
    every batch's ids: one line, exit code 1, no traceback, no step taken."""
    prefix = _lying_sidecar(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(data_files, "SIDECAR_VERIFY_BYTES", 0)
    code, out, err = train_on(prefix, capsys, vocab=512)
    line = one_error_line(err)
    assert code == 1 and "lm loss" not in out
    assert re.fullmatch(r"error: the training data holds token id \d+, outside the run's "
                        r"vocabulary \(0\.\.512\): the sidecar \(PREFIX\.json\) of a "
                        r"--data-path dataset too large to scan at start records a smaller "
                        r"largest id; .*", line), line


def test_a_sidecar_that_overstates_the_largest_id_warns(tmp_path):
    prefix = _preprocess_null(tmp_path, ["1 2 3", "4 5"], 600)
    sidecar = json.loads(open(prefix + ".json").read())
    sidecar["max_token_id"] = 7
    with open(prefix + ".json", "w") as f:
        json.dump(sidecar, f)
    lines = check_dataset(prefix, NullTokenizer(600))
    assert lines == [f"warning: {prefix}.json records token ids up to 7, but {prefix}.bin holds "
                     "ids up to 5: the sidecar is wrong (every id fits this run's vocabulary, "
                     "so training goes on); rewrite it: python tools/preprocess_data.py "
                     "--write-sidecar PREFIX <tokenizer flags>"]


def test_a_stale_sidecar_is_ignored_and_the_bin_scanned(tmp_path):
    prefix = _preprocess_null(tmp_path, ["1 2 3", "4 5"], 600)
    build_dataset(prefix, [[1, 2, 3], [4, 5, 599], [7]])        # other files, same prefix
    lines = check_dataset(prefix, NullTokenizer(600))
    assert len(lines) == 1 and lines[0].startswith(f"note: ignoring {prefix}.json: it "
                                                   "describes other files (10 bytes, 2 sequences")
    with pytest.raises(ConfigError, match="sequence 1 holds token id 599"):
        check_dataset(prefix, NullTokenizer(512))


@pytest.mark.parametrize("content,reason", [
    ("{not json", "unreadable"),
    ('{"some": "other tool"}', "not a megatron-lowp indexed dataset sidecar"),
    ('{"format": "megatron-lowp indexed dataset", "version": 1}', "a damaged sidecar"),
])
def test_a_foreign_or_damaged_sidecar_is_ignored(dataset, content, reason):
    with open(dataset + ".json", "w") as f:
        f.write(content)
    lines = check_dataset(dataset, NullTokenizer(512))
    assert len(lines) == 1 and lines[0].startswith(f"note: ignoring {dataset}.json (")
    assert reason in lines[0]
    with pytest.raises(ConfigError, match="holds token id"):           # the scan still runs
        check_dataset(dataset, NullTokenizer(256))


def test_a_big_bin_without_sidecar_says_it_was_scanned(dataset, monkeypatch):
    monkeypatch.setattr(data_files, "SCAN_NOTE_BYTES", 1000)
    lines = check_dataset(dataset, NullTokenizer(512))
    assert len(lines) == 1 and lines[0].startswith(f"note: {dataset} has no sidecar "
                                                   "corpus_text_document.json")
    assert "scanned its .bin" in lines[0] and "--write-sidecar" in lines[0]


def test_write_sidecar_for_an_existing_dataset(dataset, capsys, monkeypatch):
    assert preprocess_data.main(["--write-sidecar", dataset, "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", "256"]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err).startswith(f"error: --write-sidecar {dataset}: {dataset}.bin "
                                          "holds token id 510, outside the vocabulary of "
                                          "NullTokenizer (0..256)")
    assert not os.path.exists(dataset + ".json")
    assert preprocess_data.main(["--write-sidecar", dataset, "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", "512"]) == 0
    sidecar = json.loads(open(dataset + ".json").read())
    assert sidecar["max_token_id"] == 510 and sidecar["tokenizer"]["type"] == "NullTokenizer"
    assert check_dataset(dataset, NullTokenizer(512)) == []      # verified by a scan
    monkeypatch.setattr(data_files, "SIDECAR_VERIFY_BYTES", 0)
    monkeypatch.setattr(data_files, "scan_token_range", _no_scan)
    assert check_dataset(dataset, NullTokenizer(512)) == []      # trusted above the size


# ---------------------------------------------------------------------------------------------
# The tokenizer the data was built with vs the run's
# ---------------------------------------------------------------------------------------------


def test_a_null_tokenizer_mismatch_warns_and_trains(tmp_path, capsys):
    """Built with --vocab-size 600, trained with 512: the ids fit, the eod does not match."""
    # Without --append-eod: the eod 600 would not fit a 513-id vocabulary (an error, tested
    # above); here only the warning remains.
    prefix = _preprocess_null(tmp_path, _doc_texts(np.random.default_rng(3), 200, 512), 600,
                              "noeod")
    capsys.readouterr()
    code, out, err = train_on(prefix, capsys, vocab=512)
    assert code == 0 and "exiting at iteration 1" in out, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")
                and "tokenized with" in line]
    assert warnings == [
        f"warning: {prefix} was tokenized with NullTokenizer (--vocab-size 600: 601 ids) but "
        "this run uses NullTokenizer (--vocab-size 512: 513 ids): its token ids stand for "
        "other text; train with --tokenizer-type NullTokenizer --vocab-size 600"]
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A 300-entry byte-level BPE (tools/train_tokenizer.py's trainer) saved as tokenizer.json
    beside the data it tokenized with tools/preprocess_data.py."""
    from megatron.training import bpe_tokenizer

    root = tmp_path_factory.mktemp("bpe")
    texts = [f"The {w} of the {v} is a {w} of {v} number {i}." for i in range(40)
             for w, v in (("capital", "country"), ("river", "valley"))]
    tokenizer = bpe_tokenizer.train_bpe(texts, 300)
    path = bpe_tokenizer.save_tokenizer(tokenizer, root / "tokenizer.json")
    src = _jsonl(root / "docs.jsonl", texts)
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(root / "docs"),
                                 "--tokenizer-type", "HuggingFaceTokenizer",
                                 "--tokenizer-model", str(path), "--append-eod"]) == 0
    return str(root / "docs_text_document"), str(path)


@pytest.fixture(scope="module")
def llama3():
    return Llama3Tokenizer()


def test_hf_data_with_the_default_llama3_tokenizer_warns(bpe_data, llama3):
    prefix, tokenizer_json = bpe_data
    hf = HuggingFaceTokenizer(tokenizer_json)
    sidecar = json.loads(open(prefix + ".json").read())
    assert sidecar["tokenizer"]["sha256"] == hf.sha256 and sidecar["dtype"] == "uint16"
    assert check_dataset(prefix, hf) == []                        # the right tokenizer: quiet
    assert check_dataset(prefix, llama3) == [
        f"warning: {prefix} was tokenized with HuggingFaceTokenizer ({hf.vocab_size} ids, "
        f"sha256 {hf.sha256[:12]}) but this run uses Llama3Tokenizer (128256 ids, sha256 "
        f"{llama3.sha256[:12]}): its token ids stand for other text; train with "
        f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer_json}"]


def test_a_tokenizer_json_beside_data_without_sidecar_warns(bpe_data, tmp_path, llama3):
    prefix, tokenizer_json = bpe_data
    copy = str(tmp_path / "docs_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, copy + ext)
    beside = str(tmp_path / "tokenizer.json")
    shutil.copy(tokenizer_json, beside)
    expected = (f"warning: {beside} sits beside {copy} (no sidecar records the data's "
                "tokenizer) but this run uses Llama3Tokenizer (128256 ids, sha256 "
                f"{llama3.sha256[:12]}); if the data was tokenized with that file, train with "
                f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {beside}")
    assert check_dataset(copy, llama3) == [expected]
    assert check_dataset(copy, HuggingFaceTokenizer(beside)) == []
    # A sources.json naming this prefix (what the embedded corpora wrote before sidecars)
    # stands in for the sidecar.
    hf = HuggingFaceTokenizer(beside)
    with open(tmp_path / "sources.json", "w") as f:
        json.dump({"data_prefix": "docs_text_document", "tokenizer": {
            "type": "HuggingFaceTokenizer", "sha256": hf.sha256, "vocab_size": hf.vocab_size,
            "model": "tokenizer.json (byte-level BPE)"}}, f)
    lines = check_dataset(copy, llama3)
    assert lines == [f"warning: {copy} was tokenized with HuggingFaceTokenizer "
                     f"({hf.vocab_size} ids, sha256 {hf.sha256[:12]}) but this run uses "
                     f"Llama3Tokenizer (128256 ids, sha256 {llama3.sha256[:12]}): its token "
                     "ids stand for other text; train with --tokenizer-type "
                     f"HuggingFaceTokenizer --tokenizer-model {beside}"]


def test_llama3_data_with_a_small_bpe_is_refused(tmp_path, bpe_data):
    prefix = build_dataset(str(tmp_path / "wiki_text_document"), [[128000, 791, 6864, 128001]],
                           dtype=np.int32)
    _, tokenizer_json = bpe_data
    hf = HuggingFaceTokenizer(tokenizer_json)
    with pytest.raises(ConfigError, match=rf"sequence 0 holds token id 128000, outside the run's "
                                          rf"vocabulary \(0\.\.{hf.vocab_size - 1}: "
                                          r"HuggingFaceTokenizer \("):
        check_dataset(prefix, hf)


# ---------------------------------------------------------------------------------------------
# The project's own builders write sidecars
# ---------------------------------------------------------------------------------------------


def test_corpus_builders_write_sidecars(tmp_path, monkeypatch, llama3):
    """build_corpus.py's and train_tokenizer.py's code paths (corpora.build_into and
    _build_bpe_into, renamed into place like a real build) leave a sidecar next to the data;
    the BPE variant's points at the tokenizer.json beside it after the rename."""
    docs = [{"text": f"Document {i} talks about rivers, valleys and the {i}th capital.",
             "source": "s", "title": str(i)} for i in range(30)]
    monkeypatch.setattr(corpora, "collect_documents", lambda names, mail_dir, log: (
        [dict(d) for d in docs], [{"name": "wiki_leads", "kind": "k", "origin": "o",
                                   "license": "l", "documents": 30, "characters": 1}], []))
    root = tmp_path / "data"
    root.mkdir()
    corpora._replace_atomically(root, "mini", lambda tmp: corpora.build_into(
        tmp, "mini", ["wiki_leads"], log=lambda m: None))
    prefix = str(root / "mini" / "mini_text_document")
    sidecar = json.loads(open(prefix + ".json").read())
    assert sidecar["tokenizer"]["type"] == "Llama3Tokenizer" and sidecar["dtype"] == "int32"
    assert sidecar["max_token_id"] == llama3.eod and sidecar["append_eod"] is True
    assert check_dataset(prefix, llama3) == []
    with pytest.raises(ConfigError, match=r"mini_text_document\.json records token ids up to "
                                          r"128001, outside the run's vocabulary \(0\.\.512"):
        check_dataset(prefix, NullTokenizer(512))

    corpora._replace_atomically(root, "mini-bpe300", lambda tmp: corpora._build_bpe_into(
        tmp, "mini", 300, root / "mini", 1, lambda m: None))
    bpe_prefix = str(root / "mini-bpe300" / "mini_text_document")
    tokenizer_json = str(root / "mini-bpe300" / "tokenizer.json")
    sidecar = json.loads(open(bpe_prefix + ".json").read())
    assert sidecar["tokenizer"]["type"] == "HuggingFaceTokenizer"
    assert ".building-" in sidecar["tokenizer"]["model"]         # where it was built ...
    lines = check_dataset(bpe_prefix, llama3)                   # ... found beside the data
    assert len(lines) == 1 and lines[0].endswith(
        f"train with --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer_json}")
    assert check_dataset(bpe_prefix, HuggingFaceTokenizer(tokenizer_json)) == []


# ---------------------------------------------------------------------------------------------
# tools/preprocess_data.py: dtype and ids outside the vocabulary
# ---------------------------------------------------------------------------------------------


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds.index.dtype, [ds[i].tolist() for i in range(len(ds))]


def test_ids_above_65535_are_written_as_int32_and_round_trip(tmp_path):
    prefix = _preprocess_null(tmp_path, ["65535 65536 70000", "1 69999"], 70000, "wide",
                              "--append-eod")
    dtype, docs = _read(prefix)
    assert dtype == np.int32
    assert docs == [[65535, 65536, 70000, 70000], [1, 69999, 70000]]
    sidecar = json.loads(open(prefix + ".json").read())
    assert (sidecar["dtype"], sidecar["max_token_id"], sidecar["vocab_size"]) == (
        "int32", 70000, 70001)
    assert check_dataset(prefix, NullTokenizer(70000)) == []
    with pytest.raises(ConfigError, match="records token ids up to 70000"):
        check_dataset(prefix, NullTokenizer(65535))


def test_a_65536_id_vocabulary_is_uint16(tmp_path):
    """Every id < 65536 fits uint16 (megatron.core's own rule switches at 65,500)."""
    prefix = _preprocess_null(tmp_path, ["65534 65500 0"], 65535, "edge", "--append-eod")
    dtype, docs = _read(prefix)
    assert dtype == np.uint16 and docs == [[65534, 65500, 0, 65535]]
    assert preprocess_data.optimal_dtype(65536) is np.uint16
    assert preprocess_data.optimal_dtype(65537) is np.int32


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_id_outside_the_vocabulary_names_the_line(tmp_path, capsys, workers):
    src = _jsonl(tmp_path / "ids.jsonl", ["1 2 3", "4 5", "6 1001 7", "8"])
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "out"),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                               "--workers", workers])
    assert rc == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {src}:3: token id 1001 is outside the tokenizer's vocabulary (0..1000, "
        "NullTokenizer with 1001 ids); ids up to 1001 need --vocab-size 1002 or more; fix the "
        "line or pass --skip-bad-lines")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.jsonl"]  # nothing written


def test_ids_that_would_overflow_are_refused_not_a_traceback(tmp_path, capsys):
    src = _jsonl(tmp_path / "ids.jsonl", ["1 2", "3 70000", "-4", "5 " + "9" * 30])
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "out"),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                               "--skip-bad-lines"])
    out, err = capsys.readouterr()
    assert rc == 0 and "3 bad lines skipped" in out and "Traceback" not in out + err
    assert _read(str(tmp_path / "out_text_document"))[1] == [[1, 2]]
    for line, bad in ((2, "70000"), (3, "-4"), (4, "9" * 30)):
        single = _jsonl(tmp_path / f"l{line}.jsonl", [["3 70000", "-4", "5 " + "9" * 30][line - 2]])
        assert preprocess_data.main(["--input", str(single), "--output-prefix",
                                     str(tmp_path / "x"), "--tokenizer-type", "NullTokenizer",
                                     "--vocab-size", "1000"]) == 2
        assert one_error_line(capsys.readouterr().err).startswith(
            f"error: {single}:1: token id {bad} is outside the tokenizer's vocabulary (0..1000")
