"""What precision each part of a training step runs in, stated at start-up.

A scheme comparison is only meaningful when everything but the simulated GEMMs is the same,
and a "bf16" baseline must really be a bf16 run: this block makes the numerics of the whole
step visible in every log. The statements follow megatron-core 0.16.1 as this project builds
the model (local layer spec, Float16Module, mixed-precision optimizer).
"""

from __future__ import annotations


def describe_precision(args) -> str:
    """A few lines: parameters and activations, non-GEMM ops, GEMMs, gradients, optimizer."""
    dtype = args.params_dtype_name
    half = dtype in ("bf16", "fp16")
    grad_reduce = "bf16" if getattr(args, "grad_reduce_in_bf16", False) else "fp32"
    lines = [f"precision: {dtype} run" + (" (--bf16)" if dtype == "bf16" else
                                          " (--fp16)" if dtype == "fp16" else
                                          " (neither --bf16 nor --fp16 given)")]
    lines.append(f"  parameters, activations, residual stream: {dtype}")
    lines.append(f"  RMSNorm/LayerNorm, rotary embedding, SwiGLU: {dtype} inputs and outputs")
    lines.append("  attention softmax: fp32 (attention_softmax_in_fp32); loss: cross-entropy "
                 "on fp32 logits")
    lines.append(f"  GEMMs: {dtype} operands and outputs"
                 + (" (fp32 accumulation in the kernels)" if half else "")
                 + "; simulated formats quantize-dequantize the operands from these "
                 f"{dtype} tensors")
    if half:
        fused = getattr(args, "gradient_accumulation_fusion", True)
        wgrad = ("linear weight gradients summed into them from the GEMMs' fp32 results "
                 "(gradient-accumulation fusion)" if fused else
                 f"linear weight gradients rounded to {dtype} per micro-batch first "
                 "(--no-gradient-accumulation-fusion)")
        lines.append(f"  gradients: accumulated and reduced in {grad_reduce} (main grads), "
                     f"{wgrad}; master weights and Adam state: fp32")
    else:
        lines.append("  gradients, weights and Adam state: fp32")
    return "\n".join(lines)
