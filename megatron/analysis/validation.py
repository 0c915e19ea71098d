"""Checks of manifest lines against the capture format, field by field.

A manifest is input from disk: any field may be missing, of the wrong type, non-finite, out of
range, an unknown name or a path. `check_manifest_item(item)` returns None for a line the
analysis can use, and otherwise one line naming the first bad field, its value and what
would be valid, so that the caller skips that record and goes on with the others.

Fields the analysis reads are required; the other documented fields are checked only when
present, and unknown keys are ignored (newer writers may add some).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from megatron.analysis.hifp8 import REGIONS
from megatron.quantization.formats import FORMAT_NAMES, MAX_SHARED_EXPONENT, \
    MIN_SHARED_EXPONENT, SCALE_MODES, format_info
from megatron.quantization.config import RHT_BLOCKS
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.replay import FP8_SCALINGS

# Bounds far beyond any real capture, so that a corrupted number cannot overflow a sum or
# allocate a histogram of absurd size.
MAX_COUNT = 1 << 48                # elements, bytes, counters
MAX_INDEX = 1 << 31                # iterations, micro-batches, layers, ranks
MAX_DIMS = 16
MAX_TEXT = 1000
HIFP8_SCALINGS = ("none", "tensor")
MAX_SEED = (1 << 63) - 1           # stochastic-rounding seeds are 63-bit
FP8_BLOCKS = ([1, 128], [128, 128])
# floor(log2) of a block scale: E4M3 scales lie in [2^-9, 448], FP8 tile scales in float32's
# range (2^-149 .. 2^128).
SCALE_EXPONENT_RANGE = (-160, 160)
STOCHASTIC_KINDS = ("mx", "nvfp4", "fp8")
FLOAT_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$")

Check = Callable[[object], Optional[str]]     # None when valid, else what would be valid


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(lo: int, hi: int) -> Check:
    def check(value):
        if _is_int(value) and lo <= value <= hi:
            return None
        return f"an integer in [{lo}, {hi}]"
    return check


def number(lo: float = -math.inf, hi: float = math.inf, allow_inf: bool = False) -> Check:
    def check(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:      # an integer beyond any float
                value = math.nan
            if math.isnan(value):
                pass
            elif math.isinf(value):
                if allow_inf:
                    return None
            elif lo <= value <= hi:
                return None
        bounds = "" if (lo, hi) == (-math.inf, math.inf) else f" in [{lo:g}, {hi:g}]"
        return f"a finite number{bounds}" + (" or inf" if allow_inf else "")
    return check


def choice(values: Sequence[str]) -> Check:
    def check(value):
        return None if isinstance(value, str) and value in values else f"one of {', '.join(values)}"
    return check


def name() -> Check:
    def check(value):
        if isinstance(value, str) and len(value) <= 200 and _NAME.match(value):
            return None
        return "a name of letters, digits and _ . @ + - (no path)"
    return check


def text() -> Check:
    def check(value):
        return None if isinstance(value, str) and len(value) <= MAX_TEXT else \
            f"a string of at most {MAX_TEXT} characters"
    return check


def flag() -> Check:
    def check(value):
        return None if isinstance(value, bool) else "true or false"
    return check


def nullable(inner: Check) -> Check:
    def check(value):
        if value is None:
            return None
        why = inner(value)
        return None if why is None else f"{why} or null"
    return check


def shape() -> Check:
    def check(value):
        if (isinstance(value, list) and len(value) <= MAX_DIMS
                and all(_is_int(d) and 0 <= d <= MAX_COUNT for d in value)
                and math.prod(value) <= MAX_COUNT):
            return None
        return f"a list of at most {MAX_DIMS} sizes (integers >= 0, product <= 2^48)"
    return check


def int_map() -> Check:
    def check(value):
        if isinstance(value, dict) and len(value) <= 64 and all(
                isinstance(k, str) and _is_int(v) and 0 <= v <= MAX_COUNT
                for k, v in value.items()):
            return None
        return "an object of sizes (integers >= 0)"
    return check


def _histogram(lo_bound: int, hi_bound: int, range_text: str) -> Check:
    """{"min": lo or null, "counts": [...]}: a histogram over integer bins that stays within
    [lo_bound, hi_bound]."""
    def check(value):
        valid = (f"{{\"min\": an integer in [{lo_bound}, {hi_bound}] or null, \"counts\": a "
                 f"list of integers >= 0 that stays within {range_text}}}")
        if not isinstance(value, dict):
            return valid
        lo, counts = value.get("min"), value.get("counts")
        if not isinstance(counts, list) or not all(_is_int(c) and 0 <= c <= MAX_COUNT
                                                   for c in counts):
            return valid
        if lo is None:
            return None if not any(counts) else valid
        if not _is_int(lo) or not lo_bound <= lo <= hi_bound:
            return valid
        return None if lo + len(counts) - 1 <= hi_bound else valid
    return check


def exponent_histogram() -> Check:
    return _histogram(MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT, "the E8M0 range")


def amax_value() -> Check:
    """A tensor amax: a number >= 0, inf or nan (an operand holding NaN / Inf)."""
    def check(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                return "a number >= 0 (inf or nan for an operand holding them)"
            if math.isnan(value) or value >= 0:
                return None
        return "a number >= 0 (inf or nan for an operand holding them)"
    return check


def int_choice(values: Sequence[int]) -> Check:
    def check(value):
        return None if _is_int(value) and value in values else \
            f"one of {', '.join(map(str, values))}"
    return check


def fp8_block() -> Check:
    def check(value):
        return None if isinstance(value, list) and value in FP8_BLOCKS and all(
            _is_int(v) for v in value) else "[1, 128] or [128, 128]"
    return check


def scale_histogram() -> Check:
    return _histogram(*SCALE_EXPONENT_RANGE, "that range")


def region_fractions() -> Check:
    def check(value):
        if isinstance(value, dict) and set(value) <= set(REGIONS) and all(
                number(0.0, 1.0)(v) is None for v in value.values()):
            return None
        return f"an object of fractions in [0, 1] named {', '.join(REGIONS)}"
    return check


@dataclass(frozen=True)
class Field:
    path: Tuple[str, ...]
    check: Check
    required: bool = False


def _fields(section: str, specs) -> Tuple[Field, ...]:
    return tuple(Field((section, key), check, required) for key, check, required in specs)


_COUNT = integer(0, MAX_COUNT)
_INDEX = integer(0, MAX_INDEX)
_FRACTION = number(0.0, 1.0)

TOP_FIELDS = (
    Field(("bytes",), _COUNT),
    Field(("metadata",), lambda v: None if isinstance(v, dict) else "an object", True),
    Field(("tensor_info",), lambda v: None if isinstance(v, dict) else "an object", True),
    Field(("quant_error",), nullable(lambda v: None if isinstance(v, dict) else "an object")),
)
METADATA_FIELDS = _fields("metadata", (
    ("layer_idx", _INDEX, True),
    ("iteration", _INDEX, True),
    ("micro_batch", _INDEX, True),
    ("module", text(), True),
    ("operation", choice(("forward", "backward")), True),
    ("phase", choice(("pre", "post")), True),
    ("component", choice(("FA", "linear")), True),
    ("tensor_name", name(), True),
    ("gemm", choice(("fprop", "dgrad", "wgrad")), True),
    ("operand", name(), True),
    ("format", choice(FORMAT_NAMES), True),
    (capture_format.SCHEME_KEY, name(), False),
    ("layer_type", choice(("attention", "linear")), False),
    ("rank", _INDEX, False), ("tp_rank", _INDEX, False), ("pp_rank", _INDEX, False),
    ("dp_rank", _INDEX, False), ("world_size", integer(1, MAX_INDEX), False),
    ("save_time", text(), False), ("run_id", text(), False), ("counter", _COUNT, False),
    ("name", text(), False), ("site", text(), False), ("layout", text(), False),
    ("site_kind", choice(("linear", "output_layer", "attn_qk", "attn_pv")), False),
    ("axis", nullable(integer(0, MAX_DIMS - 1)), False),
    ("scale_mode", nullable(choice(SCALE_MODES)), False),
    ("saturate", nullable(flag()), False),
    ("dims", int_map(), False),
    ("hifp8_scaling", choice(HIFP8_SCALINGS), False),
    ("hifp8_scale_exponent", integer(MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT), False),
    ("stochastic_seed", integer(0, MAX_SEED), False),
    ("tensor_amax", amax_value(), False),
    ("fp8_scaling", choice(FP8_SCALINGS), False),
    ("fp8_block", fp8_block(), False),
    ("fp8_margin", number(-1000.0, 1000.0), False),
    ("fp8_pow2_scale", flag(), False),
    ("block_2d", flag(), False),
    ("rht_block", int_choice(RHT_BLOCKS), False),
    ("rht_seed", integer(-MAX_SEED - 1, MAX_SEED), False),
))
TENSOR_INFO_FIELDS = _fields("tensor_info", (
    ("shape", shape(), True),
    ("numel", _COUNT, True),
    ("dtype", choice(FLOAT_DTYPES), True),
    ("device", text(), False),
    ("requires_grad", flag(), False), ("is_leaf", flag(), False),
    ("min", nullable(number()), False), ("max", nullable(number()), False),
    ("mean", nullable(number()), False), ("std", nullable(number(0.0)), False),
    ("absmax", nullable(number(0.0)), False),
    ("zero_fraction", _FRACTION, False),
    ("nan_count", _COUNT, False), ("inf_count", _COUNT, False),
))
QUANT_ERROR_FIELDS = _fields("quant_error", (
    ("mse", nullable(number(0.0, allow_inf=True)), False),
    ("sqnr_db", nullable(number(allow_inf=True)), False),
    ("relative_error", nullable(number(0.0, allow_inf=True)), False),
    ("flushed_fraction", _FRACTION, False),
    ("saturated_fraction", _FRACTION, False),
    ("nonfinite_fraction", _FRACTION, False),
    ("scale_exponent_hist", exponent_histogram(), False),
    ("nan_blocks", _COUNT, False),
    ("hifp8_regions", region_fractions(), False),
    ("hifp8_regions_unscaled", region_fractions(), False),
    ("tensor_scale", nullable(number(0.0)), False),
    ("blocks", _COUNT, False),
    ("block_scale_min", nullable(number(0.0)), False),
    ("block_scale_max", nullable(number(0.0)), False),
    ("block_scale_hist", scale_histogram(), False),
    ("block_scale_zero_fraction", _FRACTION, False),
    ("block_scale_subnormal_fraction", _FRACTION, False),
))
FIELDS = TOP_FIELDS + METADATA_FIELDS + TENSOR_INFO_FIELDS + QUANT_ERROR_FIELDS


def _shown(value) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def _lookup(item: dict, path: Tuple[str, ...]):
    """(present, value) of a nested field."""
    node = item
    for key in path[:-1]:
        node = node.get(key)
        if not isinstance(node, dict):
            return False, None
    return (path[-1] in node), node.get(path[-1])


def _cross_field(item: dict) -> Optional[str]:
    """Checks that involve two fields (each already valid on its own)."""
    meta, info = item["metadata"], item["tensor_info"]
    dims = info["shape"]
    if math.prod(dims) != info["numel"]:
        return f"tensor_info.numel = {info['numel']} but the shape {dims} holds " \
               f"{math.prod(dims)} elements"
    axis = meta.get("axis")
    if axis is not None and dims and axis >= len(dims):
        return f"metadata.axis = {axis} but the tensor has {len(dims)} dimensions: expected " \
               f"an integer in [0, {len(dims) - 1}] or null"
    fmt = meta["format"]
    why = _quantization_fields(meta, fmt, dims)
    if why is not None:
        return why
    scaling = meta.get("hifp8_scaling", "none")
    if scaling == "tensor":
        if fmt != "hifp8":
            return f"metadata.hifp8_scaling = 'tensor' on a {fmt} record: expected 'none' " \
                   "(per-tensor scaling is HiFP8 only)"
        if "hifp8_scale_exponent" not in meta:
            return "metadata.hifp8_scale_exponent is missing: expected an integer in " \
                   f"[{MIN_SHARED_EXPONENT}, {MAX_SHARED_EXPONENT}] with hifp8_scaling 'tensor'"
    return None


_FP8_KEYS = ("fp8_scaling", "fp8_block", "fp8_margin", "fp8_pow2_scale")


def _quantization_fields(meta: dict, fmt: str, dims) -> Optional[str]:
    """The metadata that says how q was quantized (docs/capture-format.md, "Reproducing q")
    must fit the record's format and shape."""
    kind = format_info(fmt).kind
    for key in _FP8_KEYS:
        if key in meta and kind != "fp8":
            return f"metadata.{key} = {_shown(meta[key])} on a {fmt} record: expected no " \
                   "fp8_* keys (they describe the fp8_e4m3 / fp8_e5m2 formats only)"
    if kind == "fp8":
        scaling = meta.get("fp8_scaling", "tensor")
        if scaling == "block" and "fp8_block" not in meta:
            return "metadata.fp8_block is missing: expected [1, 128] or [128, 128] with " \
                   "fp8_scaling 'block'"
        if scaling != "block" and "fp8_block" in meta:
            return f"metadata.fp8_block = {_shown(meta['fp8_block'])} with fp8_scaling " \
                   f"{scaling!r}: expected no fp8_block (tiles belong to 'block' scaling)"
        if meta.get("fp8_block") == [128, 128] and len(dims) != 2:
            return f"metadata.fp8_block = [128, 128] on a tensor of shape {dims}: expected a " \
                   "2-D tensor (128x128 tiles are for weights)"
        if scaling == "delayed" and "tensor_amax" not in meta:
            return "metadata.tensor_amax is missing: expected the amax (a number >= 0) the " \
                   "delayed scale came from with fp8_scaling 'delayed'"
    if "tensor_amax" in meta and not (kind == "nvfp4" or (
            kind == "fp8" and meta.get("fp8_scaling", "tensor") != "block")):
        return f"metadata.tensor_amax = {_shown(meta['tensor_amax'])} on a {fmt} record" + \
            (" with fp8_scaling 'block'" if kind == "fp8" else "") + \
            ": expected none (a per-tensor amax belongs to nvfp4 and to fp8 with tensor or " \
            "delayed scaling)"
    if meta.get("block_2d"):
        if kind not in ("nvfp4", "fp8"):
            return f"metadata.block_2d = true on a {fmt} record: expected false or absent " \
                   "(2-D tiles are nvfp4 16x16 and fp8 blockwise 128x128)"
        if len(dims) != 2:
            return f"metadata.block_2d = true on a tensor of shape {dims}: expected a 2-D " \
                   "tensor (a weight)"
        if kind == "fp8" and meta.get("fp8_block") != [128, 128]:
            return "metadata.block_2d = true with fp8_block " \
                   f"{_shown(meta.get('fp8_block'))}: expected fp8_block [128, 128]"
    if "stochastic_seed" in meta and kind not in STOCHASTIC_KINDS:
        return f"metadata.stochastic_seed on a {fmt} record: expected none (stochastic " \
               "rounding applies to the MX, NVFP4 and FP8 formats)"
    if "rht_block" in meta:
        axis = meta.get("axis")
        if axis is None:
            return "metadata.rht_block on a GEMM result (axis null): expected none (only the " \
                   "operands of a GEMM are rotated)"
        if dims and axis < len(dims) and dims[axis] % meta["rht_block"]:
            return f"metadata.rht_block = {meta['rht_block']} but the rotated axis {axis} has " \
                   f"length {dims[axis]}: expected a multiple of the block (the operand is " \
                   "zero-padded to one)"
    return None


