"""Tokenize a JSON-lines corpus into Megatron's indexed dataset format (.bin/.idx).

Each input line is a JSON object; the text under every --json-keys key (default "text") is
tokenized and written with megatron.core's IndexedDatasetBuilder to
``{output_prefix}_{key}_document.bin`` / ``.idx`` (Megatron-LM's naming), which is the
``--data-path`` prefix for training. Example (from a checkout, or ``python -m
megatron.training.preprocess_data`` where the package is installed)::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --append-eod --workers 2        # -> data/corpus_text_document.{bin,idx}

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


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Tokenize JSON lines into Megatron .bin/.idx files.", allow_abbrev=False)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to the input JSON-lines file (one JSON object per line; "
                            "a .gz file is decompressed on the fly).")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Space-separated keys to extract from each JSON object; each key "
                            "gets its own output file.")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip (and count) malformed lines instead of stopping with an error.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path prefix of the outputs, without suffix: writes "
                            "{prefix}_{key}_document.bin and .idx.")
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
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
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
            pieces = [self.tokenizer.tokenize(s) for s in sentences if s.strip()]
            pieces = [p for p in pieces if p]
            if not pieces:
                out[key] = None
                continue
            if self.append_eod:
                pieces[-1] = pieces[-1] + [self.tokenizer.eod]
            ids = numpy.fromiter((i for p in pieces for i in p), dtype=self.dtype,
                                 count=sum(map(len, pieces)))
            out[key] = (ids, [len(p) for p in pieces])
        return line_no, out, len(raw)


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
    return _indexed_dataset().DType.optimal_dtype(vocab_size)


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
    """An IndexedDatasetBuilder writing to temporary names; commit() renames .bin then .idx."""

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        suffix = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = prefix + ".bin" + suffix, prefix + ".idx" + suffix
        self.builder = _indexed_dataset().IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0

    def add(self, ids, lengths) -> None:
        self.builder.add_document(ids, lengths)
        self.documents += 1

    def commit(self) -> None:
        self.builder.finalize(self.tmp_idx)
        final_bin, final_idx = self.prefix + ".bin", self.prefix + ".idx"
        # The .idx is renamed last: an old .idx must not pair with a new .bin meanwhile.
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self.tmp_bin, final_bin)
        os.replace(self.tmp_idx, final_idx)

    def abort(self) -> None:
        try:
            self.builder.data_file.close()
        except Exception:
            pass
        for path in (self.tmp_bin, self.tmp_idx):
            if os.path.exists(path):
                os.remove(path)


def _pool_context():
    # fork, whatever start method the caller configured: workers start at once instead of
    # re-importing numpy, the tokenizer and megatron.core each.
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
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
            writer.commit()
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
    outputs = ", ".join(f"{p}.bin/.idx" for p in result.outputs.values())
    log(f"[preprocess] done: {result.documents} documents, {result.tokens} tokens, "
        f"{result.empty} empty skipped, {result.bad_lines} bad lines skipped, "
        f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f} s "
        f"({result.input_bytes / max(result.seconds, 1e-9) / 1e6:.2f} MB/s) -> {outputs}")
    return result


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; returns the exit code (2 with a one-line error on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args, json_keys=args.json_keys,
                   append_eod=args.append_eod, workers=args.workers,
                   log_interval=args.log_interval, skip_bad_lines=args.skip_bad_lines,
                   log=lambda msg: print(msg, flush=True))
    except (PreprocessError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
