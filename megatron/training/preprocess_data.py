"""Tokenize a JSON-lines corpus into Megatron's indexed dataset format (.bin/.idx).

Each input line is a JSON object; the text under every --json-keys key (default "text") is
tokenized and written with megatron.core's IndexedDatasetBuilder to
``{output_prefix}_{key}_document.bin`` / ``.idx`` (Megatron-LM's naming), which is the
``--data-path`` prefix for training. Example (from a checkout, or ``python -m
megatron.training.preprocess_data`` where the package is installed)::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --append-eod --workers 2        # -> data/corpus_text_document.{bin,idx}

Token ids are written as uint16 when the tokenizer's vocabulary has at most 65,536 ids (every
id < 65536), else as int32. A token id outside the tokenizer's vocabulary (a NullTokenizer
text with an id >= --vocab-size + 1, or a negative one) stops the run with one line naming the
input line (or skips the line with --skip-bad-lines).

Next to each ``.bin``/``.idx`` pair goes the sidecar ``{prefix}.json``
(megatron/training/data_files.py): the tokenizer's type, vocabulary size, eod and file sha256,
the largest token id written and the sizes of the files it describes. Training compares it with
its own tokenizer at start. ``--write-sidecar PREFIX`` writes one for an existing dataset (built
by another tool or before sidecars existed): it checks the files, scans the ``.bin`` for its
largest id and records the given tokenizer.

Outputs are written under temporary names and renamed only after the index is complete, so a
killed run never leaves a .bin/.idx pair that looks finished.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from megatron.training import data_files
from megatron.training.errors import ConfigError
from megatron.training.tokenizer import TokenizerError, add_tokenizer_args, build_tokenizer

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_size")


class PreprocessError(ValueError):
    """Bad input or options; the message names the file/line or flag and the fix."""


@dataclass
class PreprocessResult:
    """What a run wrote: counts per json key and the output --data-path prefixes."""

    documents: int = 0          # input documents (JSON lines) read successfully
    tokens: int = 0             # tokens written over all keys (incl. eod)
    empty: int = 0              # (document, key) texts skipped because they were empty
    bad_lines: int = 0          # malformed lines skipped (--skip-bad-lines)
    input_bytes: int = 0
    seconds: float = 0.0
    written: Dict[str, int] = field(default_factory=dict)   # key -> documents written
    outputs: Dict[str, str] = field(default_factory=dict)   # key -> output prefix
    max_token_id: Dict[str, int] = field(default_factory=dict)  # key -> largest id written
    sidecars: Dict[str, str] = field(default_factory=dict)  # key -> {prefix}.json


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Tokenize JSON lines into Megatron .bin/.idx files.", allow_abbrev=False)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, default=None,
                       help="Path to the input JSON-lines file (one JSON object per line; "
                            "a .gz file is decompressed on the fly). Required unless "
                            "--write-sidecar.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Space-separated keys to extract from each JSON object; each key "
                            "gets its own output file.")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip (and count) malformed lines instead of stopping with an error.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, default=None,
                       help="Path prefix of the outputs, without suffix: writes "
                            "{prefix}_{key}_document.bin, .idx and .json (the sidecar recording "
                            "the tokenizer and the largest token id). Required unless "
                            "--write-sidecar.")
    group.add_argument("--write-sidecar", type=str, default=None, metavar="PREFIX",
                       help="Instead of tokenizing: write PREFIX.json for the existing dataset "
                            "PREFIX.bin/.idx (the --data-path prefix), recording the tokenizer "
                            "given by the tokenizer flags (the one the data was built with) and "
                            "the largest token id, found by scanning the .bin; training then "
                            "reads it instead of scanning at every start.")
    group.add_argument("--append-eod", action="store_true",
                       help="Append the end-of-document token to every document.")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="Number of tokenizer worker processes (1 = tokenize in-process).")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="Log progress every this many documents.")
    return parser


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: the --data-path prefix written for json key `key`."""
    return f"{output_prefix}_{key}_document"


# ---------------------------------------------------------------------------------------------
# Input and encoding (runs in worker processes when --workers > 1)
# ---------------------------------------------------------------------------------------------


def iter_input_lines(path: str) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, raw bytes) for each line of a (possibly gzipped) file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            yield line_no, line