def check_manifest_item(item: dict) -> Optional[str]:
    """None if the manifest line is usable, else one line: the bad field, its value and
    what would be valid. The line's `format_version` and `file` are checked by the caller."""
    for spec in FIELDS:
        present, value = _lookup(item, spec.path)
        where = ".".join(spec.path)
        if not present:
            if spec.required and (len(spec.path) == 1 or isinstance(item.get(spec.path[0]),
                                                                    dict)):
                why = spec.check(object())
                return f"{where} is missing: expected {why}"
            continue
        why = spec.check(value)
        if why is not None:
            return f"{where} = {_shown(value)}: expected {why}"
    return _cross_field(item)


def _check_document(doc, fields) -> Optional[str]:
    if not isinstance(doc, dict):
        return f"the file holds {type(doc).__name__}: expected a JSON object"
    for key, check in fields:
        if key in doc:
            why = check(doc[key])
            if why is not None:
                return f"{key} = {_shown(doc[key])}: expected {why}"
    return None


_RUN_FIELDS = (
    ("run_id", text()), (capture_format.SCHEME_KEY, name()),
    ("mode", choice(("full", "stats", "mixed"))),
    ("control_iter", nullable(_INDEX)), ("collect_micro_batches", nullable(_INDEX)),
    ("world_size", nullable(integer(1, MAX_INDEX))),
    ("args", nullable(lambda v: None if isinstance(v, dict) else "an object")),
    ("quant_config", nullable(text())), ("start_time", nullable(text())),
)
_SUMMARY_FIELDS = (
    ("records", _COUNT), ("files", _COUNT), ("bytes", _COUNT), ("dropped", _COUNT),
    ("write_seconds", number(0.0)), ("stall_seconds", number(0.0)),
    ("capture_seconds", number(0.0)), ("error", nullable(text())),
    ("end_time", nullable(text())), ("run_id", text()), ("rank", _INDEX),
    ("exit_reason", nullable(text())),
)


def check_run_file(doc) -> Optional[str]:
    """None if a run-*.json document is usable, else what is wrong with it."""
    return _check_document(doc, _RUN_FIELDS)


def check_summary_file(doc) -> Optional[str]:
    """None if a summary-*.json document is usable, else what is wrong with it."""
    return _check_document(doc, _SUMMARY_FIELDS)
