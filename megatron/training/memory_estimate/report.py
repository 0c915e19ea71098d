"""The estimate of the heaviest pipeline stage (MemoryEstimate), its report, and the command
line (main)."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import List, Optional, Sequence

import torch

from megatron.training.errors import ConfigError
from megatron.training.memory_estimate.activations import measure_activations, recompute_bytes
from megatron.training.memory_estimate.kernels import AttentionPaths, single_rank_process_group
from megatron.training.memory_estimate.layout import (
    DEFAULT_GPU_MEMORY_GIB, Layout, padded_vocab_size, parse_estimate_args)
from megatron.training.memory_estimate.parameters import (
    StageParameters, gradient_bytes, optimizer_bytes, parameters_per_stage)

GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per GPU of the heaviest pipeline stage (`stage`, 0-based, of `pipeline_stages`)."""

    stage: int
    pipeline_stages: int
    parameters: int                      # number of parameters held by the rank
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int                 # optimizer state without the distributed optimizer
    optimizer_bytes_distributed: int     # ... sharded by the distributed optimizer
    distributed_optimizer: bool          # which of the two the layout uses
    weight_cache_bytes: int              # quantized weight copies kept until the optimizer step
    activation_bytes_per_layer: int
    activation_bytes_per_micro_batch: int  # the stage's layers plus embedding / output
    micro_batches_in_flight: int
    recompute_bytes: int                 # re-created at once in backward (one recompute unit)
    largest_temporary_bytes: int
    largest_temporary: str               # the op that made it, its shape and dtype
    gpu_memory_bytes: int
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def optimizer_state_bytes(self) -> int:
        return self.optimizer_bytes_distributed if self.distributed_optimizer \
            else self.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        return self.activation_bytes_per_micro_batch * self.micro_batches_in_flight

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes
                + self.weight_cache_bytes + self.activation_bytes + self.recompute_bytes
                + self.largest_temporary_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_bytes



# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


def estimate_memory(args) -> MemoryEstimate:
    """The per-GPU estimate for validated pretrain_gpt.py `args` (from parse_estimate_args, or
    validate_args with args.world_size set; `args.gpu_memory_gib` defaults to 80)."""
    layout = Layout.from_args(args)
    vocab = padded_vocab_size(args)
    gpu_bytes = int(getattr(args, "gpu_memory_gib", DEFAULT_GPU_MEMORY_GIB) * GIB)
    with warnings.catch_warnings():
        # megatron-core's notes on missing TransformerEngine / Apex and the like.
        warnings.simplefilter("ignore")
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), single_rank_process_group():
            params = parameters_per_stage(args, layout, vocab)
            # Middle stages hold fewer micro-batches than the first and neither the embedding
            # nor the output layer.
            candidates = [_estimate_stage(args, layout, stage, params[stage], vocab, gpu_bytes)
                          for stage in sorted({0, layout.pp - 1})]
    return max(candidates, key=lambda e: e.total_bytes)


def _persistent_bytes(args, layout: Layout, params: StageParameters) -> int:
    """What the rank holds for the whole run: parameters, main gradients, optimizer state,
    quantized weight copies."""
    return (params.bytes + gradient_bytes(args, params) + params.weight_cache_bytes
            + optimizer_bytes(args, params, layout, bool(args.use_distributed_optimizer)))


