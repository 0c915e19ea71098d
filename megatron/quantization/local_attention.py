"""megatron-core's unfused DotProductAttention made usable everywhere (the base of the quantized one).

`LocalDotProductAttention` accepts MLA's `k_channels` / `v_channels` (megatron-core's local
class rejects them when TransformerEngine is absent) and builds the causal mask on the input's
device when none is given (megatron-core's default mask is created on "cuda"). The model
builder puts it into the layer spec; `apply_quantization` (converter.py) turns it into
`QuantDotProductAttention`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """[1, 1, sq, sk] boolean mask, True where attention is NOT allowed (megatron convention)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1 + sk - sq)[None, None]


class LocalDotProductAttention(DotProductAttention):
    """DotProductAttention that accepts MLA head sizes and needs no CUDA for its default mask."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels = k_channels

    def default_attention_mask(self, query, key, attention_mask, attn_mask_type):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is None and mask_type == AttnMaskType.causal:
            return causal_mask(query.size(0), key.size(0), query.device)
        return attention_mask

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        attention_mask = self.default_attention_mask(query, key, attention_mask, attn_mask_type)
        return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)