class DocumentEncoder:
    """Turns one raw JSON line into token arrays (one per json key)."""

    def __init__(self, tokenizer_spec: Dict[str, object], json_keys: Sequence[str],
                 append_eod: bool):
        self.tokenizer = build_tokenizer(argparse.Namespace(**tokenizer_spec))
        self.vocab_size = int(self.tokenizer.vocab_size)
        self.dtype = optimal_dtype(self.vocab_size)
        self.json_keys = list(json_keys)
        self.append_eod = append_eod

    def encode(self, item: Tuple[int, bytes]):
        """(line_no, {key: (ids array, sentence lengths) or None if empty} or error, nbytes)."""
        line_no, raw = item
        if not raw.strip():
            return line_no, None, len(raw)
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return line_no, f"invalid JSON ({_short(exc)})", len(raw)
        if not isinstance(record, dict):
            return line_no, f"expected a JSON object, got {type(record).__name__}", len(raw)
        out = {}
        for key in self.json_keys:
            if key not in record:
                return line_no, (f"missing key {key!r} (keys: {', '.join(map(str, record))}); "
                                 "choose keys with --json-keys"), len(raw)
            value = record[key]
            sentences = [value] if isinstance(value, str) else value
            if not (isinstance(sentences, list) and all(isinstance(s, str) for s in sentences)):
                return line_no, (f"key {key!r} holds {type(value).__name__}, expected a string "
                                 "or a list of strings"), len(raw)
            try:
                pieces = [self.tokenizer.tokenize(s) for s in sentences if s.strip()]
            except TokenizerError as exc:
                return line_no, (f"key {key!r}: {exc}" if len(self.json_keys) > 1
                                 else str(exc)), len(raw)
            pieces = [p for p in pieces if p]
            if not pieces:
                out[key] = None
                continue
            if self.append_eod:
                pieces[-1] = pieces[-1] + [self.tokenizer.eod]
            ids, problem = self._checked_ids(pieces)
            if problem is not None:
                return line_no, (f"key {key!r}: {problem}" if len(self.json_keys) > 1
                                 else problem), len(raw)
            out[key] = (ids, [len(p) for p in pieces])
        return line_no, out, len(raw)

    def _checked_ids(self, pieces: List[List[int]]):
        """(ids as self.dtype, None), or (None, why) when an id is outside the vocabulary
        (checked before the cast: a uint16 cast would wrap or overflow)."""
        count = sum(map(len, pieces))
        try:
            ids = numpy.fromiter((i for p in pieces for i in p), dtype=numpy.int64, count=count)
        except OverflowError:  # an id beyond int64: find it in Python
            bad = next(i for p in pieces for i in p if not -2**63 <= i < 2**63)
            return None, self._outside(bad)
        if count and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            return None, self._outside(bad)
        return ids.astype(self.dtype), None

    def _outside(self, token_id: int) -> str:
        hint = ""
        if self.tokenizer.name == "NullTokenizer" and 0 <= token_id < 2**31 - 1:
            hint = f"; ids up to {token_id} need --vocab-size {token_id + 1} or more"
        return (f"token id {token_id} is outside the tokenizer's vocabulary "
                f"(0..{self.vocab_size - 1}, {self.tokenizer.name} with {self.vocab_size} ids)"
                f"{hint}")


