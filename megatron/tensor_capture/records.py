"""Building capture records: metadata, statistics and host copies of one GEMM report.

A `CaptureItem` is what travels from the training step to the writer thread: metadata,
statistics and (in full mode) CPU copies of the high-precision and quantized tensors. It never
holds a device tensor. `Recorder.capture` builds it; `CaptureItem.record()` is the dict saved
to the record file and `manifest_entry()` the manifest line (docs/capture-format.md).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.quantization.formats import hifp8_scale_exponent
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.format import record_file_name, record_name, short_module_name
from megatron.quantization.gemm import VARIANT_KEYS, format_options
from megatron.tensor_capture.replay import operand_metadata, rotation_metadata
from megatron.tensor_capture.roles import (
    COMPONENT_OF_KIND, COMPONENT_TAG, LAYER_TYPE, RESULT, Role)
from megatron.tensor_capture.stats import Moments, block_scales, compute_stats


@dataclass(frozen=True)
class SiteInfo:
    """What record names need to know about one GEMM site (built once per run)."""

    site_name: str
    kind: str
    module_path: str
    module: str            # short name used in file names
    layer: int             # 1-based transformer layer, 0 for the output layer
    component: str         # attention | linear
    groups: Optional[int] = None            # attention: query groups on this rank
    heads_per_group: Optional[int] = None

    @property
    def layer_type(self) -> str:
        return LAYER_TYPE[self.component]

    @property
    def tag(self) -> str:
        return COMPONENT_TAG[self.component]

    def record_name(self, role: Role) -> str:
        return record_name(self.layer_type, self.layer, role.operation, role.phase, self.tag,
                           role.tensor_name, self.module)


def site_info(site, expert_offset: int = 0, groups: Optional[int] = None,
              heads_per_group: Optional[int] = None) -> SiteInfo:
    """SiteInfo of a megatron.quantization GemmSite."""
    path = site.name[:-3] if site.kind in ("attn_qk", "attn_pv") else site.name
    return SiteInfo(site_name=site.name, kind=site.kind, module_path=path,
                    module=short_module_name(site.name, expert_offset),
                    layer=site.layer_number or 0, component=COMPONENT_OF_KIND[site.kind],
                    groups=groups, heads_per_group=heads_per_group)


def attention_dims(layout: str, shape, groups: int, heads_per_group: int) -> Dict[str, int]:
    """Named sizes of an attention operand from its layout string and shape, so analysis can
    reshape `[b*groups, heads_per_group*sq, d]` back to `[b, heads, sq, d]`."""
    dims = {"groups": groups, "heads_per_group": heads_per_group}
    names = [part.strip() for part in layout.strip("[]").split(",")]
    if len(names) != len(shape):
        return dims
    for name, size in zip(names, shape):
        if name == "b*groups":
            dims["b"] = size // groups if groups else None
        elif name == "heads_per_group*sq":
            dims["sq"] = size // heads_per_group if heads_per_group else None
        else:
            dims[name] = size
    return dims


class HostBufferPool:
    """Reusable host buffers for tensor copies.

    The same shapes come back every micro-batch; reusing their buffers avoids fresh
    allocations, which for large tensors cost a page fault per 4 KiB on first touch. Buffers
    come back when the writer is done with a record; at most `max_bytes` are kept idle.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._free: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of `t` (detached; later in-place updates cannot change it)."""
        t = t.detach()
        key = (t.numel(), t.dtype)
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= buf.numel() * buf.element_size()
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        return buf.view(t.shape).copy_(t)

    def release(self, t: Optional[torch.Tensor]) -> None:
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            return
        size = t.numel() * t.element_size()
        with self._lock:
            if self._free_bytes + size <= self.max_bytes:
                self._free[(t.numel(), t.dtype)].append(t.reshape(-1))
                self._free_bytes += size


@dataclass
class CaptureItem:
    """One record on its way to the writer. Tensors are CPU copies (full mode) or None."""

    metadata: dict
    file_name: Optional[str]
    tensor: Optional[torch.Tensor] = None
    quantized: Optional[torch.Tensor] = None
    tensor_info: Optional[dict] = None
    quant_error: Optional[dict] = None
    # NVFP4 / FP8: the scales the operand was quantized with (full mode, CPU)
    scales: Optional[torch.Tensor] = None
    # Statistics deferred to the writer thread: record_stats arguments after the tensors,
    # and the format options of NVFP4 / FP8 operands.
    pending_stats: Optional[tuple] = None
    pending_options: Optional[dict] = None
    keep_tensors: bool = True
    # device / requires_grad / is_leaf of the tensor the GEMM saw (the copy has other ones).
    origin: Optional[dict] = None
    pool: Optional[HostBufferPool] = None
    # An earlier item of the same data (a re-quantized operand): reuse its Moments.
    moments_source: Optional["CaptureItem"] = None
    moments: Optional[Moments] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensor, self.quantized,
                                                            self.scales) if t is not None)

    def finish_stats(self) -> None:
        """Compute statistics left to the writer thread, then drop tensors not to be saved."""
        if self.pending_stats is not None:
            source = self.moments_source.moments if self.moments_source is not None else None
            self.tensor_info, self.quant_error, self.moments = compute_stats(
                self.tensor, self.quantized, *self.pending_stats, moments=source,
                options=self.pending_options)
            self.tensor_info.update(self.origin or {})
            self.pending_stats = None
            self.moments_source = None
        if not self.keep_tensors:
            self.release()

    def release(self) -> None:
        """Give the host copies back to their pool (the writer is done with them)."""
        if self.pool is not None:
            self.pool.release(self.tensor)
            self.pool.release(self.quantized)
        self.tensor = self.quantized = self.scales = None

    def record(self) -> dict:
        return capture_format.record_dict(self.tensor, self.tensor_info, self.metadata,
                                          self.quantized, self.quant_error, self.scales)

    def manifest_entry(self, file_name: Optional[str], nbytes: int) -> dict:
        return capture_format.manifest_entry(file_name, nbytes, self.metadata, self.tensor_info,
                                             self.quant_error)


class SameDataCache:
    """Finds an earlier record of the same data, so its statistics of x can be reused.

    The re-quantized operands of backward GEMMs (weight_dgrad, input_wgrad, ...) are views of
    tensors captured before. An entry matches on storage, offset, size, dtype and version,
    and only while the first tensor is alive (a weak reference): its memory cannot have been
    reused for other data in the meantime.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(),
                t.dtype)

    def get(self, t: torch.Tensor):
        key = self._key(t)
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        ref, version, value = entry
        alive = ref()
        return value if alive is not None and alive._version == version == t._version else None

    def put(self, t: torch.Tensor, value) -> None:
        with self._lock:
            self._entries[self._key(t)] = (weakref.ref(t), t._version, value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


@dataclass
class RunContext:
    """Per-rank constants stamped into every record's metadata."""

    run_id: str
    quant_scheme: str
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    world_size: int = 1


@dataclass
class Recorder:
    """Turns GEMM reports into CaptureItems and hands them to `submit`.

    Where statistics are computed: on an accelerator, in the training step on the device
    (fast, and only scalars leave it; stats mode then copies nothing to the host). On a CPU
    in stats mode, in the writer thread from a host copy: the writer has no I/O to do, so
    the training step pays for one copy instead of the statistics passes. On a CPU in full
    mode, in the training step, so the writer thread stays pure I/O.
    """

    context: RunContext
    submit: Callable[[CaptureItem], bool]
    full: bool = True
    counter: int = 0
    records: int = 0
    data_bytes: int = 0
    pool: HostBufferPool = field(default_factory=HostBufferPool)
    same_data: SameDataCache = field(default_factory=SameDataCache)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def capture(self, info: SiteInfo, config, role: Role, iteration: int, micro_batch: int,
                gemm: str, operand: str, hp: torch.Tensor, q: Optional[torch.Tensor],
                fmt: str, axis: Optional[int], extra: Optional[dict] = None) -> bool:
        """Build the record of one GEMM report and submit it; False if it was dropped.
        `extra` holds the report's keywords (scale_exponent, amax, seed, weight)."""
        extra = extra or {}
        with self._lock:       # backward may run on another thread than forward
            counter = self.counter
            self.counter += 1
        if axis is not None and hp.dim():
            axis = axis % hp.dim()
        scale_k, options, quantization = None, None, {}
        if q is not None:
            if fmt == "hifp8" and config.tensor_scaled(fmt):
                # The per-tensor scale of a tensor-scaled HiFP8 operand: the imposed one, else
                # its own (a capture sees whole operands).
                k = extra.get("scale_exponent")
                scale_k = int(k if k is not None else hifp8_scale_exponent(hp))
            amax = extra.get("amax")
            if amax is not None:
                amax = float(amax)      # a 0-d device tensor (delayed scaling): one sync
            options = format_options(config, fmt, hp.dim(), weight=bool(extra.get("weight")),
                                       amax=amax, **{k: extra[k] for k in VARIANT_KEYS
                                                     if k in extra})
            quantization = operand_metadata(config, fmt, hp, options, extra)
            if extra.get("seed") is not None:
                options["stochastic"] = True      # for the statistics (stats.quant_error)
        if role.kind != RESULT:
            quantization.update(rotation_metadata(config, gemm))
        meta = self._metadata(info, config, role, iteration, micro_batch, gemm, operand, hp,
                              q is not None, fmt, axis, counter, scale_k, quantization)
        file_name = record_file_name(self.context.run_id, counter, meta, info.module) \
            if self.full else None
        item = CaptureItem(metadata=meta, file_name=file_name, keep_tensors=self.full,
                           pool=self.pool)
        stats_args = (fmt, axis, config.mx.scale_mode, scale_k) if q is not None else ("none",)
        earlier = self.same_data.get(hp)
        if hp.device.type == "cpu" and not self.full:
            # Statistics later, in the writer thread, from the host copies.
            item.tensor = self.pool.copy(hp)
            item.quantized = self.pool.copy(q) if q is not None else None
            item.pending_stats = stats_args
            item.pending_options = options
            item.origin = {"device": str(hp.device), "requires_grad": bool(hp.requires_grad),
                           "is_leaf": bool(hp.is_leaf)}
            item.moments_source = earlier
        else:
            moments = earlier.moments if earlier is not None else None
            item.tensor_info, item.quant_error, item.moments = compute_stats(
                hp, q, *stats_args, moments=moments, options=options)
            if self.full:
                item.tensor = self.pool.copy(hp)
                item.quantized = self.pool.copy(q) if q is not None else None
                if q is not None:
                    scales = block_scales(hp, fmt, axis, options)
                    item.scales = None if scales is None else scales.detach().cpu()
        if earlier is None:
            self.same_data.put(hp, item)
        self.records += 1
        self.data_bytes += item.nbytes if self.full else 0
        return self.submit(item)

    def _metadata(self, info: SiteInfo, config, role: Role, iteration, micro_batch, gemm,
                  operand, hp, quantized: bool, fmt: str, axis, counter: int,
                  scale_k: Optional[int] = None, quantization: Optional[dict] = None) -> dict:
        ctx = self.context
        meta = {
            "layer_type": info.layer_type, "layer_idx": info.layer, "module": info.module_path,
            "operation": role.operation, "phase": role.phase, "component": info.tag,
            capture_format.SCHEME_KEY: ctx.quant_scheme, "tensor_name": role.tensor_name, "gemm": gemm,
            "operand": operand, "iteration": iteration, "micro_batch": micro_batch,
            "rank": ctx.rank, "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank,
            "dp_rank": ctx.dp_rank, "world_size": ctx.world_size, "save_time": None,
            "run_id": ctx.run_id, "counter": counter,
            "name": info.record_name(role), "site": info.site_name, "site_kind": info.kind,
            "format": fmt if quantized else "none", "axis": axis, "layout": role.layout,
        }
        if quantized:
            meta["scale_mode"] = config.mx.scale_mode
            saturate = config.saturate_for(fmt)
            if saturate is not None:
                meta["saturate"] = saturate
            if scale_k is not None:
                meta["hifp8_scaling"] = "tensor"
                meta["hifp8_scale_exponent"] = scale_k
        # How q was quantized beyond format, axis and scale rule (replay.py), and whether the
        # operand was rotated by the Hadamard transform before it was reported.
        meta.update(quantization or {})
        if info.component == "attention" and role.layout:
            meta["dims"] = attention_dims(role.layout, hp.shape, info.groups,
                                          info.heads_per_group)
        return meta
