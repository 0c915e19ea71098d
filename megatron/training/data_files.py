"""Checking indexed datasets (`PREFIX.bin` + `PREFIX.idx`) before anything is built.

megatron.core maps both files lazily: a truncated `.idx` fails inside numpy ("buffer is
smaller than requested size", then an AttributeError from the reader's `__del__`), a
truncated `.bin` only in a DataLoader worker once training has started ("offset must be
non-negative"), a damaged entry inside the index either trains silently on wrong data (a
negative length) or crashes when that document is sampled, and a token id at or above the
vocabulary crashes the embedding with an IndexError. `check_dataset_files` finds all of these
at start-up; each problem is one ConfigError line naming the file, the first bad entry and
its value, and what would be valid.

The `.idx` layout (megatron.core.datasets.indexed_dataset): the 9-byte header
`MMIDIDX\\x00\\x00`, version (<Q, 1), dtype code (<B), sequence count N (<Q), document count D
(<Q), then N int32 sequence lengths (in tokens), N int64 sequence pointers (byte offsets
into `.bin`) and D int64 document indices. megatron.core's writer always lays sequences out
back to back from byte 0, so pointer[i] = pointer[i-1] + length[i-1] x itemsize, and the
document indices run from 0 to N without decreasing. Every entry is checked, vectorised with
numpy over the memory-mapped index in chunks (no Python loop per document).

The sidecar `PREFIX.json` (written by tools/preprocess_data.py next to the .bin/.idx) records
the tokenizer the data was built with, its vocabulary size and the largest token id, plus the
file sizes it describes. At start the run compares the largest id with its own vocabulary
(one error line when an id would not fit) and the recorded tokenizer with its own (one
`warning:` line when they differ); the recorded id is checked against a scan of a `.bin` up
to SIDECAR_VERIFY_BYTES (a hand-edited or stale record must not let an id outside the
vocabulary reach the embedding), and above that the training loop checks every batch. Without
a sidecar the `.bin` is scanned for its largest id (chunked numpy), and a `tokenizer.json`
beside the data, or the directory's `sources.json` (the embedded corpora's record), stands in
for the tokenizer record. Every file read here must be a regular file (a FIFO would block the
reader, a device never end), the JSON ones small.
"""

from __future__ import annotations

import json
import os
import struct
import time
from typing import Dict, Iterable, List, Optional, Tuple

import numpy

from megatron.training.checkpoint_files import file_problem, read_small_file
from megatron.training.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# Bytes per token of each dtype code.
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
# numpy dtype of each code (megatron.core.datasets.indexed_dataset.DType).
DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
          6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
FLOAT_CODES = (6, 7)
REBUILD = "rebuild it with tools/preprocess_data.py"

# Entries (or tokens) per vectorised step: bounds the temporary memory to a few tens of MB
# whatever the corpus size.
CHUNK = 1 << 22

# The most a sidecar (or a corpus's sources.json) is read of: they record a few fields.
SIDECAR_BYTES = 1 << 24
SIDECAR_FORMAT = "megatron-lowp indexed dataset"
SIDECAR_VERSION = 1
# Without a sidecar the .bin is scanned; above this size a note line says so and how long.
SCAN_NOTE_BYTES = 1 << 30
# A sidecar's largest token id is checked against a scan of its .bin up to this size (about
# 0.1 s per GB from the page cache); above it the record is trusted, and the training loop
# checks every batch's ids against the vocabulary (training.checked_batches).
SIDECAR_VERIFY_BYTES = 1 << 30
SIDECAR_HINT = "python tools/preprocess_data.py --write-sidecar PREFIX <tokenizer flags>"