def _short(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    return str(exc).splitlines()[0][:200]


def _indexed_dataset():
    # megatron.core warns at import that TE/Apex are missing; irrelevant for writing files.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def optimal_dtype(vocab_size: int):
    """uint16 when every id fits (a vocabulary of at most 65,536 ids), else int32; both are
    megatron.core DType codes (8 and 4). megatron.core's own DType.optimal_dtype switches at
    65,500 and is not used: ids 65,500..65,535 fit uint16 as well."""
    if vocab_size is not None and int(vocab_size) <= 1 << 16:
        return numpy.uint16
    return numpy.int32


_WORKER_ENCODER: Optional[DocumentEncoder] = None


def _init_worker(tokenizer_spec, json_keys, append_eod) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = DocumentEncoder(tokenizer_spec, json_keys, append_eod)


def _encode_in_worker(item):
    return _WORKER_ENCODER.encode(item)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


class _AtomicIndexedWriter:
    """An IndexedDatasetBuilder writing to temporary names; commit() renames .bin, the
    sidecar .json, then .idx."""

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        suffix = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = prefix + ".bin" + suffix, prefix + ".idx" + suffix
        self.tmp_json = data_files.sidecar_path(prefix) + suffix
        self.builder = _indexed_dataset().IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0
        self.max_token_id = -1

    def add(self, ids, lengths) -> None:
        self.builder.add_document(ids, lengths)
        self.documents += 1
        self.tokens += int(ids.size)
        self.max_token_id = max(self.max_token_id, int(ids.max()))

    def commit(self, tokenizer, append_eod: bool, source: str) -> None:
        self.builder.finalize(self.tmp_idx)
        sidecar = data_files.build_sidecar(
            self.prefix, tokenizer, self.max_token_id, bin_path=self.tmp_bin,
            idx_path=self.tmp_idx, tokens=self.tokens, append_eod=append_eod, source=source)
        data_files.write_sidecar(self.tmp_json, sidecar, atomic=False)  # renamed below
        final_bin, final_idx = self.prefix + ".bin", self.prefix + ".idx"
        # The .idx is renamed last: an old .idx must not pair with a new .bin meanwhile (and
        # a sidecar records the sizes of the files it describes, so an old one is ignored).
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self.tmp_bin, final_bin)
        os.replace(self.tmp_json, data_files.sidecar_path(self.prefix))
        os.replace(self.tmp_idx, final_idx)

    def abort(self) -> None:
        try:
            self.builder.data_file.close()
        except Exception:
            pass
        for path in (self.tmp_bin, self.tmp_idx, self.tmp_json):
            if os.path.exists(path):
                os.remove(path)