def _estimate_stage(args, layout: Layout, stage: int, params: StageParameters, vocab: int,
                    gpu_bytes: int) -> MemoryEstimate:
    # The chunked attention's chunks take a share of the memory left free (at most: the
    # activations take some of it too), so its temporaries are sized as on this GPU.
    free = max(0, gpu_bytes - _persistent_bytes(args, layout, params))
    per_layer, per_micro_batch, measured = measure_activations(args, layout, stage, vocab,
                                                               gpu_free_bytes=free)
    notes = ["sequence parallelism: what the norms, the MoE router and the residual stream "
             "save counts 1/TP" if layout.sequence_parallel else "no sequence parallelism"]
    if args.num_experts is not None:
        notes.append("MoE routing measured balanced (token t -> experts t*k .. t*k+k-1)")
    notes += attention_notes(measured.attention)
    notes += quantization_notes(args)
    return MemoryEstimate(
        stage=stage, pipeline_stages=layout.pp, parameters=params.count,
        parameter_bytes=params.bytes, gradient_bytes=gradient_bytes(args, params),
        optimizer_bytes=optimizer_bytes(args, params, layout, distributed=False),
        optimizer_bytes_distributed=optimizer_bytes(args, params, layout, distributed=True),
        distributed_optimizer=bool(args.use_distributed_optimizer),
        weight_cache_bytes=params.weight_cache_bytes,
        activation_bytes_per_layer=per_layer, activation_bytes_per_micro_batch=per_micro_batch,
        micro_batches_in_flight=layout.in_flight(stage),
        recompute_bytes=recompute_bytes(args, layout, stage, vocab, per_layer),
        largest_temporary_bytes=measured.temporary_bytes, largest_temporary=measured.temporary,
        gpu_memory_bytes=gpu_bytes, notes=notes)


def attention_notes(paths: AttentionPaths) -> List[str]:
    """Which path the quantized attention was measured on: the fused Triton kernels or the
    chunked path, and why not the kernels. Nothing for attention that makes no such choice
    (unquantized: SDPA's fused kernel; the unfused path of --quant-attention-impl unfused or
    attention dropout)."""
    notes = []
    if paths.fused:
        notes.append("quantized attention: the fused Triton kernels a GPU with triton runs "
                     "(each layer saves q, k, v and two fp32 row statistics; no chunks); a GPU "
                     "without triton runs the chunked path, estimated with --quant-kernels eager")
    for reason in paths.chunked:
        notes.append(f"quantized attention: the chunked path with a GPU's chunks (the fused "
                     f"Triton kernels do not run it: {reason})")
    return notes


def quantization_notes(args) -> List[str]:
    """What the quantization adds beyond the saved operands (the quantized GEMMs save only
    their high-precision operands, whatever the format): the temporaries of stochastic
    rounding, the Hadamard transform and delayed scaling's histories, which the measurement
    (the model's own forward and backward) counts; and --quant-kernels compile."""
    quant = args.quant_config
    configs = [c for c in quant.site_configs() if c.enabled]
    notes = []
    if any(c.stochastic for c in configs):
        notes.append("stochastic rounding: each rounded operand draws a float32 noise tensor of "
                     "its size (a temporary, measured)")
    if any(c.rht.gemms for c in configs):
        notes.append("Hadamard transform: MX and NVFP4 operands whose length the block "
                     "divides are rotated inside their quantization; others are rotated into "
                     "float32 copies, zero-padded to the block (temporaries, measured; not kept "
                     "for backward)")
    if any(c.delayed(fmt) for c in configs for gemm in ("fprop", "dgrad", "wgrad")
           for fmt in (getattr(c, gemm).a, getattr(c, gemm).b)):
        notes.append("FP8 delayed scaling: the amax histories (--fp8-amax-history-len floats "
                     "per operand and site) are negligible")
    if quant.backend.kernels == "compile":
        notes.append("--quant-kernels compile: measured on the eager quantization path; "
                     "compiled kernels fuse its temporaries, so the largest temporary is an "
                     "upper bound")
    return notes


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def gib(nbytes: int) -> str:
    """Bytes in GiB (MiB below 1 GiB), two decimals."""
    if abs(nbytes) < GIB:
        return f"{nbytes / 2 ** 20:.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def describe_layout(args) -> str:
    parts = [f"{args.world_size} GPUs = TP {args.tensor_model_parallel_size} x PP "
             f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}"]
    if args.expert_model_parallel_size > 1:
        parts.append(f"EP {args.expert_model_parallel_size}")
    if args.sequence_parallel:
        parts.append("sequence parallel")
    if args.use_distributed_optimizer:
        parts.append("distributed optimizer")
    if args.recompute_granularity == "full":
        parts.append(f"full recompute ({args.recompute_method}, {args.recompute_num_layers})")
    elif args.recompute_granularity:
        parts.append("selective recompute")
    return ", ".join(parts)