def _read_at(f, offset: int, fmt: str):
    f.seek(offset)
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def index_counts(idx_path: str):
    """(dtype code, sequences, documents) of an intact index; ConfigError (one line) if its
    header is damaged or the file is shorter than the header says."""
    actual = os.path.getsize(idx_path)
    if actual < HEADER_BYTES:
        raise ConfigError(f"{idx_path} has {actual} bytes, less than the {HEADER_BYTES}-byte "
                          f"index header: the file is truncated; {REBUILD}")
    with open(idx_path, "rb") as f:
        header = f.read(len(INDEX_HEADER))
        if header != INDEX_HEADER:
            raise ConfigError(f"{idx_path} starts with {header!r}, not the index header "
                              f"{INDEX_HEADER!r}: not a megatron index file; {REBUILD}")
        version = _read_at(f, 9, "<Q")
        code = _read_at(f, 17, "<B")
        sequences = _read_at(f, 18, "<Q")
        documents = _read_at(f, 26, "<Q")
    if version != 1 or code not in DTYPE_SIZES:
        what = f"version {version}" if version != 1 else f"dtype code {code}"
        raise ConfigError(f"{idx_path}: unknown index {what} (valid: version 1, dtype codes "
                          f"{', '.join(map(str, sorted(DTYPE_SIZES)))}); {REBUILD}")
    needed = HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if actual < needed:
        raise ConfigError(f"{idx_path} has {actual} bytes, but its header ({sequences} "
                          f"sequences, {documents} documents) needs {needed}: the file is "
                          f"truncated; {REBUILD}")
    return code, sequences, documents


def expected_bin_size(idx_path: str) -> int:
    """The `.bin` size an index describes; ConfigError if the index itself is damaged."""
    code, sequences, _ = index_counts(idx_path)
    if sequences == 0:
        return 0
    with open(idx_path, "rb") as f:
        last_length = _read_at(f, HEADER_BYTES + 4 * (sequences - 1), "<i")
        last_pointer = _read_at(f, HEADER_BYTES + 4 * sequences + 8 * (sequences - 1), "<q")
    if last_length < 0 or last_pointer < 0:
        raise ConfigError(f"{idx_path}: negative sequence length or offset in the last entry: "
                          f"the index is damaged; {REBUILD}")
    return last_pointer + last_length * DTYPE_SIZES[code]


# ---------------------------------------------------------------------------------------------
# Every entry of the index
# ---------------------------------------------------------------------------------------------


def index_arrays(idx_path: str, sequences: int, documents: int):
    """(lengths int32[N], pointers int64[N], doc_idx int64[D]) memory-mapped from the index
    (index_counts must have passed: the file is long enough)."""
    if sequences == 0 and documents == 0:
        empty = numpy.zeros(0, dtype=numpy.int64)
        return empty.astype(numpy.int32), empty, empty
    raw = numpy.memmap(idx_path, dtype=numpy.uint8, mode="r")
    start = HEADER_BYTES
    lengths = raw[start:start + 4 * sequences].view(numpy.int32)
    start += 4 * sequences
    pointers = raw[start:start + 8 * sequences].view(numpy.int64)
    start += 8 * sequences
    doc_idx = raw[start:start + 8 * documents].view(numpy.int64)
    return lengths, pointers, doc_idx


def _first(mask: numpy.ndarray) -> Optional[int]:
    """Index of the first True of `mask`, or None."""
    if not mask.any():
        return None
    return int(mask.argmax())


def _more(count: int, what: str) -> str:
    return f"; {count - 1} more {what}" if count > 1 else ""


