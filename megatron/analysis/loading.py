"""Finding capture directories and reading their manifests, run files and records.

A capture is read through its manifests only (docs/capture-format.md): every manifest line that
parses names one complete record, so no directory listing or unpickling is needed to know what
a capture holds. Accepted inputs: a `--tensor-save-dir` (one sub-directory per scheme), a
single scheme directory, or several of either. File names, the manifest schema and its
encoding are megatron.tensor_capture.format's; records load through
megatron.tensor_capture.load (weights_only=True).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron.analysis.validation import (METADATA_FIELDS, check_manifest_item, check_run_file,
                                         check_summary_file)
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture import load as capture_load
from megatron.tensor_capture.format import MANIFEST_GLOB, SCHEME_KEY, short_module_name

log = logging.getLogger("megatron.analysis")

FORMAT_VERSIONS = capture_format.READABLE_VERSIONS
# A record left under its temporary name (format.TEMPORARY_GLOB) means the writer was stopped
# mid-write.
UNFINISHED_RUN = "unfinished_run"              # problem kind
INCOMPLETE_RUN = "incomplete run (killed?)"    # how reports name such a capture
RECORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Problem kinds of a manifest that does not describe the records it lists: a line that
# contradicts its record file, its file name, its manifest or its run file, and a line
# listing a record another line already listed (counted once).
MISMATCH = "manifest_mismatch"
DUPLICATE_LINE = "duplicate_manifest_line"
# The metadata a line is compared on with its record file: every documented key, the ones
# that identify the record first (format, scheme, site, run and writer), so that a message
# names them first.
IDENTITY_KEYS = ("format", SCHEME_KEY, "layer_idx", "module", "tensor_name", "operation",
                 "phase", "component", "gemm", "operand", "iteration", "micro_batch",
                 "run_id", "rank", "counter")
COMPARED_KEYS = IDENTITY_KEYS + tuple(sorted(
    {f.path[1] for f in METADATA_FIELDS} - set(IDENTITY_KEYS)))
_MANIFEST_RANK = re.compile(r"-rank(\d+)\.jsonl$")
_EXPERT_INDEX = re.compile(r"^expert\d+_")


class Problems:
    """Warnings about bad input, kept for statistics.json and the report (and logged)."""

    def __init__(self):
        self.items: List[Dict[str, str]] = []

    def add(self, kind: str, message: str, level: str = "warning") -> None:
        getattr(log, level if level in ("warning", "error", "info") else "warning")(message)
        self.items.append({"kind": kind, "level": level, "message": message})

    def extend(self, items) -> None:
        for item in items:
            log.warning(item["message"])
            self.items.append(item)

    def __len__(self):
        return len(self.items)


@dataclass
class Entry:
    """One manifest line: a record of a capture (its file is None in stats mode)."""

    quant_scheme: str
    directory: str
    file: Optional[str]
    bytes: int
    metadata: dict
    tensor_info: dict
    quant_error: Optional[dict]
    source: str = ""                     # manifest file and line, for messages

    @property
    def path(self) -> Optional[str]:
        return None if not self.file else os.path.join(self.directory, self.file)

    def keys(self) -> List[tuple]:
        """What makes two lines the same record: its file, and the writer's (run, rank,
        counter) where the line records them."""
        m = self.metadata
        keys = [("file", self.file)] if self.file else []
        if all(m.get(k) is not None for k in ("run_id", "rank", "counter")):
            keys.append(("record", str(m["run_id"]), m["rank"], m["counter"]))
        return keys


@dataclass
class Capture:
    """One scheme directory: its runs, per-rank summaries and manifest entries."""

    directory: str
    quant_scheme: str
    runs: List[dict] = field(default_factory=list)
    summaries: List[dict] = field(default_factory=list)
    entries: List[Entry] = field(default_factory=list)
    incomplete: List[str] = field(default_factory=list)   # why the capture is unfinished

    @property
    def status(self) -> str:
        return INCOMPLETE_RUN if self.incomplete else "complete"


def _is_capture_dir(path: str) -> bool:
    return bool(capture_format.capture_files(path, MANIFEST_GLOB))


def discover(paths: List[str], problems: Problems) -> List[str]:
    """Scheme directories (those holding manifests) found under the given paths."""
    found: List[str] = []
    for path in paths:
        if not os.path.exists(path):
            problems.add("missing_directory", f"capture directory {path} does not exist")
            continue
        if not os.path.isdir(path):
            problems.add("missing_directory", f"{path} is not a directory")
            continue
        if _is_capture_dir(path):
            found.append(os.path.abspath(path))
            continue
        subdirs = sorted(d for d in capture_format.capture_files(path, "*")
                         if os.path.isdir(d) and _is_capture_dir(d))
        if not subdirs:
            problems.add("empty_directory", f"no capture manifests ({MANIFEST_GLOB}) in {path} "
                                            f"or its sub-directories")
        found.extend(os.path.abspath(d) for d in subdirs)
    unique = []
    for d in found:
        if d not in unique:
            unique.append(d)
    return unique


def read_manifest_file(path: str, problems: Problems) -> List[dict]:
    """Parsed lines of one manifest; lines that do not parse (a killed run) are reported and
    skipped, and the rest of the manifest is used."""
    items = []
    number = 0
    try:
        for number, item, problem in capture_format.parse_manifest(path):
            if problem is not None:
                kind, message = problem
                problems.add(kind, f"{message} (the rest of the manifest is used)")
                continue
            item["_source"] = f"{os.path.basename(path)}:{number}"
            items.append(item)
    except (OSError, ValueError) as exc:
        # The file itself could not be read (lines that do not parse are reported above).
        problems.add("bad_manifest_line", f"{path}: cannot read past line {number} "
                                          f"({type(exc).__name__}: {str(exc)[:80]}); the "
                                          "lines after it are not analysed")
    return items


def _read_json(path: str, problems: Problems, kind: str, check) -> Optional[dict]:
    """A run or summary file, or None (reported) when it cannot be read or is malformed."""
    try:
        doc = capture_format.read_json(path)
    except (OSError, ValueError, RecursionError) as exc:
        problems.add(kind, f"cannot read {path}: {exc}")
        return None
    why = check(doc)
    if why is not None:
        problems.add(kind, f"{path}: {why}; file ignored")
        return None
    return doc


def read_capture(directory: str, problems: Problems) -> Capture:
    """Run files, summaries and manifest entries of one scheme directory."""
    capture = Capture(directory=directory, quant_scheme=os.path.basename(directory.rstrip("/")))
    for path in capture_format.capture_files(directory, capture_format.RUN_GLOB):
        run = _read_json(path, problems, "bad_run_file", check_run_file)
        if run is not None:
            capture.runs.append(run)
            capture.quant_scheme = run.get(capture_format.SCHEME_KEY) or capture.quant_scheme
    for path in capture_format.capture_files(directory, capture_format.SUMMARY_GLOB):
        summary = _read_json(path, problems, "bad_summary_file", check_summary_file)
        if summary is not None:
            summary["_file"] = os.path.basename(path)
            capture.summaries.append(summary)
            if summary.get("error"):
                problems.add("run_error", f"{path}: the capture reported an error: "
                                          f"{summary['error']}")
    run_schemes = {str(run["run_id"]): run.get(SCHEME_KEY) for run in capture.runs
                   if run.get("run_id") is not None}
    seen: Dict[tuple, str] = {}
    for path in capture_format.manifest_files(directory):
        if not os.path.exists(capture_format.summary_for_manifest(path)):
            _incomplete(capture, problems, f"{path} has no summary file, so the run did not end "
                                           "(killed, or still running); the records its "
                                           "manifest lists are complete, later ones are missing")
        run_id = capture_format.manifest_run_id(path)
        rank = _MANIFEST_RANK.search(os.path.basename(path))
        rank = int(rank.group(1)) if rank else None
        for item in read_manifest_file(path, problems):
            entry = _entry(item, directory, capture.quant_scheme, problems)
            if entry is None:
                continue
            why = line_mismatch(entry, run_id, rank, run_schemes)
            if why is not None:
                problems.add(MISMATCH, f"{entry.source}: {why}; record skipped")
                continue
            first = next((seen[key] for key in entry.keys() if key in seen), None)
            if first is not None:
                problems.add(DUPLICATE_LINE, f"{entry.source}: lists the record "
                                             f"{entry.file or _identity(entry.metadata)} again "
                                             f"(first listed at {first}); counted once")
                continue
            for key in entry.keys():
                seen[key] = os.path.basename(entry.source)
            capture.entries.append(entry)
    leftovers = capture_format.capture_files(directory, capture_format.TEMPORARY_GLOB)
    if leftovers:
        _incomplete(capture, problems, f"{directory} holds {len(leftovers)} temporary record "
                                       f"file(s) ({os.path.basename(leftovers[0])}, ...) of "
                                       "writes that never finished; they are not analysed")
    return capture


def read_captures(paths: List[str], problems: Problems) -> List[Capture]:
    """Every capture under the given paths. The same scheme found under two parents (e.g. a
    floor and an rceil experiment) is kept apart as `scheme@parent`; directories under the
    same parent (several runs appended to one capture) are merged by the analysis."""
    captures = []
    for directory in discover(paths, problems):
        capture = read_capture(directory, problems)
        if not capture.entries:
            problems.add("empty_capture", f"{directory}: the manifests list no valid records")
        captures.append(capture)
    parents: Dict[str, set] = {}
    for capture in captures:
        parents.setdefault(capture.quant_scheme, set()).add(
            os.path.dirname(capture.directory.rstrip("/")))
    for capture in captures:
        if len(parents[capture.quant_scheme]) > 1:
            parent = os.path.basename(os.path.dirname(capture.directory.rstrip("/")))
            label = f"{capture.quant_scheme}@{parent}"
            capture.quant_scheme = label
            for entry in capture.entries:
                entry.quant_scheme = label
    return captures


def _incomplete(capture: "Capture", problems: Problems, reason: str) -> None:
    capture.incomplete.append(reason)
    problems.add(UNFINISHED_RUN, f"{INCOMPLETE_RUN}: {reason}")


def _entry(item: dict, directory: str, default_scheme: str, problems: Problems) -> Optional[Entry]:
    source = f"{directory}/{item.get('_source', '?')}"
    version = item.get("format_version")
    if not _is_version(version):
        problems.add("unknown_format_version",
                     f"{source}: manifest line has format_version {version!r} (this analysis "
                     f"reads {', '.join(map(str, FORMAT_VERSIONS))}); skipped")
        return None
    why = check_manifest_item(item)
    file_name = item.get("file")
    if why is None and file_name is not None:
        try:
            capture_format.record_path(directory, file_name)
        except ValueError as exc:
            why = f"file: {exc}"
    if why is not None:
        problems.add("bad_manifest_line", f"{source}: {why}; record skipped")
        return None
    metadata = item["metadata"]
    return Entry(
        quant_scheme=str(metadata.get(capture_format.SCHEME_KEY) or default_scheme),
        directory=directory, file=file_name, bytes=item.get("bytes") or 0, metadata=metadata,
        tensor_info=item["tensor_info"], quant_error=item.get("quant_error"), source=source)


def _identity(m: dict) -> str:
    return f"of run {m.get('run_id')}, rank {m.get('rank')}, counter {m.get('counter')}"


def line_mismatch(entry: Entry, run_id: Optional[str], rank: Optional[int],
                  run_schemes: Dict[str, Optional[str]]) -> Optional[str]:
    """Why a (valid) manifest line does not describe a record of the manifest it sits in, or
    None: its run and rank against the manifest's name, its scheme against its run file,
    its file name against its own metadata. Needs no record file (--manifest-only too)."""
    m = entry.metadata
    if m.get("run_id") is not None and run_id is not None and str(m["run_id"]) != run_id:
        return (f"the line is of run {m['run_id']!r} but sits in the manifest of run "
                f"{run_id!r} (lines copied from another capture?)")
    if m.get("rank") is not None and rank is not None and m["rank"] != rank:
        return (f"the line is of rank {m['rank']} but sits in the manifest of rank {rank} "
                "(lines copied from another rank's manifest?)")
    recorded = run_schemes.get(str(m.get("run_id", run_id)))
    if m.get(SCHEME_KEY) is not None and recorded and m[SCHEME_KEY] != recorded:
        return (f"the line says {SCHEME_KEY} {m[SCHEME_KEY]!r} but its run file says "
                f"{recorded!r}")
    if entry.file:
        return file_name_mismatch(entry.file, m)
    return None


def expected_file_name(m: dict) -> Optional[Tuple[str, str, str]]:
    """(prefix, module, suffix) of the file name the writer gives the record `m` describes
    (format.record_file_name), or None when the line lacks the writer's fields. The module
    part of a routed expert's name carries its global index, which the metadata does not."""
    try:
        world = int(m["world_size"])
        prefix = (f"{m['run_id']}_{int(m['counter']):06d}_{m['layer_type']}_L{m['layer_idx']}_"
                  f"{m['operation']}_{m['phase']}_{m['component']}_{m[SCHEME_KEY]}_"
                  f"{m['tensor_name']}_")
        suffix = (f"_it{m['iteration']}_mb{m['micro_batch']}"
                  + (capture_format.rank_suffix(world, m["tp_rank"], m["pp_rank"], m["dp_rank"])
                     if world > 1 else "") + ".pt")
        return prefix, short_module_name(str(m["module"])), suffix
    except (KeyError, TypeError, ValueError):
        return None


