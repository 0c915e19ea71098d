"""Weight gradients accumulated into the fp32 main gradient (gradient-accumulation fusion).

megatron-core's DistributedDataParallel gives every parameter a `main_grad` (fp32 unless
--grad-reduce-in-bf16) and, without fusion, adds `param.grad` to it after each micro-batch's
backward: in a bf16 run the wgrad GEMM's fp32 result is first rounded to bf16, once per
micro-batch. Megatron-LM on GPUs fuses the accumulation (Apex's wgrad_gemm_accum_fp32 or
TransformerEngine): the GEMM's fp32 result is added to main_grad directly, and autograd gets a
placeholder gradient that the DDP hook skips (`grad_added_to_main_grad`). This module does
the same without Apex or TransformerEngine:

    main_grad += fp32(dY^T @ X)

with dY and X as the wgrad GEMM has them (quantized where the scheme quantizes them). Their
products are exact in fp32 (bf16 and fp16 operands have at most 11 significant bits) and are
summed in fp32; on CUDA by a bf16 GEMM with an fp32 output, elsewhere by an fp32 GEMM of the
operands converted exactly. In an fp32 run this is bit for bit the unfused result.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)


def accumulates_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether `weight` belongs to a megatron-core DistributedDataParallel model (it has a
    main_grad and the flag its backward hook reads)."""
    return hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-D) summed in fp32 and returned in fp32, whatever the operands' dtype."""
    if a.is_cuda and a.dtype in _HALF and b.dtype == a.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def add_to_main_grad(weight: torch.Tensor, wgrad_fp32: torch.Tensor) -> torch.Tensor:
    """weight.main_grad += wgrad_fp32 (the wgrad GEMM's fp32 result, fp32_product); returns
    the placeholder gradient autograd must still receive, so that DDP's hook runs (with
    --overlap-grad-reduce it marks the bucket ready) but adds nothing.

    A weight shared with the embedding (`zero_out_wgrad`, set by megatron-core for tied
    embeddings) gets a zero placeholder: the embedding's own gradient is summed into it by
    autograd and the hook adds that sum."""
    main_grad = weight.main_grad
    main_grad.add_(wgrad_fp32)
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(main_grad.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(main_grad.shape, dtype=weight.dtype, device=weight.device)