def check_index_entries(idx_path: str, bin_path: str, code: int, sequences: int,
                        documents: int, bin_size: int) -> None:
    """ConfigError (one line, the first bad entry) unless every length is >= 0, every pointer
    starts where the previous sequence ends (from byte 0, inside the .bin), and the document
    indices run from 0 to N without decreasing. Chunked, vectorised numpy."""
    lengths, pointers, doc_idx = index_arrays(idx_path, sequences, documents)
    item = DTYPE_SIZES[code]

    def fail(problem: str):
        raise ConfigError(f"{idx_path}: {problem}; {REBUILD}")

    for a in range(0, sequences, CHUNK):
        bad = _first(lengths[a:a + CHUNK] < 0)
        if bad is not None:
            i = a + bad
            count = int(numpy.count_nonzero(lengths[a:] < 0))
            fail(f"sequence {i} has length {int(lengths[i])} (lengths must be >= 0"
                 f"{_more(count, 'negative length(s) after it')})")

    for a in range(0, sequences, CHUNK):
        b = min(a + CHUNK, sequences)
        expected = numpy.empty(b - a, dtype=numpy.int64)
        expected[0] = 0 if a == 0 else int(pointers[a - 1]) + int(lengths[a - 1]) * item
        numpy.multiply(lengths[a:b - 1], item, out=expected[1:], dtype=numpy.int64)
        expected[1:] += pointers[a:b - 1]
        bad = _first(pointers[a:b] != expected)
        if bad is not None:
            fail(_pointer_problem(a + bad, lengths, pointers, item, bin_path, bin_size))

    if documents == 0:
        fail(f"doc_idx is empty (it must list the document starts from 0 and end at "
             f"{sequences}, the number of sequences)")
    for a in range(0, documents, CHUNK):
        chunk = doc_idx[a:a + CHUNK]
        bad = _first((chunk < 0) | (chunk > sequences))
        if bad is not None:
            j = a + bad
            fail(f"doc_idx entry {j} is {int(doc_idx[j])}, outside 0..{sequences} (document "
                 f"starts must be sequence numbers of this index, which has {sequences})")
    if int(doc_idx[0]) != 0:
        fail(f"doc_idx entry 0 is {int(doc_idx[0])} (the first document must start at "
             "sequence 0)")
    if int(doc_idx[-1]) != sequences:
        fail(f"doc_idx entry {documents - 1} (the last) is {int(doc_idx[-1])}, but the index "
             f"has {sequences} sequences (the last entry must be {sequences})")
    for a in range(1, documents, CHUNK):
        b = min(a + CHUNK, documents)
        bad = _first(doc_idx[a:b] < doc_idx[a - 1:b - 1])
        if bad is not None:
            j = a + bad
            fail(f"doc_idx entry {j} is {int(doc_idx[j])}, less than entry {j - 1}, which is "
                 f"{int(doc_idx[j - 1])} (document starts must not decrease)")


def _pointer_problem(i: int, lengths, pointers, item: int, bin_path: str,
                     bin_size: int) -> str:
    """Why sequence i's pointer is not where the previous sequence ends."""
    pointer, length = int(pointers[i]), int(lengths[i])
    end = pointer + length * item
    if pointer < 0:
        return f"sequence {i} starts at byte {pointer} (pointers must be >= 0)"
    if pointer > bin_size or (pointer == bin_size and length > 0):
        return (f"sequence {i} starts at byte {pointer}, past the end of {bin_path} "
                f"({bin_size} bytes; sequences must lie inside the .bin)")
    if end > bin_size:
        return (f"sequence {i} (bytes {pointer}..{end}) ends past the end of {bin_path} "
                f"({bin_size} bytes; sequences must lie inside the .bin)")
    if i == 0:
        return f"sequence 0 starts at byte {pointer} (the first sequence must start at byte 0)"
    previous, previous_length = int(pointers[i - 1]), int(lengths[i - 1])
    if pointer < previous:
        return (f"sequence {i} starts at byte {pointer}, before sequence {i - 1} (byte "
                f"{previous}; pointers must not decrease)")
    return (f"sequence {i} starts at byte {pointer}, but sequence {i - 1} ends at byte "
            f"{previous + previous_length * item} (its pointer {previous} + length "
            f"{previous_length} x {item} bytes; each sequence must start where the previous "
            "one ends)")


# ---------------------------------------------------------------------------------------------
# Token ids and the tokenizer: the sidecar PREFIX.json, or a scan of the .bin
# ---------------------------------------------------------------------------------------------


def sidecar_path(prefix: str) -> str:
    return prefix + ".json"


def tokenizer_identity(tokenizer) -> Dict[str, object]:
    """What identifies a tokenizer (megatron/training/tokenizer.py) in a sidecar: its type,
    vocabulary size and eod, the sha256 of its model file (Llama 3, HF tokenizer.json) and,
    for HF, the file's path and name."""
    identity: Dict[str, object] = {"type": tokenizer.name,
                                   "vocab_size": int(tokenizer.vocab_size),
                                   "eod": int(tokenizer.eod)}
    if getattr(tokenizer, "sha256", None):
        identity["sha256"] = tokenizer.sha256
    model_path = getattr(tokenizer, "model_path", None)
    if model_path and tokenizer.name == "HuggingFaceTokenizer":
        identity["model"] = str(model_path)
        identity["model_file"] = os.path.basename(str(model_path))
    return identity


