"""The local norm that the GPT layer spec is rewired to use.

`Norm`: torch LayerNorm / RMSNorm that also works with sequence parallelism (megatron-core's
WrappedTorchNorm asserts `not config.sequence_parallel`). The local attention class lives with
its quantized subclass in megatron.quantization.local_attention.
"""

from __future__ import annotations

import torch


class Norm:
    """Factory with megatron's norm signature returning torch.nn.LayerNorm or RMSNorm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centered gamma (--apply-layernorm-1p) is not supported")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}; "
                             "valid: LayerNorm, RMSNorm")
        # Megatron all-reduces the grads of parameters marked sequence_parallel across TP ranks:
        # with SP each rank normalises its own slice of the sequence.
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