def _recipe_text(args) -> str:
    """The quantization recipe flags beside the scheme name (which they may override)."""
    parts = []
    if getattr(args, "quant_recipe", None):
        parts.append(f"recipe {args.quant_recipe}")
    if getattr(args, "quant_recipe_file", None):
        parts.append(f"recipe file {args.quant_recipe_file}")
    if getattr(args, "fp8_format", None):
        parts.append(f"FP8 {args.fp8_format} {getattr(args, 'fp8_recipe', None) or 'delayed'}")
    return "".join(f", {p}" for p in parts)


def _weight_cache_text(args) -> str:
    if not args.quant_config.backend.weight_cache:
        return "none kept: --no-quant-weight-cache"
    return ("fprop and dgrad QDQ copies of each quantized weight, kept until the optimizer "
            "step; --no-quant-weight-cache drops them")


def format_estimate(est: MemoryEstimate, args) -> str:
    """The report `main` prints."""
    model = args.model_preset or f"{args.num_layers} layers, hidden {args.hidden_size}"
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    state = "Adam exp_avg + exp_avg_sq" if args.optimizer == "adam" else "SGD momentum"
    if args.bf16 or args.fp16:
        state += " + fp32 master weights"
    used = "  <- used"
    stage = (f"pipeline stage {est.stage + 1} of {est.pipeline_stages}, the heaviest"
             if est.pipeline_stages > 1 else "one pipeline stage")
    layers = args.num_layers // args.pipeline_model_parallel_size
    lines = [
        f"Memory per GPU ({stage}), measured on the meta device",
        f"  {model}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, {dtype}, "
        f"quant scheme {args.quant_config.label}{_recipe_text(args)}",
        f"  {describe_layout(args)}",
        f"  parameters            {gib(est.parameter_bytes):>12}  ({est.parameters:,} on this "
        "rank)",
        f"  gradients             {gib(est.gradient_bytes):>12}  "
        f"({'bf16' if args.grad_reduce_in_bf16 else 'fp32'} main-grad buffer)",
        f"  optimizer state ({state})",
        f"    replicated          {gib(est.optimizer_bytes):>12}"
        f"{'' if est.distributed_optimizer else used}",
        f"    distributed         {gib(est.optimizer_bytes_distributed):>12}  (sharded over "
        f"data parallel){used if est.distributed_optimizer else ''}",
        f"  quantized weights     {gib(est.weight_cache_bytes):>12}  ({_weight_cache_text(args)})",
        f"  activations per layer {gib(est.activation_bytes_per_layer):>12}",
        f"  activations           {gib(est.activation_bytes):>12}  ({layers} layers + "
        f"embedding/output: {gib(est.activation_bytes_per_micro_batch)} per micro-batch, "
        f"{est.micro_batches_in_flight} in flight)",
    ]
    if args.recompute_granularity is not None:
        lines.append(f"  recompute (backward)  {gib(est.recompute_bytes):>12}  (one recompute "
                     "unit re-created at once)")
    lines += [
        f"  largest temporary     {gib(est.largest_temporary_bytes):>12}  "
        f"({est.largest_temporary})",
        f"  total                 {gib(est.total_bytes):>12}  of {gib(est.gpu_memory_bytes)}: "
        f"{'fits' if est.fits else 'does NOT fit'}",
    ]
    lines += [f"  note: {note}" for note in est.notes]
    lines.append("  note: not included: CUDA context, communication buffers, allocator caching "
                 "and fragmentation (keep a few GiB free)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """estimate_memory.py [--world-size N] [--gpu-memory-gib G] <pretrain_gpt.py flags>."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_estimate_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(format_estimate(estimate_memory(args), args), flush=True)
    return 0
