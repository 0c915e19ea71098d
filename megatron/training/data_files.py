"""Checking indexed datasets (`PREFIX.bin` + `PREFIX.idx`) before anything is built.

megatron.core maps both files lazily: a truncated `.idx` fails inside numpy ("buffer is
smaller than requested size", then an AttributeError from the reader's `__del__`), a
truncated `.bin` only in a DataLoader worker once training has started ("offset must be
non-negative"). `check_dataset_files` reads the index header and its last entries (a few
bytes, whatever the corpus size) and compares the sizes the index implies with the files on
disk; each problem is one ConfigError line naming the file, the expected and actual sizes.

The `.idx` layout (megatron.core.datasets.indexed_dataset): the 9-byte header
`MMIDIDX\\x00\\x00`, version (<Q, 1), dtype code (<B), sequence count N (<Q), document count D
(<Q), then N int32 sequence lengths (in tokens), N int64 sequence pointers (byte offsets
into `.bin`) and D int64 document indices.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional

from megatron.training.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# Bytes per token of each dtype code.
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
REBUILD = "rebuild it with tools/preprocess_data.py"


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


def check_dataset(prefix: str) -> None:
    """ConfigError (one line) unless PREFIX.idx is intact and PREFIX.bin has its size."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ConfigError(f"--data-path {prefix}: {path} not found; pass the prefix of a "
                              "preprocessed dataset (PREFIX.bin and PREFIX.idx)")
    expected = expected_bin_size(idx_path)
    actual = os.path.getsize(bin_path)
    if actual != expected:
        problem = "truncated" if actual < expected else "longer than its index says"
        raise ConfigError(f"{bin_path} has {actual} bytes but {idx_path} describes {expected}: "
                          f"the file is {problem}; {REBUILD}")


def check_dataset_files(prefixes: Optional[Iterable[str]]) -> None:
    """check_dataset for every prefix of --data-path (nothing for --mock-data)."""
    for prefix in prefixes or ():
        check_dataset(prefix)
