"""Core attention with simulated low-precision QK^T and PV GEMMs, in memory linear in the
sequence length.

`QuantDotProductAttention` replaces megatron-core's unfused DotProductAttention. Its two GEMMs
are separate quantization sites, configured independently:

    qk  scores  = Q @ K^T   (reduction over the head dimension)
    pv  context = P @ V     (reduction over the key positions), P = softmax(scale * scores)

Layout. Grouped-query attention is computed per key/value group: the queries of the heads of a
group are stacked along the row axis, Q [b*groups, heads_per_group*sq, d] with row
r*sq + i = (head r of the group, position i), so K and V keep their natural size.

Three paths, chosen per call:

* fused -- nothing in attention is quantized and nothing observes it (bf16 and linear_*
  schemes): `scaled_dot_product_attention` with `is_causal=True` (no materialised mask), so
  CUDA picks its flash or memory-efficient kernel, in training too.
* chunked -- QK^T or PV quantized: the query rows are processed in chunks of a multiple of 32
  rows. A chunk computes its full score rows, the softmax and P @ V; only Q, K and V are
  saved, and backward recomputes each chunk (dK and dV accumulate over chunks, in fp32).
  Memory is O(sequence) per layer. Every quantized operand is bit for bit the unfused path's:
  fprop and dgrad operands are blocked along axes a chunk holds whole (the head dim, the key
  axis, the value dim), and the wgrad operands (Q, dS, P, dO), blocked along the row axis,
  are cut at multiples of 32 rows, so no MX block crosses a chunk (the last chunk keeps the
  partial tail block of the unfused path). Results equal the unfused path's up to float
  summation order.
* unfused (the reference) -- the full [b, heads, sq, sk] scores, as megatron-core computes
  them: used when an observer that needs whole operands (tensor capture) watches a site, so
  captured tensors are whole GEMM operands (observers that accept pieces, such as the
  quantization telemetry, stay on the chunked path and see each chunk of Q, P, dS, dO once
  and K and V once); for attention dropout in training, attention sinks (softmax offset), query-key
  layer scaling and masks of another shape than [b or 1, 1, sq, sk]; and everywhere when
  `impl` is "unfused" (--quant-attention-impl unfused, for checks and benchmarks).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType

from megatron.quantization.gemm import (
    MatmulQuantConfig, SiteState, matmul_grads, quantized_matmul, whole_tensor_scale)
from megatron.quantization.local_attention import LocalDotProductAttention
from megatron.quantization.observers import GemmSite, accepts_pieces, observer_for

MX_ROWS = 32                   # chunks start at multiples of the MX block size
CHUNK_BYTES = 32 * 2 ** 20     # fp32 score bytes of one chunk (all groups of the micro-batch)


def chunk_bounds(rows: int, chunk_rows: int) -> List[Tuple[int, int]]:
    """[(start, end)] covering `rows`, every start a multiple of MX_ROWS."""
    if chunk_rows < MX_ROWS or chunk_rows % MX_ROWS:
        raise ValueError(f"chunk_rows {chunk_rows} is not a positive multiple of {MX_ROWS}")
    return [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def default_chunk_rows(batch_groups: int, keys: int) -> int:
    """Rows per chunk so that one chunk's fp32 scores take about CHUNK_BYTES."""
    rows = CHUNK_BYTES // max(1, batch_groups * keys * 4)
    return max(MX_ROWS, rows // MX_ROWS * MX_ROWS)


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


def _accumulate(total, part):
    """K and V gather a contribution from every chunk: summed in fp32."""
    part = part.float()
    return part if total is None else total.add_(part)


# Operands the chunked path cuts into row chunks: (gemm, operand) of the QK^T and PV GEMMs.
# A tensor-scaled operand among them must use the scale of the whole operand.
_QUERY_SIDE = (("fprop", "a"), ("wgrad", "a"))                 # Q (QK^T), P (PV)
_GRAD_SIDE = (("dgrad", "grad_output"), ("wgrad", "grad_output"))   # dS (QK^T), dO (PV)


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


def _piece_observer(observer, first: bool, skip_fprop: bool = False):
    """`observer` for one chunk: the b operands (K^T, V) are whole in every chunk and reported
    with the first only; `skip_fprop` drops the forward GEMM of backward's recomputation."""
    if observer is None:
        return None

    def observe(gemm, operand, *report, **extra):
        if (skip_fprop and gemm == "fprop") or (operand == "b" and not first):
            return
        observer(gemm, operand, *report, **extra)

    return observe


def _amax(pieces) -> torch.Tensor:
    """max |x| of a tensor seen in pieces (0-d float32, on the device)."""
    return torch.stack([p.detach().abs().amax().float() for p in pieces]).amax()


class _ChunkedAttention(torch.autograd.Function):
    """out[:, rows] = softmax_fn(scores_fn(q[:, rows], k_t), rows) @ v chunk by chunk (QK^T
    and PV per their configs). Only q, k_t and v are kept: backward recomputes each chunk's
    probabilities under autograd and runs the PV GEMM's own backward on them, the very
    operations the unfused path's autograd runs.

    Tensor-scaled operands (HiFP8 with --hifp8-scaling tensor, NVFP4, FP8 tensorwise) cut into
    chunks take the scale of the whole operand, as in the unfused path: Q and dO directly; P and dS, which exist only
    chunk by chunk, from a first pass over the chunks that only measures their amax."""

    @staticmethod
    def forward(ctx, q, k_t, v, scores_fn, softmax_fn, qk_cfg, pv_cfg, bounds, observers,
                pv_state):
        ctx.save_for_backward(q, k_t, v)
        ctx.fns, ctx.cfgs, ctx.bounds = (scores_fn, softmax_fn), (qk_cfg, pv_cfg), bounds
        ctx.observers, ctx.pv_state = observers, pv_state
        qk_obs, pv_obs = observers
        qk_scales, pv_scales = {}, {}
        if _needs_whole_scale(qk_cfg, _QUERY_SIDE + _GRAD_SIDE):
            qk_scales = _whole_scales(qk_cfg, _QUERY_SIDE, _amax([q]))

        def probs(r0, r1, observer=None):
            return softmax_fn(scores_fn(q[:, r0:r1], k_t, qk_scales, observer), r0, r1)

        if _needs_whole_scale(pv_cfg, _QUERY_SIDE):
            pv_scales = _whole_scales(pv_cfg, _QUERY_SIDE,
                                      _amax(probs(r0, r1) for r0, r1 in bounds))
        ctx.scales = (qk_scales, pv_scales)
        return torch.cat([
            quantized_matmul(probs(r0, r1, _piece_observer(qk_obs, i == 0)), v, pv_cfg,
                             observer=_piece_observer(pv_obs, i == 0), scales=pv_scales,
                             state=pv_state)
            for i, (r0, r1) in enumerate(bounds)], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        q, k_t, v = ctx.saved_tensors
        (scores_fn, softmax_fn), (qk_cfg, pv_cfg) = ctx.fns, ctx.cfgs
        qk_scales, pv_scales = (dict(s) for s in ctx.scales)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        if _needs_whole_scale(pv_cfg, _GRAD_SIDE):
            pv_scales.update(_whole_scales(pv_cfg, _GRAD_SIDE, _amax([grad_out])))
        if _needs_whole_scale(qk_cfg, _GRAD_SIDE):
            qk_scales.update(_whole_scales(qk_cfg, _GRAD_SIDE, _amax(
                _ChunkedAttention._score_grads(q, k_t, v, grad_out, ctx, qk_scales,
                                               pv_scales))))
        qk_obs, pv_obs = ctx.observers
        grad_q_parts, grad_k, grad_v = [], None, None
        with torch.enable_grad():
            k_leaf = k_t.detach().requires_grad_(need_k)
            for i, (r0, r1) in enumerate(ctx.bounds):
                q_leaf = q[:, r0:r1].detach().requires_grad_(need_q)
                probs = softmax_fn(scores_fn(q_leaf, k_leaf, qk_scales,
                                             _piece_observer(qk_obs, i == 0, skip_fprop=True)),
                                   r0, r1)
                grad_probs, grad_v_part = matmul_grads(
                    probs.detach(), v, grad_out[:, r0:r1], pv_cfg,
                    _piece_observer(pv_obs, i == 0), need_b=need_v, scales=pv_scales,
                    state=ctx.pv_state)
                if need_v:
                    grad_v = _accumulate(grad_v, grad_v_part)
                leaves = [t for t, n in ((q_leaf, need_q), (k_leaf, need_k)) if n]
                if not leaves:
                    continue
                grads = list(torch.autograd.grad(probs, leaves, grad_probs))
                if need_q:
                    grad_q_parts.append(grads.pop(0))
                if need_k:
                    grad_k = _accumulate(grad_k, grads.pop(0))
        grad_q = torch.cat(grad_q_parts, dim=1) if need_q else None
        grad_k = grad_k.to(k_t.dtype) if grad_k is not None else None
        grad_v = grad_v.to(v.dtype) if grad_v is not None else None
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None

    @staticmethod
    def _score_grads(q, k_t, v, grad_out, ctx, qk_scales, pv_scales):
        """dS of every chunk (the gradient reaching the QK^T GEMM), as backward computes it;
        only their amax is used."""
        (scores_fn, softmax_fn), (_, pv_cfg) = ctx.fns, ctx.cfgs
        with torch.enable_grad():
            for r0, r1 in ctx.bounds:
                with torch.no_grad():
                    scores = scores_fn(q[:, r0:r1], k_t, qk_scales, None)
                scores.requires_grad_(True)
                probs = softmax_fn(scores, r0, r1)
                # Measures amaxes only: a throwaway state, so no stochastic draws are counted.
                grad_probs, _ = matmul_grads(probs.detach(), v, grad_out[:, r0:r1], pv_cfg,
                                             need_b=False, scales=pv_scales,
                                             state=SiteState("", pv_cfg))
                yield torch.autograd.grad(probs, scores, grad_probs)[0]


class QuantDotProductAttention(LocalDotProductAttention):
    """Core attention whose QK^T and PV GEMMs are independently quantized sites."""

    qk_site: Optional[GemmSite] = None
    pv_site: Optional[GemmSite] = None
    impl: str = "auto"     # "unfused": always the reference path (full scores)
    # Query rows per chunk of the chunked path (a multiple of 32); None: from CHUNK_BYTES.
    chunk_rows: Optional[int] = None

    @staticmethod
    def _config(site: Optional[GemmSite]) -> MatmulQuantConfig:
        return site.config if site is not None else MatmulQuantConfig()

    @staticmethod
    def _observer(site: Optional[GemmSite]):
        return observer_for(site) if site is not None else None

    @staticmethod
    def _state(site: Optional[GemmSite]) -> Optional[SiteState]:
        return site.state if site is not None else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention bias need TransformerEngine attention")
        qk_cfg, pv_cfg = self._config(self.qk_site), self._config(self.pv_site)
        qk_obs, pv_obs = self._observer(self.qk_site), self._observer(self.pv_site)
        observed = qk_obs is not None or pv_obs is not None
        whole = any(o is not None and not accepts_pieces(o) for o in (qk_obs, pv_obs))
        quantized = qk_cfg.enabled or pv_cfg.enabled
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        linear = self.impl == "auto" and self._plain_softmax()
        if linear and not quantized and not observed:
            return self._fused(query, key, value, attention_mask, mask_type)

        if whole or not linear or not self._row_mask_ok(attention_mask):
            return self._reference(query, key, value, attention_mask, attn_mask_type,
                                   qk_obs, pv_obs)
        q, k_t, v = grouped_layout(query, key, value)
        context = self._chunked(q, k_t, v, attention_mask, mask_type, qk_cfg, pv_cfg, query, key,
                                (qk_obs, pv_obs))
        return heads_layout(context, query)

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
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal,
                                             scale=self.softmax_scale, enable_gqa=ng != np_)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    # -- chunked: quantized, linear memory -------------------------------------------------

    def _chunked(self, q, k_t, v, attention_mask, mask_type, qk_cfg, pv_cfg, query, key,
                 observers=(None, None)):
        sq, sk, ng, rows = query.size(0), key.size(0), key.size(2), q.size(1)
        bounds = chunk_bounds(rows, self.chunk_rows or default_chunk_rows(q.size(0), sk))
        causal = attention_mask is None and mask_type == AttnMaskType.causal

        def chunk_mask(r0: int, r1: int):
            positions = torch.arange(r0, r1, device=q.device) % sq
            if causal:
                # causal_mask(): key j is hidden from query i when j > i + sk - sq.
                keys = torch.arange(sk, device=q.device)
                return (keys[None, :] > positions[:, None] + (sk - sq))[None, None]
            if attention_mask is None:
                return None
            mask = attention_mask[:, :, positions, :]
            # Per-sample masks [b, 1, ...] -> one per (sample, group) row block of q.
            return mask.repeat_interleave(ng, dim=0) if mask.size(0) > 1 else mask

        qk_state, pv_state = self._state(self.qk_site), self._state(self.pv_site)

        def scores_fn(q_c, k_t_, scales, observer):
            return quantized_matmul(q_c, k_t_, qk_cfg, observer=observer, scales=scales,
                                    state=qk_state)

        def softmax_fn(scores, r0, r1):
            scores = scores * self.softmax_scale
            return self._masked_softmax(scores.unsqueeze(1), chunk_mask(r0, r1)).squeeze(1)

        return _ChunkedAttention.apply(q, k_t, v, scores_fn, softmax_fn, qk_cfg, pv_cfg, bounds,
                                       observers, pv_state)

    def _masked_softmax(self, scores, mask):
        """megatron-core's FusedScaleMaskSoftmax (its torch path), for any number of rows."""
        softmax = self.scale_mask_softmax
        in_fp32 = softmax.input_in_float16 and softmax.softmax_in_fp32
        x = scores.float() if in_fp32 else scores
        if mask is not None:
            x = softmax.mask_func(x, mask)
        probs = torch.softmax(x, dim=-1)
        return probs.to(scores.dtype) if in_fp32 else probs

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
