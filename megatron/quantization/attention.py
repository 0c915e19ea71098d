"""Core attention with simulated low-precision QK^T and PV GEMMs.

`QuantDotProductAttention` replaces megatron-core's unfused DotProductAttention. Its two GEMMs
are separate quantization sites, configured independently:

    qk  scores  = Q @ K^T   (reduction over the head dimension)
    pv  context = P @ V     (reduction over the key positions), P = softmax(scale * scores)

Both run through `quantized_matmul`, so forward and backward GEMMs quantize their operands
along their own reduction axes. Grouped-query attention is computed per key/value group
(queries of a group stacked along the row axis) instead of repeating K and V for every head:
the result is identical and K/V keep their natural size.

Fused kernels: when only the QK^T forward GEMM is quantized (no PV quantization, no observers)
and no gradient is needed (evaluation), the result equals scaled_dot_product_attention on the
pre-quantized Q and K (up to the kernel's floating-point order); on CUDA that fused path is used.
Training keeps the unfused path even then: SDPA's backward would reuse the quantized Q and K,
whereas this recipe quantizes every backward operand from the high-precision tensors. PV
quantization needs the probabilities P materialised, so it always takes the unfused path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from megatron.quantization.formats import fake_quantize
from megatron.quantization.gemm import MatmulQuantConfig, quantized_matmul
from megatron.quantization.observers import GemmSite, observer_for
from megatron.quantization.local_attention import LocalDotProductAttention


class QuantDotProductAttention(LocalDotProductAttention):
    """Unfused attention whose QK^T and PV GEMMs are independently quantized sites."""

    qk_site: Optional[GemmSite] = None
    pv_site: Optional[GemmSite] = None
    # Devices on which the fused SDPA kernel is used when it is equivalent (module docstring).
    fused_devices: tuple = ("cuda",)

    @staticmethod
    def _config(site: Optional[GemmSite]) -> MatmulQuantConfig:
        return site.config if site is not None else MatmulQuantConfig()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention bias need TransformerEngine attention")
        attention_mask = self.default_attention_mask(query, key, attention_mask, attn_mask_type)
        sq, b, np_, hn = query.shape
        sk, ng = key.size(0), key.size(2)
        rep = np_ // ng
        hv = value.size(3)
        # [s, b, heads, d] -> [b * groups, rep * s, d]: the queries of one group share its K/V.
        q = query.permute(1, 2, 0, 3).reshape(b * ng, rep * sq, hn)
        k_t = key.permute(1, 2, 3, 0).reshape(b * ng, hn, sk)
        v = value.permute(1, 2, 0, 3).reshape(b * ng, sk, hv)

        qk_cfg, pv_cfg = self._config(self.qk_site), self._config(self.pv_site)
        if self._fused_path_applies(query, qk_cfg, pv_cfg):
            context = self._fused(q, k_t, v, attention_mask, qk_cfg, b, ng, rep, sq, sk)
        else:
            context = self._unfused(q, k_t, v, attention_mask, qk_cfg, pv_cfg, b, ng, rep, sq, sk)
        # [b * groups, rep * sq, hv] -> [sq, b, heads * hv]
        context = context.view(b, np_, sq, hv).permute(2, 0, 1, 3)
        return context.reshape(sq, b, np_ * hv)

    def _unfused(self, q, k_t, v, attention_mask, qk_cfg, pv_cfg, b, ng, rep, sq, sk):
        scores = quantized_matmul(q, k_t, qk_cfg, observer=self._observer(self.qk_site))
        scores = (scores * self.softmax_scale).view(b, ng * rep, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        probs = probs.view(b * ng, rep * sq, sk)
        return quantized_matmul(probs, v, pv_cfg, observer=self._observer(self.pv_site))

    def _fused_path_applies(self, query, qk_cfg, pv_cfg) -> bool:
        return (query.device.type in self.fused_devices and not torch.is_grad_enabled()
                and (not self.training or self.config.attention_dropout == 0.0)
                and not pv_cfg.enabled and self.softmax_offset is None
                and self._observer(self.qk_site) is None)

    def _fused(self, q, k_t, v, attention_mask, qk_cfg, b, ng, rep, sq, sk):
        # Quantized along the QK^T reduction axis (head dim), as the unfused forward GEMM does.
        def quantize(x, fmt, axis):
            if fmt == "none":
                return x
            return fake_quantize(x, fmt, axis=axis, scale_mode=qk_cfg.scale_mode,
                                 saturate=qk_cfg.saturate_for(fmt))

        q, k_t = quantize(q, qk_cfg.fprop.a, -1), quantize(k_t, qk_cfg.fprop.b, -2)
        q4 = q.view(b, ng, rep * sq, -1)
        k4 = k_t.transpose(1, 2).reshape(b, ng, sk, -1)
        v4 = v.view(b, ng, sk, -1)
        mask = None
        if attention_mask is not None:
            # megatron masks are True where attention is NOT allowed; SDPA wants the opposite.
            allowed = ~attention_mask.expand(b, ng * rep, sq, sk)
            mask = allowed.reshape(b, ng, rep * sq, sk)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=self.softmax_scale)
        return out.reshape(b * ng, rep * sq, -1)

    @staticmethod
    def _observer(site: Optional[GemmSite]):
        return observer_for(site) if site is not None else None
