"""Per-GPU memory of a training layout, measured on the meta device before anything is launched.

    python tools/estimate_memory.py --world-size 8 --model-preset llama31-8b --seq-length 8192 \\
        --micro-batch-size 1 --bf16 --tensor-model-parallel-size 2 --sequence-parallel \\
        --use-distributed-optimizer --quant-scheme FA_linear_mxfp8

The flags are pretrain_gpt.py's, parsed and validated by megatron.training.arguments, so a bad
layout is rejected as a training run would reject it. Nothing is allocated: the models are built
on PyTorch's meta device, where tensors have shapes and dtypes but no data. For the heaviest
pipeline stage it reports

* parameters -- the real model built with tensor/pipeline/expert parallel sizes 1, each
  parameter divided as megatron-core splits it (`tensor_model_parallel` -> / TP; expert
  parameters, `allreduce=False` -> / (EP x expert TP, which is TP)) and assigned to the stage
  holding it (its layer; embedding: first stage; final norm, output layer: last stage; with tied
  embeddings and PP > 1 the last stage also keeps a copy of the word embedding);
* gradients -- megatron's main-grad buffer: fp32, bf16 with --grad-reduce-in-bf16;
* optimizer state -- Adam's exp_avg and exp_avg_sq (SGD: its momentum) in fp32, plus an fp32
  master copy of bf16/fp16 parameters, with and without the distributed optimizer (which shards
  it over the data-parallel group, expert parameters over the expert-data-parallel group);
* quantized weights -- the fprop and dgrad QDQ copies megatron.quantization.gemm keeps of every
  quantized linear weight (rank's shard, weight dtype; plus the rotated weight of a GEMM with
  the Hadamard transform) from its first use until the optimizer step replaces them, so for
  the whole run: only for weights quantized reusably (round to nearest, not delayed-scaled),
  none under --no-quant-weight-cache;
* activations -- the bytes autograd saves for backward (saved_tensors_hooks, one count per
  storage, parameters excluded) in a forward of a model built at one rank's shapes (heads, query
  groups, FFN and expert widths and the vocabulary divided by TP) with the run's own flags
  (quantization scheme, recompute, attention path). Per layer = saved(a + 1 layers) -
  saved(a layers) (a = 1, or past a dense first layer or a recomputed block); a stage holds its
  layers plus the embedding / output part, times the micro-batches in flight (under 1F1B the
  first of PP stages holds PP);
* recompute -- with --recompute-*, what backward re-creates at once (one recompute unit);
* the largest temporary -- the largest tensor an op creates in forward or backward that is not
  kept for backward (the fp32 logits, an attention chunk, a weight gradient, ...); with
  gradient-accumulation fusion (the default) at least the fp32 weight gradient of the largest
  linear plus the placeholder gradient autograd receives (4 N K + N K x the weight's element
  size), which the measurement sizes from the weights since its model has no main gradients;

and their total against the GPU's memory (--gpu-memory-gib, default 80).

How the measurement stays faithful to a GPU run:

* Sequence parallelism is modelled on the measured tensors: what is saved inside the modules
  that run on the sequence slice (the layer norms, the MoE router, the layers' residual stream)
  and what the column-parallel linears save (they gather their input shard for the GEMM and
  keep only the shard) counts 1/TP; what attention, the row-parallel and the expert linears
  save (full-sequence tensors at one rank's widths) counts in full.
* Kernels. On the meta device (and on a CPU) two ops take a composite path where a GPU runs a
  fused kernel that saves less: scaled_dot_product_attention (the math path keeps the score
  matrix; the GPU's FlashAttention keeps q, k, v, the output and an fp32 log-sum-exp; CUDA adds
  24 bytes of RNG state) and torch.nn.RMSNorm (the composite keeps fp32 copies; the GPU's
  aten._fused_rms_norm keeps the input and rstd). During a measurement both calls go to the
  fused forms: aten's flash-attention operator, and a function that saves what the derivative
  formula of aten._fused_rms_norm saves. An explicit mask (--reset-attention-mask) goes in as
  the additive bias of the activations' dtype that a GPU's SDPA makes of a boolean mask, which
  the kernel keeps (one per layer). Grouped-query attention with an explicit mask or in fp32,
  which FlashAttention does not run, goes to a kernel that needs one K/V head per query head:
  K and V are expanded before the operator, and the expanded copies are what it saves.
* Quantized attention takes the path a GPU takes under the run's --quant-kernels. With the
  default (auto) a GPU with triton installed (pip install -e .[gpu]) runs the fused Triton
  attention kernels wherever they cover the call. The one rule the module itself asks
  (quantization.dispatch.attention_path, with the kernels' unsupported_reason) is asked
  with the meta operands presented as CUDA tensors; where it picks the kernels, their
  autograd function runs as it is -- the whole operands it quantizes, what it saves: q, k_t,
  v of the grouped layout and two fp32 [G, R] row statistics -- and only its two kernel
  launches are replaced by the tensors they allocate (the output; delta [G, R] fp32, dQ,
  dK^T, dV), so no chunk of scores appears. Calls the kernels do not cover (an observed site,
  an explicit mask, P or dS in a format other than MX or rounded stochastically, head dims
  over 128, the Hadamard transform, a QK^T fprop operand that is not reproducible, ...) and
  every call under --quant-kernels eager or compile -- what a GPU without triton runs too --
  take the chunked path, with the chunks a GPU takes: a share of its free memory, taken as
  the GPU's memory less the persistent state (parameters, gradients, optimizer state,
  quantized weights), as attention.chunk_bytes_for sizes it. The decision needs triton where
  the estimate runs (the kernels' coverage check lives in the module that imports it);
  without it every call is measured on the chunked path. The unfused path (attention
  dropout, --quant-attention-impl unfused, ...) runs as it is. The report's notes name the
  path measured and, for the chunked one, why.
* MoE routing needs values, which meta tensors lack (megatron copies the tokens-per-expert counts
  to the CPU and splits by them). Routing is measured with a balanced assignment: top-k indices
  are given the values token t -> experts t*k .. t*k+k-1 (mod E), the routing tensors derived
  from them are computed on the CPU beside their meta twins, and the ops that read values answer
  from those. The dispatch runs megatron's all-gather dispatcher on one rank, which keeps per
  rank what a balanced all-to-all keeps.
* Not included: the CUDA context, communication buffers, allocator caching and fragmentation.
"""

from megatron.training.memory_estimate.activations import measure_activations, measure_saved
from megatron.training.memory_estimate.kernels import single_rank_process_group
from megatron.training.memory_estimate.layout import (
    Layout, padded_vocab_size, parse_estimate_args, single_rank_args)
from megatron.training.memory_estimate.parameters import parameters_per_stage
from megatron.training.memory_estimate.report import (
    GIB, MemoryEstimate, estimate_memory, format_estimate, main)

__all__ = [
    "GIB", "Layout", "MemoryEstimate", "estimate_memory", "format_estimate", "main",
    "measure_activations", "measure_saved", "padded_vocab_size", "parameters_per_stage",
    "parse_estimate_args", "single_rank_args", "single_rank_process_group",
]