def scan_token_range(bin_path: str, code: int, bin_size: int) -> Tuple[int, int]:
    """(smallest, largest) token id in `bin_path`; (0, -1) when it holds no tokens. Chunked
    numpy over the memory-mapped file."""
    item = DTYPE_SIZES[code]
    count = bin_size // item
    if count == 0:
        return 0, -1
    tokens = numpy.memmap(bin_path, dtype=DTYPES[code], mode="r", shape=(count,))
    signed = numpy.issubdtype(DTYPES[code], numpy.signedinteger)
    low, high = 0, -1
    step = CHUNK * 4
    for a in range(0, count, step):
        chunk = tokens[a:a + step]
        chunk_high = int(chunk.max())
        high = chunk_high if a == 0 else max(high, chunk_high)
        if signed:
            chunk_low = int(chunk.min())
            low = chunk_low if a == 0 else min(low, chunk_low)
    return low, high


def first_token_outside(bin_path: str, code: int, bin_size: int,
                        vocab_size: int) -> Optional[Tuple[int, int]]:
    """(token position, id) of the first token outside 0..vocab_size-1, or None."""
    count = bin_size // DTYPE_SIZES[code]
    if count == 0:
        return None
    tokens = numpy.memmap(bin_path, dtype=DTYPES[code], mode="r", shape=(count,))
    step = CHUNK * 4
    for a in range(0, count, step):
        chunk = tokens[a:a + step]
        # numpy >= 2 compares with an out-of-range Python int exactly (uint16 >= 128256).
        bad = _first((chunk < 0) | (chunk >= int(vocab_size)))
        if bad is not None:
            return a + bad, int(chunk[bad])
    return None


def build_sidecar(prefix: str, tokenizer, max_token_id: int, *, bin_path: Optional[str] = None,
                  idx_path: Optional[str] = None, tokens: Optional[int] = None,
                  append_eod: Optional[bool] = None, source: Optional[str] = None) -> Dict:
    """The sidecar content for the dataset at `prefix` (its files may still sit under
    temporary names: bin_path, idx_path)."""
    bin_path = bin_path or prefix + ".bin"
    idx_path = idx_path or prefix + ".idx"
    code, sequences, documents = index_counts(idx_path)
    bin_bytes = os.path.getsize(bin_path)
    content = {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "tokenizer": tokenizer_identity(tokenizer),
        "vocab_size": int(tokenizer.vocab_size),
        "max_token_id": int(max_token_id),
        "dtype": numpy.dtype(DTYPES[code]).name,
        "tokens": int(tokens) if tokens is not None else bin_bytes // DTYPE_SIZES[code],
        "sequences": int(sequences),
        "documents": int(documents) - 1,
        "bin_bytes": int(bin_bytes),
    }
    if append_eod is not None:
        content["append_eod"] = bool(append_eod)
    if source is not None:
        content["source"] = source
    return content


def write_sidecar(path: str, content: Dict, atomic: bool = True) -> str:
    """Write `content` to `path` (atomically: a temporary name, then a rename); returns path."""
    tmp = f"{path}.tmp-{os.getpid()}" if atomic else path
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(content, indent=2) + "\n")
    if atomic:
        os.replace(tmp, path)
    return path