def file_name_mismatch(file_name: str, m: dict) -> Optional[str]:
    """Why `file_name` is not the name of the record `m` describes, or None."""
    expected = expected_file_name(m)
    if expected is None:
        return None
    prefix, module, suffix = expected
    if file_name.startswith(prefix) and file_name.endswith(suffix) and \
            len(file_name) > len(prefix) + len(suffix):
        named = file_name[len(prefix):-len(suffix)]
        if named == module or _EXPERT_INDEX.sub("expert#_", named) == \
                _EXPERT_INDEX.sub("expert#_", module):
            return None
    return (f"file name {file_name} is not that of the record the line describes "
            f"({prefix}{module}{suffix}): the line's file was edited or swapped")


_ABSENT = "(absent)"


def _normal(value):
    """Metadata as JSON would carry it: tuples as lists, NaN as a comparable value."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _shown(value) -> str:
    text = repr(value) if value is not _ABSENT else "absent"
    return text if len(text) <= 60 else text[:57] + "..."


def metadata_mismatch(record_metadata, line_metadata: dict) -> Optional[str]:
    """Why a manifest line's metadata is not its record file's own, or None. Every key the
    format documents is compared (the identifying ones first); the first three that differ
    are named."""
    if not isinstance(record_metadata, dict):
        return "the record file holds no metadata to check its manifest line against"
    differ = [key for key in COMPARED_KEYS
              if _normal(record_metadata.get(key, _ABSENT))
              != _normal(line_metadata.get(key, _ABSENT))]
    if not differ:
        return None
    shown = "; ".join(f"{key} {_shown(line_metadata.get(key, _ABSENT))} vs "
                      f"{_shown(record_metadata.get(key, _ABSENT))}" for key in differ[:3])
    more = f" (and {len(differ) - 3} more field(s))" if len(differ) > 3 else ""
    return (f"the manifest line does not match the record file's own metadata (line vs file): "
            f"{shown}{more}; the manifest was edited, or record files were swapped or renamed")


def _is_version(value) -> bool:
    # bool is an int in Python: `true` must not pass for format_version 1.
    return not isinstance(value, bool) and value in FORMAT_VERSIONS


class UnreadableRecord(ValueError):
    """A record file the analysis will not or cannot read; the message is one line."""


def load_record(path: str, directory: Optional[str] = None) -> dict:
    """A record dict from its .pt file, loaded with weights_only=True (records hold only
    tensors and plain data). With `directory`, a path that resolves outside it (a symlink
    planted in a capture) is refused before it is opened."""
    if directory is not None and not _inside(path, directory):
        raise UnreadableRecord(f"{path}: refused: it resolves to "
                               f"{os.path.realpath(path)}, outside the capture directory")
    try:
        return capture_load.load_record(path)
    except capture_load.RecordError as exc:
        # Never advise another way of loading a refused file: unpickling it could run code.
        raise UnreadableRecord(_without_loader_advice(str(exc))) from None


def _without_loader_advice(message: str) -> str:
    """torch's errors may suggest weights_only=False; such advice must not reach users."""
    if "weights_only" not in message:
        return message
    return message.split(":", 1)[0] + ": unreadable record; the file is truncated or damaged"


