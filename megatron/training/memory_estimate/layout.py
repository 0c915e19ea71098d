"""Flags and layout of the memory estimate: pretrain_gpt.py's flags plus --world-size /
--gpu-memory-gib, the parallel layout, and the arguments of a single-rank model at one rank's
shapes."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import List, Sequence

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ConfigError

DEFAULT_VOCAB_SIZE = 128256          # the Llama 3 tokenizer the launchers use
DEFAULT_GPU_MEMORY_GIB = 80.0

# Flags validation requires but memory does not depend on (explicit flags win).
_NEUTRAL_DEFAULTS = ["--train-iters", "1", "--lr", "1e-4"]


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def _add_estimate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="memory estimate")
    group.add_argument("--world-size", type=int, default=1, dest="estimate_world_size",
                       help="Number of GPUs of the layout (TP x PP x DP). Default: 1.")
    group.add_argument("--gpu-memory-gib", type=float, default=DEFAULT_GPU_MEMORY_GIB,
                       help="Memory of one GPU in GiB. Default: 80 (an 80 GB H100 or A100).")
    return parser


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse errors (unknown preset, bad value) as a ConfigError: one line, no usage dump."""

    def error(message):
        raise ConfigError(message)

    parser.error = error
    return parser


def _with_neutral_defaults(argv: Sequence[str]) -> List[str]:
    argv = list(argv)
    extra = list(_NEUTRAL_DEFAULTS)
    if not any(a in ("--mock-data", "--data-path") or a.startswith("--data-path=")
               for a in argv):
        extra.append("--mock-data")
    return extra + argv


def parse_estimate_args(argv: Sequence[str]) -> argparse.Namespace:
    """pretrain_gpt.py flags plus --world-size / --gpu-memory-gib, validated (ConfigError)."""
    args = parse_args(_with_neutral_defaults(argv),
                      extra_args_provider=lambda p: _one_line_errors(_add_estimate_args(p)))
    if args.estimate_world_size < 1:
        raise ConfigError(f"--world-size {args.estimate_world_size} must be >= 1")
    if args.gpu_memory_gib <= 0:
        raise ConfigError(f"--gpu-memory-gib {args.gpu_memory_gib} must be positive")
    args.rank, args.world_size = 0, args.estimate_world_size
    return validate_args(args, check_paths=False)


def padded_vocab_size(args) -> int:
    """--vocab-size (NullTokenizer: plus its end-of-document token, id --vocab-size), else the
    Llama 3 tokenizer's, padded as megatron pads it."""
    from megatron.training.tokenizer import vocab_size_with_padding

    vocab = args.vocab_size if args.vocab_size is not None else DEFAULT_VOCAB_SIZE
    if args.vocab_size is not None and getattr(args, "tokenizer_type", None) == "NullTokenizer":
        vocab += 1
    return vocab_size_with_padding(vocab, args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)


# ---------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int           # data-parallel size of expert parameters
    sequence_parallel: bool
    layers_per_stage: int
    micro_batches: int       # per iteration and data-parallel rank

    @classmethod
    def from_args(cls, args) -> "Layout":
        tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.expert_model_parallel_size)
        # Expert tensor parallelism is TP (megatron-core's default).
        return cls(tp=tp, pp=pp, ep=ep, dp=args.data_parallel_size,
                   expert_dp=max(1, args.world_size // (tp * pp * ep)),
                   sequence_parallel=bool(args.sequence_parallel),
                   layers_per_stage=args.num_layers // pp,
                   micro_batches=args.num_micro_batches)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations a stage holds at once under 1F1B."""
        return min(self.pp - stage, self.micro_batches)


def moe_layers(args) -> List[bool]:
    """For each layer, whether it is a MoE layer (megatron's --moe-layer-freq)."""
    if args.num_experts is None:
        return [False] * args.num_layers
    if isinstance(args.moe_layer_freq, int):
        return [i % args.moe_layer_freq == 0 for i in range(args.num_layers)]
    return [bool(v) for v in args.moe_layer_freq]


def single_rank_args(args, **changes) -> argparse.Namespace:
    """A copy of `args` for one process (TP=PP=EP=1, world size 1), plus `changes`."""
    one = copy.copy(args)
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = 1
    one.expert_model_parallel_size = 1
    one.world_size, one.data_parallel_size, one.rank = 1, 1, 0
    one.sequence_parallel = False
    one.distributed_backend = "gloo"
    # The all-to-all dispatcher needs CUDA streams; on one rank both keep the same tensors.
    one.moe_token_dispatcher_type = "allgather"
    for name, value in changes.items():
        setattr(one, name, value)
    return one


def per_rank_shapes(args, layout: Layout, padded_vocab: int) -> dict:
    """The widths one rank computes with (what TP, and expert TP = TP, divides)."""
    tp = layout.tp
    changes = dict(num_attention_heads=args.num_attention_heads // tp,
                   num_query_groups=args.num_query_groups // tp,
                   ffn_hidden_size=args.ffn_hidden_size // tp,
                   padded_vocab_size=padded_vocab // tp)
    if args.num_experts is not None:
        changes["moe_ffn_hidden_size"] = args.moe_ffn_hidden_size // tp
        if args.moe_shared_expert_intermediate_size is not None:
            changes["moe_shared_expert_intermediate_size"] = \
                args.moe_shared_expert_intermediate_size // tp
    return changes