def read_sidecar(prefix: str, code: int, sequences: int, documents: int,
                 bin_size: int) -> Tuple[Optional[Dict], Optional[str]]:
    """(sidecar, None) when PREFIX.json describes these files; (None, note) when it exists
    but is unusable (not ours, damaged, or written for other files); (None, None) without."""
    path = sidecar_path(prefix)
    problem = file_problem(path, SIDECAR_BYTES)
    if problem == "is missing":
        return None, None
    if problem is not None:
        return None, f"note: ignoring {path} ({problem}); the .bin is scanned instead"
    try:
        content = json.loads(read_small_file(path, SIDECAR_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"note: ignoring {path} (unreadable: {str(exc).splitlines()[0][:120]})"
    if not isinstance(content, dict) or content.get("format") != SIDECAR_FORMAT:
        return None, f"note: ignoring {path} (not a {SIDECAR_FORMAT} sidecar)"
    try:
        recorded = (int(content["bin_bytes"]), int(content["sequences"]),
                    int(content["documents"]), str(content["dtype"]))
        int(content["max_token_id"])
        tokenizer = content["tokenizer"]
        if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("type"), str):
            raise KeyError("tokenizer")
        content["tokenizer"] = dict(tokenizer, vocab_size=int(
            tokenizer.get("vocab_size", content["vocab_size"])))
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"note: ignoring {path} (a damaged sidecar: {type(exc).__name__} {exc})"
    actual = (bin_size, sequences, documents - 1, numpy.dtype(DTYPES[code]).name)
    if recorded != actual:
        return None, (f"note: ignoring {path}: it describes other files ({recorded[0]} bytes, "
                      f"{recorded[1]} sequences, {recorded[2]} documents, {recorded[3]}) than "
                      f"{prefix}.bin/.idx ({actual[0]} bytes, {actual[1]} sequences, "
                      f"{actual[2]} documents, {actual[3]}); the .bin is scanned instead")
    return content, None


def _sources_json_tokenizer(prefix: str) -> Optional[Dict]:
    """The tokenizer recorded in the directory's sources.json (the embedded corpora's record,
    tools/build_corpus.py and tools/train_tokenizer.py), if it describes this prefix."""
    path = os.path.join(os.path.dirname(prefix), "sources.json")
    if file_problem(path, SIDECAR_BYTES) is not None:
        return None                     # missing, or nothing a corpus build wrote
    try:
        meta = json.loads(read_small_file(path, SIDECAR_BYTES).decode("utf-8"))
        if meta.get("data_prefix") != os.path.basename(prefix):
            return None
        tokenizer = meta["tokenizer"]
        identity = {"type": str(tokenizer["type"]), "vocab_size": int(tokenizer["vocab_size"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if tokenizer.get("sha256"):
        identity["sha256"] = str(tokenizer["sha256"])
    if identity["type"] == "HuggingFaceTokenizer":
        identity["model_file"] = "tokenizer.json"
    return identity


def _short_sha(sha: Optional[str]) -> str:
    return f", sha256 {sha[:12]}" if sha else ""


def describe_tokenizer(identity: Dict, path: Optional[str] = None) -> str:
    kind = identity.get("type", "?")
    vocab = identity.get("vocab_size")
    if kind == "NullTokenizer" and isinstance(vocab, int):
        return f"NullTokenizer (--vocab-size {vocab - 1}: {vocab} ids)"
    where = f"{path}, " if path else ""
    return f"{kind} ({where}{vocab} ids{_short_sha(identity.get('sha256'))})"


def _file_sha256(path: str) -> Optional[str]:
    from megatron.training.tokenizer import file_sha256

    try:
        return file_sha256(path)
    except OSError:
        return None


def _recorded_model_path(prefix: str, identity: Dict) -> Optional[str]:
    """A path to the recorded HF tokenizer.json that exists and has the recorded sha256:
    the file beside the data first (the corpora build in a temporary directory), then the
    recorded path."""
    candidates = []
    if identity.get("model_file"):
        candidates.append(os.path.join(os.path.dirname(prefix), str(identity["model_file"])))
    if identity.get("model"):
        candidates.append(str(identity["model"]))
    for candidate in candidates:
        if os.path.isfile(candidate):
            sha = identity.get("sha256")
            if not sha or _file_sha256(candidate) == sha:
                return candidate
    return None


def tokenizer_flags(prefix: str, identity: Dict) -> str:
    """The training flags that select the recorded tokenizer."""
    kind = identity.get("type")
    if kind == "NullTokenizer":
        return f"--tokenizer-type NullTokenizer --vocab-size {int(identity['vocab_size']) - 1}"
    if kind == "HuggingFaceTokenizer":
        path = _recorded_model_path(prefix, identity)
        if path is None:
            return ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model <the tokenizer.json "
                    f"it was built with{_short_sha(identity.get('sha256'))}>")
        return f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {path}"
    return f"--tokenizer-type {kind}"


def same_tokenizer(recorded: Dict, run: Dict) -> bool:
    if recorded.get("type") != run.get("type"):
        return False
    if int(recorded.get("vocab_size", -1)) != int(run.get("vocab_size", -2)):
        return False
    sha_a, sha_b = recorded.get("sha256"), run.get("sha256")
    return not (sha_a and sha_b and sha_a != sha_b)


def _run_vocabulary(tokenizer) -> str:
    identity = tokenizer_identity(tokenizer)
    return f"0..{tokenizer.vocab_size - 1}: {describe_tokenizer(identity)}"


def check_token_ids(prefix: str, tokenizer, code: int, sequences: int, documents: int,
                    bin_size: int, pointers=None) -> List[str]:
    """ConfigError (one line) if a token id of the dataset is outside the run's vocabulary;
    otherwise the `warning:`/`note:` lines to print (a tokenizer other than the one the data
    was built with, a slow scan, an unusable sidecar)."""
    lines: List[str] = []
    run_identity = tokenizer_identity(tokenizer)
    vocab = int(tokenizer.vocab_size)
    if code in FLOAT_CODES:
        raise ConfigError(f"{prefix}.idx: dtype code {code} ({numpy.dtype(DTYPES[code]).name}) "
                          "holds floating-point values, not token ids (valid token dtypes: "
                          "uint8, int8, int16, int32, int64, uint16); " + REBUILD)
    sidecar, note = read_sidecar(prefix, code, sequences, documents, bin_size)
    if note:
        lines.append(note)
    recorded = sidecar["tokenizer"] if sidecar else _sources_json_tokenizer(prefix)
    differs = recorded is not None and not same_tokenizer(recorded, run_identity)
    flags = tokenizer_flags(prefix, recorded) if differs else ""
    advice = (f"; the data was tokenized with {describe_tokenizer(recorded)}: train with "
              f"{flags}" if differs else
              "; train with the tokenizer the data was built with, or rebuild the data with "
              "this one (tools/preprocess_data.py)")

    if sidecar is not None:
        high = int(sidecar["max_token_id"])
        if high >= vocab:
            raise ConfigError(f"{sidecar_path(prefix)} records token ids up to {high}, outside "
                              f"the run's vocabulary ({_run_vocabulary(tokenizer)}){advice}")
        if bin_size <= SIDECAR_VERIFY_BYTES:
            # Small enough to check the record against the .bin itself.
            lines += _verify_sidecar_ids(prefix, tokenizer, code, sequences, documents,
                                         bin_size, high, pointers)
    else:
        start = time.perf_counter()
        low, high = scan_token_range(prefix + ".bin", code, bin_size)
        seconds = time.perf_counter() - start
        if low < 0 or high >= vocab:
            raise ConfigError(_outside_vocabulary(prefix, tokenizer, code, sequences, documents,
                                                  bin_size, low, high, pointers) + advice)
        if bin_size >= SCAN_NOTE_BYTES:
            lines.append(f"note: {prefix} has no sidecar {os.path.basename(prefix)}.json "
                         f"recording its largest token id: scanned its .bin ({bin_size / 1e9:.1f}"
                         f" GB) in {seconds:.1f} s at start, on every rank; {SIDECAR_HINT} "
                         "records it once")

    if differs:
        lines.append(f"warning: {prefix} was tokenized with {describe_tokenizer(recorded)} but "
                     f"this run uses {describe_tokenizer(run_identity)}: its token ids stand for "
                     f"other text; train with {flags}")
    elif recorded is None:
        beside = os.path.join(os.path.dirname(prefix), "tokenizer.json")
        if os.path.isfile(beside):
            run_sha = run_identity.get("sha256")
            if not (run_identity["type"] == "HuggingFaceTokenizer" and run_sha
                    and run_sha == _file_sha256(beside)):
                lines.append(f"warning: {beside} sits beside {prefix} (no sidecar records the "
                             f"data's tokenizer) but this run uses "
                             f"{describe_tokenizer(run_identity)}; if the data was tokenized "
                             f"with that file, train with --tokenizer-type HuggingFaceTokenizer "
                             f"--tokenizer-model {beside}")
    return lines


def _outside_vocabulary(prefix: str, tokenizer, code: int, sequences: int, documents: int,
                        bin_size: int, low: int, high: int, pointers=None) -> str:
    """'PREFIX.bin: sequence S holds token id X, outside the run's vocabulary (...); ids in the
    file: LOW..HIGH' for the first token outside the vocabulary."""
    position, value = first_token_outside(prefix + ".bin", code, bin_size,
                                          int(tokenizer.vocab_size))
    if pointers is None:
        _, pointers, _ = index_arrays(prefix + ".idx", sequences, documents)
    sequence = int(numpy.searchsorted(pointers, position * DTYPE_SIZES[code],
                                      side="right")) - 1
    return (f"{prefix}.bin: sequence {sequence} holds token id {value}, outside the run's "
            f"vocabulary ({_run_vocabulary(tokenizer)}); ids in the file: {low}..{high}")


def _verify_sidecar_ids(prefix: str, tokenizer, code: int, sequences: int, documents: int,
                        bin_size: int, recorded: int, pointers=None) -> List[str]:
    """The sidecar's largest token id (inside the run's vocabulary) checked against the .bin's
    own: a hand-edited or stale record would otherwise let an id outside the vocabulary reach
    the embedding (an IndexError, or a padding row in silence). ConfigError (one line) when
    the .bin holds one; a `warning:` line when the record is wrong but every id fits."""
    low, high = scan_token_range(prefix + ".bin", code, bin_size)
    if low < 0 or high >= int(tokenizer.vocab_size):
        raise ConfigError(
            _outside_vocabulary(prefix, tokenizer, code, sequences, documents, bin_size, low,
                                high, pointers)
            + f", although its sidecar {os.path.basename(sidecar_path(prefix))} records ids up "
            f"to {recorded}: the sidecar is wrong; {REBUILD}")
    if high != recorded:
        return [f"warning: {sidecar_path(prefix)} records token ids up to {recorded}, but "
                f"{prefix}.bin holds ids up to {high}: the sidecar is wrong (every id fits this "
                f"run's vocabulary, so training goes on); rewrite it: {SIDECAR_HINT}"]
    return []


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def check_dataset(prefix: str, tokenizer=None) -> List[str]:
    """ConfigError (one line) unless PREFIX.idx is intact in every entry, PREFIX.bin has its
    size and, given the run's tokenizer, every token id fits its vocabulary; returns the
    `warning:`/`note:` lines to print."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        problem = file_problem(path)
        if problem == "is missing":
            raise ConfigError(f"--data-path {prefix}: {path} not found; pass the prefix of a "
                              "preprocessed dataset (PREFIX.bin and PREFIX.idx)")
        if problem is not None:
            raise ConfigError(f"--data-path {prefix}: {path} {problem} (a FIFO or device "
                              "cannot be memory-mapped); pass the prefix of a preprocessed "
                              "dataset (PREFIX.bin and PREFIX.idx)")
    code, sequences, documents = index_counts(idx_path)
    actual = os.path.getsize(bin_path)
    check_index_entries(idx_path, bin_path, code, sequences, documents, actual)
    expected = expected_bin_size(idx_path)
    if actual != expected:
        problem = "truncated" if actual < expected else "longer than its index says"
        raise ConfigError(f"{bin_path} has {actual} bytes but {idx_path} describes {expected}: "
                          f"the file is {problem}; {REBUILD}")
    if tokenizer is None:
        return []
    return check_token_ids(prefix, tokenizer, code, sequences, documents, actual)


def unscanned_sidecars(prefixes: Optional[Iterable[str]]) -> List[str]:
    """The prefixes whose .bin is too large for the start-up scan (SIDECAR_VERIFY_BYTES) and
    whose sidecar's largest token id is therefore trusted: the training loop checks their
    batches instead (training.checked_batches)."""
    return [prefix for prefix in prefixes or ()
            if os.path.isfile(sidecar_path(prefix)) and os.path.isfile(prefix + ".bin")
            and os.path.getsize(prefix + ".bin") > SIDECAR_VERIFY_BYTES]


def check_dataset_files(prefixes: Optional[Iterable[str]], tokenizer=None) -> List[str]:
    """check_dataset for every prefix of --data-path (nothing for --mock-data); the
    `warning:`/`note:` lines of all of them."""
    lines: List[str] = []
    for prefix in prefixes or ():
        lines.extend(check_dataset(prefix, tokenizer))
    return lines
