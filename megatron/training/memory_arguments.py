"""Megatron-LM's memory flags: activation recompute, flash attention, communication overlap.

Recompute is megatron-core's own (TransformerConfig.recompute_*): the quantized layers are
deterministic, so a recomputed forward quantizes exactly as the first one did. Attention picks
its memory-linear path by itself (megatron.quantization.attention), so --use-flash-attn only
says so. Context parallelism is not supported.
"""

from __future__ import annotations

import argparse

from megatron.training.errors import ConfigError


def add_memory_args(parser):
    group = parser.add_argument_group(title="memory")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Recompute core attention in backward instead of keeping its "
                            "activations (same as --recompute-granularity selective).")
    group.add_argument("--recompute-granularity", type=str, default=None,
                       choices=["full", "selective"],
                       help="full: recompute whole transformer layers in backward (with "
                            "--recompute-method and --recompute-num-layers); selective: "
                            "recompute core attention only.")
    group.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                       help="With --recompute-granularity full: uniform recomputes every "
                            "layer in groups of --recompute-num-layers; block recomputes the "
                            "first --recompute-num-layers layers of each pipeline stage.")
    group.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                       help="Layers per recompute group (uniform) or recomputed layers per "
                            "pipeline stage (block). Default 1 with --recompute-granularity full.")
    group.add_argument("--use-flash-attn", action="store_true",
                       help="Accepted for Megatron-LM compatibility: attention already uses the "
                            "fused (flash / memory-efficient) kernel whenever nothing in "
                            "attention is quantized, and linear-memory chunks when it is.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with backward.")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="Overlap the distributed optimizer's parameter all-gather with the "
                            "next forward (needs --use-distributed-optimizer and "
                            "--overlap-grad-reduce).")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Context parallelism; not supported (only 1 is accepted).")
    return parser


def validate_memory_args(args: argparse.Namespace) -> None:
    if args.context_parallel_size != 1:
        raise ConfigError(f"--context-parallel-size {args.context_parallel_size}: context "
                          "parallelism is not supported; valid: 1")
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective; "
                              "it cannot be combined with --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method "
                              "(valid: uniform, block)")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
        if args.recompute_num_layers < 1:
            raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} is invalid; "
                              "valid: a positive number of layers")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        if args.recompute_method == "uniform" and per_stage % args.recompute_num_layers:
            # megatron-core would index past the last layer of the stage.
            raise ConfigError(f"--recompute-method uniform needs --recompute-num-layers "
                              f"{args.recompute_num_layers} to divide the {per_stage} layers of "
                              "each pipeline stage")
        if args.recompute_num_layers > per_stage:
            raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} exceeds the "
                              f"{per_stage} layers of each pipeline stage")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        raise ConfigError("--recompute-method and --recompute-num-layers go with "
                          "--recompute-granularity full")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          "--overlap-grad-reduce")
    if args.recompute_granularity is not None and args.save_tensors:
        # A recomputed forward would report its GEMM operands a second time.
        raise ConfigError(f"--save-tensors cannot be combined with --recompute-granularity "
                          f"{args.recompute_granularity} (recomputed forwards would be captured "
                          "twice); capture without recompute")