def _inside(path: str, directory: str) -> bool:
    root = os.path.realpath(directory)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def _not_dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has fewer stored elements than it has elements (a stride-0 expanded
    view: a few bytes on disk that would take numel x element size to analyse)."""
    return tensor.untyped_storage().nbytes() < tensor.numel() * tensor.element_size()


def check_record(record, source: str, metadata: Optional[dict] = None,
                 tensor_info: Optional[dict] = None) -> Optional[str]:
    """Why a loaded record cannot be analysed, or None when it follows the format (and, given
    its manifest metadata, holds the quantized copy that metadata announces; given its
    manifest tensor_info, has the shape and dtype written there). Tensors must be dense."""
    if not isinstance(record, dict):
        return f"{source}: not a record dict"
    version = record.get("format_version")
    if not _is_version(version):
        return (f"{source}: record has format_version {version!r} (this analysis reads "
                f"{', '.join(map(str, FORMAT_VERSIONS))}); skipped")
    tensor = record.get("tensor")
    if not isinstance(tensor, torch.Tensor):
        return f"{source}: record has no tensor; skipped"
    if tensor.dtype not in RECORD_DTYPES:
        return f"{source}: unsupported dtype {tensor.dtype}; skipped"
    if isinstance(tensor_info, dict):
        shape, dtype = tensor_info.get("shape"), tensor_info.get("dtype")
        if (shape is not None and shape != list(tensor.shape)) \
                or (dtype is not None and dtype != str(tensor.dtype)):
            return (f"{source}: record tensor is {list(tensor.shape)} {tensor.dtype} but the "
                    f"manifest says {shape} {dtype}; skipped")
    if _not_dense(tensor):
        return (f"{source}: record tensor {list(tensor.shape)} stores "
                f"{tensor.untyped_storage().nbytes() // tensor.element_size()} of its "
                f"{tensor.numel()} elements (an expanded view, not a dense tensor); skipped")
    if metadata is None or metadata.get("format", "none") == "none":
        return None
    quantized = record.get("quantized")
    if not isinstance(quantized, torch.Tensor) or quantized.shape != tensor.shape:
        return (f"{source}: the manifest says format {metadata['format']} but the record has "
                f"no quantized tensor of shape {list(tensor.shape)}; skipped")
    if _not_dense(quantized):
        return (f"{source}: record's quantized tensor {list(quantized.shape)} stores "
                f"{quantized.untyped_storage().nbytes() // quantized.element_size()} of its "
                f"{quantized.numel()} elements (an expanded view, not a dense tensor); skipped")
    return None


def finite_or_none(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
