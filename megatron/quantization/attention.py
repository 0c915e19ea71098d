"""Core attention with simulated low-precision QK^T and PV GEMMs, in memory linear in the
sequence length.

`QuantDotProductAttention` replaces megatron-core's unfused DotProductAttention. Its two GEMMs
are separate quantization sites, configured independently:

    qk  scores  = Q @ K^T   (reduction over the head dimension)
    pv  context = P @ V     (reduction over the key positions), P = softmax(scale * scores)

Layout. Grouped-query attention is computed per key/value group: the queries of the heads of a
group are stacked along the row axis, Q [b*groups, heads_per_group*sq, d] with row
r*sq + i = (head r of the group, position i), so K and V keep their natural size.

Four paths, chosen per call by dispatch.attention_path (the one rule, which the memory estimate
asks too):

* fused -- nothing in attention is quantized and nothing observes it (bf16 and linear_*
  schemes): `scaled_dot_product_attention` with `is_causal=True` (no materialised mask), so
  CUDA picks its flash or memory-efficient kernel, in training too. Grouped K/V heads are
  passed as they are (enable_gqa) where flash attention can take them, and expanded to one
  head per query head where it cannot on CUDA (sdpa_needs_expanded_kv), so no case falls to
  SDPA's math kernel and its full scores.
* chunked -- QK^T or PV quantized: the query rows are processed in chunks of a multiple of 32
  rows. A chunk computes its full score rows, the softmax and P @ V; only Q, K and V are
  saved, and backward recomputes each chunk (dK and dV accumulate over chunks, in fp32).
  Memory is O(sequence) per layer. Every quantized operand is bit for bit the unfused path's:
  fprop and dgrad operands are blocked along axes a chunk holds whole (the head dim, the key
  axis, the value dim), and the wgrad operands (Q, dS, P, dO), blocked along the row axis,
  are cut at multiples of 32 rows, so no MX block crosses a chunk (the last chunk keeps the
  partial tail block of the unfused path). Results equal the unfused path's up to float
  summation order.
  Each operand is quantized once: K^T and V, which every chunk uses whole, once per GEMM
  slot and call (the forward's fprop operands; backward's recomputation and its dgrad
  operands), not once per chunk. Under the implicit causal mask a chunk leaves out the key
  blocks none of its rows can see: their probabilities and score gradients are exactly zero
  (megatron's -10000 fill underflows in the softmax), so the chunk's scores, softmax, dP, dS,
  the quantizations of P and dS and the GEMMs producing dK and dV shrink to the keys it
  sees, and the two GEMMs that reduce over the keys (P @ V, dS @ K) take P and dS
  zero-padded, summing in the same order. Results are bit for bit those of quantizing in
  every chunk over all keys (for finite inputs whose every query row has a visible score
  above -9896), stochastic-rounding draws included: a stochastically rounded K^T or V is
  still quantized at every use, and stochastically rounded P or dS skip no key block.
  A chunk's fp32 scores take CHUNK_BYTES (32 MiB) on a CPU and a share of the free memory
  on a GPU (chunk_bytes_for).
* fused kernels -- where the chunked path would run, on CUDA with triton installed
  (--quant-kernels auto, the default; or "triton", which also runs them on CPU tensors under
  Triton's interpreter): the Triton kernels of kernels/attention.py compute the chunked
  path's arithmetic tile by tile in registers, with P and dS quantized inside the tiles (MX
  formats or none, round to nearest) and the whole operands quantized once per call by the
  sites' own quantization. Same roundings as the chunked path; results agree with it up to
  fp32 summation order and exp (see that module). Not for observed calls, explicit mask
  tensors, head dims over 128 or slots the kernels do not cover.
* unfused (the reference) -- the full [b, heads, sq, sk] scores, as megatron-core computes
  them: used when an observer that needs whole operands (tensor capture) watches a site, so
  captured tensors are whole GEMM operands (observers that accept pieces, such as the
  quantization telemetry, stay on the chunked path and see each chunk of Q, P, dS, dO once
  and K and V once); for attention dropout in training, attention sinks (softmax offset), query-key
  layer scaling and masks of another shape than [b or 1, 1, sq, sk]; and everywhere when
  the settings' `impl` is "unfused" (--quant-attention-impl unfused, for checks and
  benchmarks).

The module's `attention` settings (config.AttentionSettings: impl, chunk rows, operand sharing,
causal block skipping) come from the model's QuantConfig through the converter; the kernel
mode from its sites' runtime.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType

from megatron.quantization import dispatch
from megatron.quantization.config import AttentionSettings, MatmulQuantConfig
from megatron.quantization.gemm import (
    SiteState, gemm_operand, gemm_product, gemm_result, quantize_slot, quantized_matmul,
    whole_tensor_scale)
from megatron.quantization.local_attention import LocalDotProductAttention
from megatron.quantization.observers import GemmSite, accepts_pieces, observer_for

MX_ROWS = 32                   # chunks start at multiples of the MX block size
CHUNK_BYTES = 32 * 2 ** 20     # fp32 score bytes of one chunk (all groups of the micro-batch)
# On a GPU a chunk's scores take 1/GPU_CHUNK_SHARE of the free memory (a chunk's backward holds
# about ten tensors of that size at once), between CHUNK_BYTES and GPU_CHUNK_MAX_BYTES: larger
# chunks launch fewer kernels, smaller ones skip more of the causal mask's empty key blocks.
GPU_CHUNK_SHARE = 32
GPU_CHUNK_MAX_BYTES = 512 * 2 ** 20


def chunk_bounds(rows: int, chunk_rows: int) -> List[Tuple[int, int]]:
    """[(start, end)] covering `rows`, every start a multiple of MX_ROWS."""
    if chunk_rows < MX_ROWS or chunk_rows % MX_ROWS:
        raise ValueError(f"chunk_rows {chunk_rows} is not a positive multiple of {MX_ROWS}")
    return [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def chunk_bytes_for(free_bytes: Optional[int]) -> int:
    """fp32 score bytes of one chunk: CHUNK_BYTES without a device memory figure (CPU), else
    free_bytes / GPU_CHUNK_SHARE clamped to [CHUNK_BYTES, GPU_CHUNK_MAX_BYTES]."""
    if free_bytes is None:
        return CHUNK_BYTES
    return int(min(GPU_CHUNK_MAX_BYTES, max(CHUNK_BYTES, free_bytes // GPU_CHUNK_SHARE)))


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Memory a CUDA device can still give this process: what the driver reports free plus
    what PyTorch's caching allocator holds unused; None on other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def default_chunk_rows(batch_groups: int, keys: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 scores take about `chunk_bytes`."""
    rows = chunk_bytes // max(1, batch_groups * keys * 4)
    return max(MX_ROWS, rows // MX_ROWS * MX_ROWS)


def chunk_key_extent(r0: int, r1: int, sq: int, sk: int) -> int:
    """The keys [0, extent) that rows [r0, r1) of the grouped layout (row = head * sq + query
    position) can see under the causal mask (key j is hidden from query i when
    j > i + sk - sq), rounded up to a multiple of MX_ROWS; sk when a row of the chunk sees no
    key at all (megatron's mask then spreads it evenly over every key)."""
    if r1 - r0 >= sq or r0 // sq != (r1 - 1) // sq:
        first, last = 0, sq - 1          # the chunk wraps from one head's rows to the next
    else:
        first, last = r0 % sq, (r1 - 1) % sq
    if first + sk - sq < 0:
        return sk
    extent = last + sk - sq + 1
    return min(sk, -(-extent // MX_ROWS) * MX_ROWS)


def grouped_layout(query, key, value):
    """[s, b, heads, d] -> q [b*groups, heads_per_group*sq, d], k_t [b*groups, d, sk],
    v [b*groups, sk, dv]: the queries of one group share its K and V."""
    sq, b, np_, hn = query.shape
    sk, ng = key.size(0), key.size(2)
    q = query.permute(1, 2, 0, 3).reshape(b * ng, (np_ // ng) * sq, hn)
    k_t = key.permute(1, 2, 3, 0).reshape(b * ng, hn, sk)
    v = value.permute(1, 2, 0, 3).reshape(b * ng, sk, value.size(3))
    return q, k_t, v


def heads_layout(context, query):
    """[b*groups, heads_per_group*sq, dv] -> [sq, b, heads*dv]."""
    sq, b, np_, _ = query.shape
    context = context.view(b, np_, sq, -1).permute(2, 0, 1, 3)
    return context.reshape(sq, b, -1)


def _accumulate(total, part, shape, dim):
    """dK^T and dV gather a contribution from every chunk, summed in fp32; a chunk that sees
    only the first keys adds to those (`dim` is the key axis of `shape`)."""
    part = part.float()
    if total is None and part.shape == shape:
        return part
    if total is None:
        total = part.new_zeros(shape)
        total.narrow(dim, 0, part.size(dim)).copy_(part)
        return total
    total.narrow(dim, 0, part.size(dim)).add_(part)
    return total


def _pad_keys(t: torch.Tensor, keys: int) -> torch.Tensor:
    """A chunk's quantized P or dS [..., rows, extent] with zeros for the keys past its extent:
    the GEMMs that reduce over the keys (P @ V, dS @ K) then run over all keys as without
    skipping, so they sum in the same order."""
    n = t.size(-1)
    if n == keys:
        return t
    padded = t.new_empty(*t.shape[:-1], keys)
    padded[..., :n] = t
    padded[..., n:] = 0
    return padded


# Operands the chunked path cuts into row chunks: (gemm, operand) of the QK^T and PV GEMMs.
# A tensor-scaled operand among them must use the scale of the whole operand.
_QUERY_SIDE = (("fprop", "a"), ("wgrad", "a"))                 # Q (QK^T), P (PV)
_GRAD_SIDE = (("dgrad", "grad_output"), ("wgrad", "grad_output"))   # dS (QK^T), dO (PV)
# Operand slots (gemm, side) cut along the keys when a chunk skips the keys it cannot see:
# dS of QK^T (dgrad a, wgrad b) and P of PV (fprop a, wgrad a).
_KEY_CUT_SLOTS = MappingProxyType({"qk": (("dgrad", "a"), ("wgrad", "b")),
                                   "pv": (("fprop", "a"), ("wgrad", "a"))})


def _slot_formats(config: MatmulQuantConfig) -> dict:
    return {("fprop", "a"): config.fprop.a, ("wgrad", "a"): config.wgrad.a,
            ("dgrad", "grad_output"): config.dgrad.a, ("wgrad", "grad_output"): config.wgrad.b}


def _needs_whole_scale(config: MatmulQuantConfig, keys) -> bool:
    formats = _slot_formats(config)
    return any(config.tensor_scaled(formats[key]) for key in keys)


def _whole_scales(config: MatmulQuantConfig, keys, amax: torch.Tensor) -> dict:
    """{(gemm, operand): imposed scale} of the tensor-scaled operands among `keys`, all
    cut from one tensor whose whole amax is `amax`."""
    formats = _slot_formats(config)
    return {key: whole_tensor_scale(formats[key], amax) for key in keys
            if config.tensor_scaled(formats[key])}


def _stochastic_slots(config: MatmulQuantConfig, slots) -> bool:
    return any(config.stochastic_slot(gemm, side, getattr(getattr(config, gemm), side))
               for gemm, side in slots)


def _piece_observer(observer, first: bool):
    """`observer` for one chunk: the b operands (K^T, V) are whole in every chunk and reported
    with the first only."""
    if observer is None:
        return None

    def observe(gemm, operand, *report, **extra):
        if operand == "b" and not first:
            return
        observer(gemm, operand, *report, **extra)

    return observe


def _amax(pieces) -> torch.Tensor:
    """max |x| of a tensor seen in pieces (0-d float32, on the device)."""
    return torch.stack([p.detach().abs().amax().float() for p in pieces]).amax()


class _Shared:
    """The b operand of one GEMM slot that every chunk uses whole: K^T (QK^T: fprop along the
    head dim, dgrad along the keys) or V (PV: fprop along the keys, dgrad along the value dim).

    Its quantization does not depend on the chunking, so it is computed once and reused by
    every chunk when the slot is `reusable` (round to nearest, its own scale); a stochastically
    rounded or delayed-scaled slot is quantized at every use, as the per-chunk GEMMs did (the
    same draws, the same history steps). `share=False` quantizes at every use regardless."""

    def __init__(self, config: MatmulQuantConfig, gemm: str, hp: torch.Tensor, axis: int,
                 state: Optional[SiteState], share: bool = True):
        self.config, self.gemm, self.hp, self.axis, self.state = config, gemm, hp, axis, state
        self.fmt = getattr(config, gemm).b
        self.share = share and config.reusable(gemm, "b", self.fmt)
        self.quantized = None

    def use(self, observer=None, state: Optional[SiteState] = None) -> torch.Tensor:
        """The quantized operand (the high-precision one for format "none"), reported whole."""
        state = state if state is not None else self.state
        if not self.share:
            return gemm_operand(observer, self.config, self.gemm, "b", "b", self.hp, self.fmt,
                                self.axis, state=state)
        if self.quantized is None:
            self.quantized = quantize_slot(self.config, self.gemm, "b", "b", self.hp,
                                           self.fmt, self.axis, state=state)
        q, extra = self.quantized
        if observer is not None:
            observer(self.gemm, "b", self.hp, q, self.fmt, self.axis, **extra)
        return self.hp if q is None else q


class _Gemms:
    """The QK^T and PV GEMM sites of one chunked attention call: configs, states, observers,
    whether shared operands are quantized once, and the per-chunk GEMMs. They are
    quantized_matmul's three GEMMs on 3-D operands, each operand blocked along its GEMM's
    reduction axis (2: the last, 1: the rows) and reported as quantized_matmul reports it."""

    def __init__(self, qk_site, pv_site, observers, share: bool):
        self.qk_cfg, self.pv_cfg = (s.active_config if s is not None else MatmulQuantConfig()
                                    for s in (qk_site, pv_site))
        self.qk_state, self.pv_state = (s.state if s is not None else None
                                        for s in (qk_site, pv_site))
        self.observers, self.share = observers, share

    def whole_operand(self, site: str, gemm: str, name: str, side: str, hp: torch.Tensor,
                      axis: int) -> torch.Tensor:
        """One whole operand of the QK^T ("qk") or PV ("pv") site quantized for its GEMM slot
        (the fused kernels' quantizer: they quantize only P and dS themselves)."""
        cfg, state = ((self.qk_cfg, self.qk_state) if site == "qk"
                      else (self.pv_cfg, self.pv_state))
        q, _ = quantize_slot(cfg, gemm, name, side, hp, getattr(getattr(cfg, gemm), side),
                             axis, state=state)
        return hp if q is None else q

    def scores(self, q_c, keys: int, k_fprop: _Shared, scales, observer=None):
        """Q_c @ K^T[:, :, :keys] (fprop of QK^T for one chunk)."""
        cfg = self.qk_cfg
        qa = gemm_operand(observer, cfg, "fprop", "a", "a", q_c, cfg.fprop.a, 2, scales,
                          self.qk_state)
        kb = k_fprop.use(observer)
        return gemm_result(observer, "fprop", "output",
                           gemm_product(cfg, "fprop", qa, kb[..., :keys]))

    def context(self, probs, v_fprop: _Shared, scales, observer=None):
        """P_c @ V (fprop of PV for one chunk), over all keys."""
        cfg = self.pv_cfg
        pa = gemm_operand(observer, cfg, "fprop", "a", "a", probs, cfg.fprop.a, 2, scales,
                          self.pv_state)
        vb = v_fprop.use(observer)
        return gemm_result(observer, "fprop", "output",
                           gemm_product(cfg, "fprop", _pad_keys(pa, vb.size(-2)), vb))

    def probs_grad(self, grad_c, keys: int, v_dgrad: _Shared, scales, observer=None,
                   state=None):
        """dP_c = dO_c @ V[:, :keys]^T (dgrad of PV for one chunk)."""
        cfg, state = self.pv_cfg, state if state is not None else self.pv_state
        qg = gemm_operand(observer, cfg, "dgrad", "grad_output", "a", grad_c, cfg.dgrad.a, 2,
                          scales, state)
        vb = v_dgrad.use(observer, state)
        return gemm_result(observer, "dgrad", "grad_a",
                           gemm_product(cfg, "dgrad", qg, vb[:, :keys].transpose(-1, -2)))

    def value_grad(self, probs, grad_c, scales, observer=None):
        """dV[:, :keys] contribution P_c^T @ dO_c (wgrad of PV for one chunk)."""
        cfg = self.pv_cfg
        pa = gemm_operand(observer, cfg, "wgrad", "a", "a", probs, cfg.wgrad.a, 1, scales,
                          self.pv_state)
        qg = gemm_operand(observer, cfg, "wgrad", "grad_output", "b", grad_c, cfg.wgrad.b, 1,
                          scales, self.pv_state)
        return gemm_result(observer, "wgrad", "grad_b",
                           gemm_product(cfg, "wgrad", pa.transpose(-1, -2), qg))

    def query_grad(self, grad_scores, k_dgrad: _Shared, scales, observer=None):
        """dQ_c = dS_c @ K (dgrad of QK^T for one chunk), over all keys."""
        cfg = self.qk_cfg
        qg = gemm_operand(observer, cfg, "dgrad", "grad_output", "a", grad_scores, cfg.dgrad.a,
                          2, scales, self.qk_state)
        kb = k_dgrad.use(observer)
        return gemm_result(observer, "dgrad", "grad_a",
                           gemm_product(cfg, "dgrad", _pad_keys(qg, kb.size(-1)),
                                        kb.transpose(-1, -2)))

    def key_grad(self, q_c, grad_scores, scales, observer=None):
        """dK^T[:, :, :keys] contribution Q_c^T @ dS_c (wgrad of QK^T for one chunk)."""
        cfg = self.qk_cfg
        qa = gemm_operand(observer, cfg, "wgrad", "a", "a", q_c, cfg.wgrad.a, 1, scales,
                          self.qk_state)
        qg = gemm_operand(observer, cfg, "wgrad", "grad_output", "b", grad_scores, cfg.wgrad.b,
                          1, scales, self.qk_state)
        return gemm_result(observer, "wgrad", "grad_b",
                           gemm_product(cfg, "wgrad", qa.transpose(-1, -2), qg))


class _ChunkedAttention(torch.autograd.Function):
    """out[:, rows] = softmax_fn(Q[:, rows] @ K^T) @ V chunk by chunk (QK^T and PV per their
    sites' configs). Only q, k_t and v are kept: backward recomputes each chunk's
    probabilities and runs the GEMMs of PV's and QK^T's backward on them, the very operations
    the unfused path's autograd runs.

    K^T and V, whole in every chunk, are quantized once per GEMM slot (_Shared). Chunk i sees
    the keys [0, extents[i]) (fewer than all under the causal mask when it skips the key blocks
    its rows cannot see): its scores, probabilities and their gradients have that many
    columns, and the GEMMs that reduce over the keys take them zero-padded to all keys.

    Tensor-scaled operands (HiFP8 with --hifp8-scaling tensor, NVFP4, FP8 tensorwise) cut into
    chunks take the scale of the whole operand, as in the unfused path: Q and dO directly; P
    and dS, which exist only chunk by chunk, from a first pass over the chunks that only
    measures their amax."""

    @staticmethod
    def forward(ctx, q, k_t, v, softmax_fn, gemms, bounds, extents):
        ctx.save_for_backward(q, k_t, v)
        ctx.softmax_fn, ctx.gemms, ctx.bounds, ctx.extents = softmax_fn, gemms, bounds, extents
        qk_cfg, pv_cfg = gemms.qk_cfg, gemms.pv_cfg
        qk_obs, pv_obs = gemms.observers
        qk_scales, pv_scales = {}, {}
        if _needs_whole_scale(qk_cfg, _QUERY_SIDE + _GRAD_SIDE):
            qk_scales = _whole_scales(qk_cfg, _QUERY_SIDE, _amax([q]))
        k_fprop = _Shared(qk_cfg, "fprop", k_t, 1, gemms.qk_state, gemms.share)
        v_fprop = _Shared(pv_cfg, "fprop", v, 1, gemms.pv_state, gemms.share)

        def probs(i, observer=None):
            (r0, r1), keys = bounds[i], extents[i]
            return softmax_fn(gemms.scores(q[:, r0:r1], keys, k_fprop, qk_scales, observer),
                              r0, r1, keys)

        if _needs_whole_scale(pv_cfg, _QUERY_SIDE):
            pv_scales = _whole_scales(pv_cfg, _QUERY_SIDE,
                                      _amax(probs(i) for i in range(len(bounds))))
        ctx.scales = (qk_scales, pv_scales)
        return torch.cat([
            gemms.context(probs(i, _piece_observer(qk_obs, i == 0)), v_fprop, pv_scales,
                          _piece_observer(pv_obs, i == 0))
            for i in range(len(bounds))], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        q, k_t, v = ctx.saved_tensors
        gemms, bounds, extents = ctx.gemms, ctx.bounds, ctx.extents
        qk_cfg, pv_cfg = gemms.qk_cfg, gemms.pv_cfg
        qk_scales, pv_scales = (dict(s) for s in ctx.scales)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # The recomputed forward's K^T, and the dgrad operands K^T (along the keys) and V.
        k_fprop = _Shared(qk_cfg, "fprop", k_t, 1, gemms.qk_state, gemms.share)
        k_dgrad = _Shared(qk_cfg, "dgrad", k_t, 2, gemms.qk_state, gemms.share)
        v_dgrad = _Shared(pv_cfg, "dgrad", v, 2, gemms.pv_state, gemms.share)
        shared = (k_fprop, v_dgrad)
        if _needs_whole_scale(pv_cfg, _GRAD_SIDE):
            pv_scales.update(_whole_scales(pv_cfg, _GRAD_SIDE, _amax([grad_out])))
        if _needs_whole_scale(qk_cfg, _GRAD_SIDE):
            qk_scales.update(_whole_scales(qk_cfg, _GRAD_SIDE, _amax(
                _ChunkedAttention._score_grads(q, grad_out, ctx, shared, qk_scales,
                                               pv_scales))))
        qk_obs, pv_obs = gemms.observers
        grad_q_parts, grad_k, grad_v = [], None, None
        for i, ((r0, r1), keys) in enumerate(zip(bounds, extents)):
            # The forward GEMM of the recomputation is not reported (the forward reported it).
            probs, scores = _ChunkedAttention._recompute(q, ctx, k_fprop, qk_scales, i,
                                                         need_q or need_k)
            qk_piece, pv_piece = _piece_observer(qk_obs, i == 0), _piece_observer(pv_obs, i == 0)
            grad_c = grad_out[:, r0:r1]
            grad_probs = gemms.probs_grad(grad_c, keys, v_dgrad, pv_scales, pv_piece)
            if need_v:
                grad_v = _accumulate(grad_v, gemms.value_grad(probs.detach(), grad_c, pv_scales,
                                                              pv_piece), v.shape, 1)
            if not (need_q or need_k):
                continue
            grad_scores = torch.autograd.grad(probs, scores, grad_probs)[0]
            if need_q:
                grad_q_parts.append(gemms.query_grad(grad_scores, k_dgrad, qk_scales, qk_piece))
            if need_k:
                grad_k = _accumulate(grad_k, gemms.key_grad(q[:, r0:r1], grad_scores, qk_scales,
                                                            qk_piece), k_t.shape, 2)
        grad_q = torch.cat(grad_q_parts, dim=1) if need_q else None
        grad_k = grad_k.to(k_t.dtype) if grad_k is not None else None
        grad_v = grad_v.to(v.dtype) if grad_v is not None else None
        return grad_q, grad_k, grad_v, None, None, None, None

    @staticmethod
    def _recompute(q, ctx, k_fprop, qk_scales, i, track: bool):
        """(probabilities, scores) of chunk i, the probabilities differentiable with respect to
        the scores when `track`."""
        (r0, r1), keys = ctx.bounds[i], ctx.extents[i]
        with torch.no_grad():
            scores = ctx.gemms.scores(q[:, r0:r1], keys, k_fprop, qk_scales)
        scores.requires_grad_(track)
        with torch.enable_grad():
            return ctx.softmax_fn(scores, r0, r1, keys), scores

    @staticmethod
    def _score_grads(q, grad_out, ctx, shared, qk_scales, pv_scales):
        """dS of every chunk (the gradient reaching the QK^T GEMM), as backward computes it;
        only their amax is used."""
        k_fprop, v_dgrad = shared
        for i, ((r0, r1), keys) in enumerate(zip(ctx.bounds, ctx.extents)):
            probs, scores = _ChunkedAttention._recompute(q, ctx, k_fprop, qk_scales, i, True)
            # Measures amaxes only: a throwaway state, so no stochastic draws are counted.
            grad_probs = ctx.gemms.probs_grad(grad_out[:, r0:r1], keys, v_dgrad, pv_scales,
                                              state=SiteState("", ctx.gemms.pv_cfg))
            yield torch.autograd.grad(probs, scores, grad_probs)[0]


# What CUDA's flash attention takes: fp16/bf16, no attn_mask, equal q/k/v head dims <= 256.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def sdpa_needs_expanded_kv(device_type: str, dtype: torch.dtype, masked: bool, grouped: bool,
                           head_dim: int, value_head_dim: int) -> bool:
    """Whether grouped K and V must reach SDPA expanded to one head per query head rather than
    with enable_gqa. On CUDA (torch 2.5-2.13) flash is the one kernel sure to take enable_gqa:
    the memory-efficient kernel refuses it, cuDNN's takes it on some GPUs only and by default
    ranks after the math kernel, which materialises the [b, heads, sq, sk] scores. So where
    flash cannot run (fp32, an explicit mask, head dims over 256 or unequal) the heads are
    expanded, which the memory-efficient kernel takes. The CPU's flash kernel takes
    masks, fp32 and enable_gqa."""
    if not grouped or device_type != "cuda":
        return False
    flash_runs = (dtype in FLASH_DTYPES and not masked
                  and head_dim == value_head_dim <= FLASH_MAX_HEAD_DIM)
    return not flash_runs


class QuantDotProductAttention(LocalDotProductAttention):
    """Core attention whose QK^T and PV GEMMs are independently quantized sites."""

    qk_site: Optional[GemmSite] = None
    pv_site: Optional[GemmSite] = None
    attention: AttentionSettings = AttentionSettings()

    @staticmethod
    def _config(site: Optional[GemmSite]) -> MatmulQuantConfig:
        return site.active_config if site is not None else MatmulQuantConfig()

    @staticmethod
    def _observer(site: Optional[GemmSite]):
        return observer_for(site) if site is not None else None

    @staticmethod
    def _state(site: Optional[GemmSite]) -> Optional[SiteState]:
        return site.state if site is not None else None

    @property
    def kernels(self) -> str:
        """The kernel mode of this module's sites (--quant-kernels)."""
        site = self.qk_site or self.pv_site
        return site.state.runtime.kernels if site is not None and site.state else "auto"

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention bias need TransformerEngine attention")
        qk_obs, pv_obs = self._observer(self.qk_site), self._observer(self.pv_site)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        path = dispatch.attention_path(
            self.call_facts(query, value, attention_mask, (qk_obs, pv_obs)), self.kernels)
        if path.name == "sdpa":
            return self._fused(query, key, value, attention_mask, mask_type)
        if path.name == "reference":
            return self._reference(query, key, value, attention_mask, attn_mask_type,
                                   qk_obs, pv_obs)
        q, k_t, v = grouped_layout(query, key, value)
        if path.name == "triton":
            context = self._fused_quantized(q, k_t, v, mask_type, query.size(0))
        else:
            context = self._chunked(q, k_t, v, attention_mask, mask_type, query, key,
                                    (qk_obs, pv_obs))
        return heads_layout(context, query)

    def call_facts(self, query, value, attention_mask, observers) -> dispatch.AttentionCall:
        """What decides this call's path (dispatch.attention_path)."""
        qk_cfg, pv_cfg = self._config(self.qk_site), self._config(self.pv_site)
        softmax = self.scale_mask_softmax
        # As _masked_softmax: fp32 inputs, or half inputs the softmax upcasts.
        in_fp32 = query.dtype == torch.float32 or (softmax.input_in_float16
                                                   and softmax.softmax_in_fp32)
        return dispatch.AttentionCall(
            impl=self.attention.impl, plain_softmax=self._plain_softmax(),
            row_mask=self._row_mask_ok(attention_mask),
            quantized=qk_cfg.enabled or pv_cfg.enabled,
            observed=any(o is not None for o in observers),
            whole=any(o is not None and not accepts_pieces(o) for o in observers),
            device=query.device, dtype=query.dtype, head_dim=query.size(-1),
            value_dim=value.size(-1), mask_tensor=attention_mask is not None,
            softmax_in_fp32=in_fp32, qk_config=qk_cfg, pv_config=pv_cfg)

    # -- which path ----------------------------------------------------------------------

    def _plain_softmax(self) -> bool:
        """Softmax without dropout RNG, sinks or layer scaling: what fused and chunked compute."""
        dropout = self.training and self.config.attention_dropout > 0.0
        return (not dropout and self.softmax_offset is None
                and self.scale_mask_softmax.scale is None)

    @staticmethod
    def _row_mask_ok(mask) -> bool:
        return mask is None or (mask.dim() == 4 and mask.size(1) == 1)

    # -- fused: nothing quantized ----------------------------------------------------------

    def _fused(self, query, key, value, attention_mask, mask_type):
        sq, b, np_, _ = query.shape
        sk, ng = key.size(0), key.size(2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        allowed = None
        if causal and sq != sk:
            # SDPA aligns is_causal top-left; megatron's mask is aligned bottom-right.
            allowed = ~self.default_attention_mask(query, key, None, mask_type)
            causal = False
        elif attention_mask is not None:
            allowed = ~attention_mask     # megatron: True = masked; SDPA: True = attend
        grouped = ng != np_
        if sdpa_needs_expanded_kv(q.device.type, q.dtype, allowed is not None, grouped,
                                  q.size(-1), v.size(-1)):
            # enable_gqa here would fall to the math kernel (full scores). Query head h
            # reads group h // (np / ng), as with enable_gqa.
            k, v = (t.repeat_interleave(np_ // ng, dim=1) for t in (k, v))
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal,
                                             scale=self.softmax_scale, enable_gqa=grouped)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    # -- chunked: quantized, linear memory -------------------------------------------------

    def _chunked(self, q, k_t, v, attention_mask, mask_type, query, key,
                 observers=(None, None)):
        sq, sk, ng, rows = query.size(0), key.size(0), key.size(2), q.size(1)
        chunk_rows = self.attention.chunk_rows or default_chunk_rows(
            q.size(0), sk, chunk_bytes_for(free_device_bytes(q.device)))
        bounds = chunk_bounds(rows, chunk_rows)
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        gemms = _Gemms(self.qk_site, self.pv_site, observers, self.attention.share_operands)
        extents = [sk] * len(bounds)
        if causal and self._skips_masked_blocks(gemms):
            extents = [chunk_key_extent(r0, r1, sq, sk) for r0, r1 in bounds]

        def chunk_mask(r0: int, r1: int, keys: int):
            positions = torch.arange(r0, r1, device=q.device) % sq
            if causal:
                # causal_mask(): key j is hidden from query i when j > i + sk - sq.
                key_ids = torch.arange(keys, device=q.device)
                return (key_ids[None, :] > positions[:, None] + (sk - sq))[None, None]
            if attention_mask is None:
                return None
            mask = attention_mask[:, :, positions, :]
            # Per-sample masks [b, 1, ...] -> one per (sample, group) row block of q.
            return mask.repeat_interleave(ng, dim=0) if mask.size(0) > 1 else mask

        def softmax_fn(scores, r0, r1, keys):
            scores = scores * self.softmax_scale
            return self._masked_softmax(scores.unsqueeze(1), chunk_mask(r0, r1, keys)).squeeze(1)

        return _ChunkedAttention.apply(q, k_t, v, softmax_fn, gemms, bounds, extents)

    def _skips_masked_blocks(self, gemms: _Gemms) -> bool:
        """Whether chunks may leave out the key blocks the causal mask hides from all their
        rows. Those blocks' probabilities and score gradients are exactly zero (megatron's
        -10000 fill underflows in the softmax), so nothing changes -- except what observers
        see (the operands would be cut), and stochastically rounded P or dS, whose draws
        follow the operand's shape: then no block is skipped."""
        if not self.attention.skip_masked_blocks or any(o is not None for o in gemms.observers):
            return False
        return not (_stochastic_slots(gemms.qk_cfg, _KEY_CUT_SLOTS["qk"])
                    or _stochastic_slots(gemms.pv_cfg, _KEY_CUT_SLOTS["pv"]))

    def _masked_softmax(self, scores, mask):
        """megatron-core's FusedScaleMaskSoftmax (its torch path), for any number of rows."""
        softmax = self.scale_mask_softmax
        in_fp32 = softmax.input_in_float16 and softmax.softmax_in_fp32
        x = scores.float() if in_fp32 else scores
        if mask is not None:
            x = softmax.mask_func(x, mask)
        probs = torch.softmax(x, dim=-1)
        return probs.to(scores.dtype) if in_fp32 else probs

    # -- fused Triton kernels: quantized, linear memory, on the GPU --------------------------

    def _fused_quantized(self, q, k_t, v, mask_type, sq: int):
        """The grouped-layout attention by the fused kernels: the whole operands quantized
        once per call and GEMM slot by the sites' own quantization, P and dS in the tiles."""
        from megatron.quantization.kernels.attention import TileFormats, TritonQuantizedAttention
        gemms = _Gemms(self.qk_site, self.pv_site, (None, None), True)
        return TritonQuantizedAttention.apply(
            q, k_t, v, gemms.whole_operand, TileFormats.of(gemms.qk_cfg, gemms.pv_cfg),
            self.softmax_scale, mask_type == AttnMaskType.causal, sq,
            self.attention.skip_masked_blocks)

    # -- unfused: the reference --------------------------------------------------------------

    def _reference(self, query, key, value, attention_mask, attn_mask_type, qk_obs, pv_obs):
        """The unfused path on [s, b, heads, d] inputs, reporting to the given observers."""
        q, k_t, v = grouped_layout(query, key, value)
        mask = self.default_attention_mask(query, key, attention_mask, attn_mask_type)
        context = self._unfused(q, k_t, v, mask, self._config(self.qk_site),
                                self._config(self.pv_site), qk_obs, pv_obs, query, key)
        return heads_layout(context, query)

    def _unfused(self, q, k_t, v, attention_mask, qk_cfg, pv_cfg, qk_obs, pv_obs, query, key):
        sq, b, np_, _ = query.shape
        sk, ng = key.size(0), key.size(2)
        scores = quantized_matmul(q, k_t, qk_cfg, observer=qk_obs,
                                  state=self._state(self.qk_site))
        scores = (scores * self.softmax_scale).view(b, np_, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        probs = probs.view(b * ng, (np_ // ng) * sq, sk)
        return quantized_matmul(probs, v, pv_cfg, observer=pv_obs,
                                state=self._state(self.pv_site))


def reference_attention(module: QuantDotProductAttention, query, key, value, attention_mask,
                        attn_mask_type=None) -> torch.Tensor:
    """The unfused path of `module` (full scores), whichever path it would choose: the
    reference the tests check the other paths against."""
    return module._reference(query, key, value, attention_mask, attn_mask_type, None, None)
