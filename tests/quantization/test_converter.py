"""apply_quantization: what it swaps, what it refuses."""

import pytest
import torch

from megatron.quantization.converter import QuantizationError, apply_quantization
from megatron.quantization.schemes import quant_config


def _te_module():
    """A module that claims to come from TransformerEngine (its GEMMs would run in TE)."""
    cls = type("TELinear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch"})
    return cls(4, 4)


def test_transformer_engine_modules_are_refused_when_quantizing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _te_module())
    with pytest.raises(QuantizationError, match=r"^1 is a TransformerEngine module \(TELinear\)"):
        apply_quantization(model, quant_config(["--quant-scheme", "linear_mxfp8"], 2))
    # Nothing to quantize: nothing would be silently left out.
    assert apply_quantization(model, quant_config(["--quant-scheme", "bf16"], 2)) == []