def _pool_context():
    """forkserver where available: the workers are forked from a fresh server process, not
    from the caller, whose state may not survive a fork (a process that has run torch.compile
    kernels or holds threads can crash in a forked child's garbage collection); the server
    imports this module once, so workers still start without re-importing it each."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        return context
    return multiprocessing.get_context()


def _tokenizer_spec(tokenizer_args) -> Dict[str, object]:
    source = tokenizer_args if isinstance(tokenizer_args, dict) else vars(tokenizer_args)
    return {name: source.get(name) for name in TOKENIZER_FIELDS}


def preprocess(input_path: str, output_prefix: str, tokenizer_args, json_keys=("text",),
               append_eod: bool = False, workers: int = 1, log_interval: int = 1000,
               skip_bad_lines: bool = False, chunksize: int = 64, log=print) -> PreprocessResult:
    """Tokenize `input_path` into {output_prefix}_{key}_document.{bin,idx}; see the module doc.

    `tokenizer_args` is a namespace or dict with tokenizer_type, tokenizer_model, vocab_size.
    """
    if not os.path.isfile(input_path):
        raise PreprocessError(f"--input {input_path}: file not found; pass an existing "
                              "JSON-lines file (.jsonl or .jsonl.gz)")
    if workers < 1:
        raise PreprocessError(f"--workers {workers}: must be at least 1")
    if log_interval < 1:
        raise PreprocessError(f"--log-interval {log_interval}: must be at least 1")
    json_keys = list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise PreprocessError(f"--json-keys {' '.join(json_keys)}: give one or more distinct keys")
    spec = _tokenizer_spec(tokenizer_args)
    encoder = DocumentEncoder(spec, json_keys, append_eod)  # also validates the tokenizer early
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    result = PreprocessResult()
    log(f"[preprocess] {input_path} -> {output_prefix}_{{{','.join(json_keys)}}}_document "
        f"with {encoder.tokenizer.name} (vocab {encoder.tokenizer.vocab_size}, dtype "
        f"{numpy.dtype(encoder.dtype).name}), {workers} worker(s)")
    writers = {key: _AtomicIndexedWriter(output_prefix_for(output_prefix, key), encoder.dtype)
               for key in json_keys}
    start = time.perf_counter()
    pool = None
    try:
        lines = iter_input_lines(input_path)
        if workers == 1:
            encoded = map(encoder.encode, lines)
        else:
            pool = _pool_context().Pool(workers, initializer=_init_worker,
                                        initargs=(spec, json_keys, append_eod))
            encoded = pool.imap(_encode_in_worker, lines, chunksize)
        for line_no, doc, nbytes in encoded:
            result.input_bytes += nbytes
            if doc is None:  # blank line
                continue
            if isinstance(doc, str):
                if not skip_bad_lines:
                    raise PreprocessError(f"{input_path}:{line_no}: {doc}; fix the line or pass "
                                          "--skip-bad-lines")
                result.bad_lines += 1
                continue
            result.documents += 1
            for key, item in doc.items():
                if item is None:
                    result.empty += 1
                    continue
                writers[key].add(*item)
                result.tokens += int(item[0].size)
            if result.documents % log_interval == 0:
                elapsed = max(time.perf_counter() - start, 1e-9)
                log(f"[preprocess] {result.documents} documents "
                    f"({result.documents / elapsed:.0f} docs/s, "
                    f"{result.input_bytes / elapsed / 1e6:.2f} MB/s)")
        for writer in writers.values():
            writer.commit(encoder.tokenizer, append_eod, os.path.basename(input_path))
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    result.seconds = time.perf_counter() - start
    result.written = {key: w.documents for key, w in writers.items()}
    result.outputs = {key: w.prefix for key, w in writers.items()}
    result.max_token_id = {key: w.max_token_id for key, w in writers.items()}
    result.sidecars = {key: data_files.sidecar_path(w.prefix) for key, w in writers.items()}
    outputs = ", ".join(f"{p}.bin/.idx/.json" for p in result.outputs.values())
    log(f"[preprocess] done: {result.documents} documents, {result.tokens} tokens, "
        f"{result.empty} empty skipped, {result.bad_lines} bad lines skipped, "
        f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f} s "
        f"({result.input_bytes / max(result.seconds, 1e-9) / 1e6:.2f} MB/s) -> {outputs}")
    return result


def write_sidecar_for(prefix: str, tokenizer_args, log=print) -> str:
    """Write PREFIX.json for the existing dataset PREFIX.bin/.idx: the files are checked
    entry by entry, the .bin is scanned for its largest token id, which must fit the given
    tokenizer (the one the data was built with). Returns the sidecar path."""
    for path in (prefix + ".bin", prefix + ".idx"):
        if not os.path.isfile(path):
            raise PreprocessError(f"--write-sidecar {prefix}: {path} not found; pass the "
                                  "prefix of an existing dataset (PREFIX.bin and PREFIX.idx)")
    tokenizer = build_tokenizer(argparse.Namespace(**_tokenizer_spec(tokenizer_args)))
    start = time.perf_counter()
    data_files.check_dataset(prefix)          # intact index, .bin of the right size
    code, sequences, documents = data_files.index_counts(prefix + ".idx")
    bin_size = os.path.getsize(prefix + ".bin")
    low, high = data_files.scan_token_range(prefix + ".bin", code, bin_size)
    if low < 0 or high >= tokenizer.vocab_size:
        bad = low if low < 0 else high
        raise PreprocessError(
            f"--write-sidecar {prefix}: {prefix}.bin holds token id {bad}, outside the "
            f"vocabulary of {tokenizer.name} (0..{tokenizer.vocab_size - 1}): the data was not "
            "built with this tokenizer; pass the tokenizer flags it was built with")
    content = data_files.build_sidecar(prefix, tokenizer, high, source="--write-sidecar")
    path = data_files.write_sidecar(data_files.sidecar_path(prefix), content)
    log(f"[preprocess] {path}: {tokenizer.name} ({tokenizer.vocab_size} ids), token ids "
        f"{max(low, 0)}..{high}, {sequences} sequences; scanned {bin_size / 1e6:.1f} MB in "
        f"{time.perf_counter() - start:.2f} s")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; returns the exit code (2 with a one-line error on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write_sidecar is None:
        missing = [flag for flag, value in (("--input", args.input),
                                            ("--output-prefix", args.output_prefix))
                   if value is None]
        if missing:
            parser.error(f"the following arguments are required: {', '.join(missing)} "
                         "(or --write-sidecar PREFIX)")
    elif args.input is not None or args.output_prefix is not None:
        parser.error("--write-sidecar PREFIX takes no --input or --output-prefix (it describes "
                     "an existing dataset)")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        if args.write_sidecar is not None:
            write_sidecar_for(args.write_sidecar, args, log=log)
            return 0
        preprocess(args.input, args.output_prefix, args, json_keys=args.json_keys,
                   append_eod=args.append_eod, workers=args.workers,
                   log_interval=args.log_interval, skip_bad_lines=args.skip_bad_lines, log=log)
    except (PreprocessError, TokenizerError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
