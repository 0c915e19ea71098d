"""Command-line arguments in Megatron-LM's shape.

Flags, dests and defaults follow Megatron-LM (core_v0.16.1) for everything this stack supports.
Each group is one function `_add_<group>_args(parser) -> parser`; a new group (quantization,
tensor capture, ...) is added by writing one such function and listing it in `ARGUMENT_GROUPS`.

`parse_args` applies a `--model-preset` underneath the command line: preset values replace the
built-in defaults, and any flag given explicitly still wins. With --load, the model arguments
the checkpoint recorded go beneath both (model_args.py), so a checkpoint loads without model
flags. `validate_args` derives the remaining values (data-parallel size, padded sizes,
defaults that depend on other flags) and rejects impossible combinations with a message that
names the flags involved.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
from typing import Callable, Iterable, List, Optional, Tuple

from megatron.training.capture_arguments import add_tensor_args, validate_tensor_args
from megatron.training.checkpoint_files import file_problem, loadable_checkpoint_files
from megatron.training.errors import ConfigError
from megatron.training.memory_arguments import add_memory_args, validate_memory_args
from megatron.training.model_args import (
    MODEL_SHAPE_ARGS, differing_model_args, recorded_model_args, take_model_args)
from megatron.training.presets import MODEL_PRESETS, preset_defaults
from megatron.training.quant_arguments import add_quantization_args, validate_quantization_args
from megatron.training.tokenizer import add_tokenizer_args

__all__ = ["ConfigError", "build_parser", "parse_args", "validate_args", "format_args"]

# Bounds of the settings that size memory (far above any real use; a value beyond them is a
# typo, and would otherwise end in an allocation failure or a hang deep inside a step).
MAX_SEQ_LENGTH = 1 << 20                  # tokens per sequence (Llama 3.1: 131,072)
MAX_MICRO_BATCH_TOKENS = 1 << 24          # --micro-batch-size x --seq-length
MAX_GLOBAL_BATCH_SIZE = 1 << 20           # sequences per step (Llama 3: 2,048 of 8,192)
MAX_NUM_WORKERS = 256                     # data-loader processes per rank
# The model's sizes (Llama 3.1 405B: 126 layers, hidden 16,384, FFN 53,248, 128 heads; the
# largest vocabularies about 256 k); a model within them that still does not fit the machine
# stops with one out-of-memory line while it is built.
MODEL_SIZE_LIMITS = {
    "num_layers": 1 << 10, "hidden_size": 1 << 17, "ffn_hidden_size": 1 << 20,
    "num_attention_heads": 1 << 12, "num_query_groups": 1 << 12, "kv_channels": 1 << 14,
    "num_experts": 1 << 12, "moe_ffn_hidden_size": 1 << 20, "moe_router_topk": 1 << 12,
    "moe_shared_expert_intermediate_size": 1 << 20, "q_lora_rank": 1 << 17,
    "kv_lora_rank": 1 << 17, "qk_head_dim": 1 << 14, "qk_pos_emb_head_dim": 1 << 14,
    "v_head_dim": 1 << 14, "vocab_size": 1 << 24, "make_vocab_size_divisible_by": 1 << 16,
}
MAX_TIMEOUT_MINUTES = 7 * 24 * 60         # a week (a timedelta of more overflows in gloo)
# The largest finite float32: optimizer scalars derived from a learning rate must fit it.
FLOAT32_MAX = 3.4028234663852886e38
# numpy seeds are < 2**32, and pipeline stage p seeds its generators with --seed + 100 p
# (initialize.PIPELINE_SEED_STRIDE; not imported here: flag errors come before megatron-core).
SEED_LIMIT = 1 << 32
PIPELINE_SEED_STRIDE = 100


# ---------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------


def _add_network_size_args(parser):
    group = parser.add_argument_group(title="network size")
    group.add_argument("--model-preset", type=str, default=None, choices=sorted(MODEL_PRESETS),
                       help="Architecture preset (see README). Its values replace the defaults "
                            "below; flags given explicitly on the command line still win.")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Transformer feed-forward network hidden size. Default: 4 x hidden "
                            "size, or the SwiGLU equivalent (8/3 x hidden, rounded down to a "
                            "multiple of 64) with --swiglu.")
    group.add_argument("--num-attention-heads", type=int, default=None,
                       help="Number of transformer attention heads.")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Projection size per attention head. Default: hidden size / heads.")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Use grouped-query attention (see --num-query-groups).")
    group.add_argument("--num-query-groups", type=int, default=1,
                       help="Number of key/value head groups with --group-query-attention.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Maximum sequence length the position embedding supports. "
                            "Default: --seq-length.")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       choices=["learned_absolute", "rope", "none"],
                       help="Position embedding type.")
    group.add_argument("--rotary-base", type=int, default=10000,
                       help="Base of the rotary position embedding frequencies (rope theta).")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's dimensions that get rotary embedding.")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Apply Llama 3.x rope scaling (low/high frequency factors 1 and 4, "
                            "original context 8192).")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0,
                       help="Llama 3.x rope scaling factor (8 for Llama 3.1, 32 for Llama 3.2). "
                            "Unlike Megatron-LM 0.16, this value is passed to the model.")
    group.add_argument("--normalization", type=str, default="LayerNorm",
                       choices=["LayerNorm", "RMSNorm"], help="Normalization layer type.")
    group.add_argument("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon",
                       help="Epsilon of the normalization layers.")
    group.add_argument("--swiglu", action="store_true",
                       help="Use gated linear units and SiLU activation instead of GeLU.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Untie the input embedding and the output layer weights.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="Disable bias in the linear layers.")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Apply a normalization layer to queries and keys (MLA: to the "
                            "latent q and kv).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary size to a multiple of this value (times the "
                            "tensor-parallel size).")
    return parser


def _add_mla_args(parser):
    group = parser.add_argument_group(title="multi-latent attention")
    group.add_argument("--multi-latent-attention", action="store_true",
                       help="Use multi-latent attention (DeepSeek-V2).")
    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="Rank of the query low-rank projection; None = full query projection.")
    group.add_argument("--kv-lora-rank", type=int, default=32,
                       help="Rank of the key/value low-rank (latent) projection.")
    group.add_argument("--qk-head-dim", type=int, default=128,
                       help="Dimension of the non-rotary part of each query/key head.")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                       help="Dimension of the rotary part of each query/key head.")
    group.add_argument("--v-head-dim", type=int, default=128, help="Dimension of each value head.")
    group.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                       help="YaRN rotary scaling factor (MLA).")
    group.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (MLA).")
    group.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN mscale_all_dim (MLA).")
    return parser


def _parse_moe_layer_freq(value: str):
    """An int N (every N-th layer is MoE) or a Python list expression such as '([0]+[1]*26)'."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        parsed = _eval_list_expression(value)
    except (ValueError, SyntaxError) as exc:
        raise argparse.ArgumentTypeError(
            f"invalid --moe-layer-freq {value!r}: give an int or a list such as '([0]+[1]*26)'"
        ) from exc
    if not isinstance(parsed, list) or not all(v in (0, 1) for v in parsed):
        raise argparse.ArgumentTypeError(
            f"invalid --moe-layer-freq {value!r}: the list must hold only 0 and 1")
    return parsed


def _eval_list_expression(text: str):
    """Evaluate list literals joined by + and * with ints, without eval()."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.List):
            return [walk(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"unsupported expression element {ast.dump(node)}")

    return walk(ast.parse(text.strip(), mode="eval"))


def _add_moe_args(parser):
    group = parser.add_argument_group(title="mixture of experts")
    group.add_argument("--num-experts", type=int, default=None,
                       help="Number of routed experts (enables MoE).")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="Degree of expert model parallelism.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="Hidden size of each routed expert. Default: --ffn-hidden-size.")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="Total hidden size of the shared experts; None = no shared expert.")
    group.add_argument("--moe-router-topk", type=int, default=2,
                       help="Number of experts each token is routed to.")
    group.add_argument("--moe-layer-freq", type=_parse_moe_layer_freq, default=1,
                       help="MoE layer pattern: an int N (every N-th layer) or a list of 0/1 "
                            "per layer, e.g. '([0]+[1]*26)'.")
    group.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                       help="Router load-balancing loss.")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                       help="Scaling coefficient of the load-balancing loss.")
    group.add_argument("--moe-router-score-function", type=str, default="softmax",
                       choices=["softmax", "sigmoid"], help="Router score function.")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts before top-k (DeepSeek-V2).")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Scaling factor of the routing scores.")
    group.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"],
                       help="Data type of the router computation.")
    group.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                       choices=["allgather", "alltoall"],
                       help="Token dispatcher. 'alltoall' needs CUDA streams (GPU only).")
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1,
                       help="Post attention dropout probability.")
    group.add_argument("--hidden-dropout", type=float, default=0.1,
                       help="Dropout probability for hidden state transformer.")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Weight decay coefficient for L2 regularization.")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Gradient clipping based on global L2 norm (0 disables).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-08, help="Adam epsilon.")
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Batch size per model instance (local batch size).")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Training batch size; a multiple of micro batch x data-parallel size "
                            "(the rest is gradient accumulation). Default: micro batch x DP.")
    group.add_argument("--train-iters", type=int, default=None,
                       help="Total number of iterations to train over all training runs.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Exit (after saving if --save) when the iteration is divisible "
                            "by this value.")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="Exit (after saving if --save) after this many minutes of training.")
    group.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"],
                       help="Optimizer function.")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                       dest="gradient_accumulation_fusion",
                       help="Add each micro-batch's weight gradient to the fp32 main gradient "
                            "after rounding it to the parameter dtype (bf16 under --bf16), "
                            "instead of summing the wgrad GEMM's fp32 result into it directly "
                            "(the default, as Megatron-LM's gradient-accumulation fusion; "
                            "needs neither Apex nor TransformerEngine here).")
    return parser


def _add_initialization_args(parser):
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234,
                       help="Random seed used for python, numpy, torch and the data sampler.")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the zero-mean normal weight initialization.")
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                       help="Learning rate decay function.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Number of iterations to decay the learning rate over. "
                            "Default: --train-iters.")
    group.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                       choices=["exponential", "linear", "cosine", "minus_sqrt"],
                       help="Decay style of the WSD schedule's final phase.")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                       help="Number of iterations of the WSD schedule's final decay phase.")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Number of iterations to linearly warm up the learning rate over.")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Fraction of the decay iterations used for warm-up (instead of "
                            "--lr-warmup-iters).")
    group.add_argument("--lr-warmup-init", type=float, default=0.0,
                       help="Initial learning rate of the warm-up.")
    group.add_argument("--min-lr", type=float, default=0.0,
                       help="Minimum value of the learning rate.")
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Output directory to save checkpoints to.")
    group.add_argument("--save-interval", type=int, default=None,
                       help="Number of iterations between checkpoint saves.")
    group.add_argument("--load", type=str, default=None,
                       help="Directory containing a model checkpoint to resume from.")
    group.add_argument("--no-load-optim", action="store_true",
                       help="Do not load optimizer state when loading a checkpoint.")
    group.add_argument("--no-load-rng", action="store_true",
                       help="Do not load the random number generator states.")
    group.add_argument("--override-checkpoint-settings", action="store_true",
                       help="Resume (--load) a checkpoint saved with other quantization "
                            "settings (scheme, recipe, recipe file contents, FP8/MX/GEMM "
                            "settings), another precision or another --seed than this run's: "
                            "continue with this run's settings and name the differing ones in "
                            "one warning line. Without it such a --load stops before training "
                            "with one error line naming them (checkpoint value vs this run). "
                            "Also applies this run's learning-rate schedule, weight decay and "
                            "Adam settings instead of the checkpoint's (which a resume keeps "
                            "otherwise, saying so).")
    group.add_argument("--load-fallback-to-previous", action="store_true",
                       help="When the checkpoint --load would read (the tracker's iteration) "
                            "is incomplete or damaged, load the newest intact earlier "
                            "iter_* checkpoint instead, saying so in one line. Without it such "
                            "a checkpoint stops the run with one error line.")
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Run the model in fp16 mode.")
    group.add_argument("--bf16", action="store_true", help="Run the model in bfloat16 mode.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static loss scale for fp16; None = dynamic loss scaling.")
    group.add_argument("--initial-loss-scale", type=float, default=2 ** 32,
                       help="Initial loss scale of dynamic loss scaling (fp16).")
    group.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="Reduce gradients in bfloat16 instead of fp32 (with --bf16).")
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Degree of pipeline model parallelism.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Enable sequence parallelism (needs tensor parallelism).")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--distributed-backend", type=str, default=None, choices=["nccl", "gloo"],
                       help="torch.distributed backend. Default: nccl with CUDA, gloo without.")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout for collective communication, in minutes.")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100,
                       help="Number of iterations to run for evaluation (validation and test).")
    group.add_argument("--eval-interval", type=int, default=1000,
                       help="Interval between running evaluation on the validation set.")
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Path prefixes of .bin/.idx datasets, optionally weighted for a "
                            "blend: 'PATH' or 'W1 PATH1 W2 PATH2 ...'.")
    group.add_argument("--split", type=str, default=None,
                       help="Comma-separated train/valid/test proportions, e.g. '969,30,1' "
                            "(the default with --data-path).")
    group.add_argument("--mock-data", action="store_true",
                       help="Train on synthetic data (megatron.core's MockGPTDataset).")
    group.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length to process.")
    group.add_argument("--data-cache-path", type=str, default=None,
                       help="Directory for the dataset index cache. Default: beside the data.")
    group.add_argument("--num-workers", type=int, default=2, help="Dataloader worker processes.")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Reset position ids after end-of-document tokens.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Reset the attention mask after end-of-document tokens.")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="Mask the loss on end-of-document tokens.")
    return parser


def _add_tokenizer_args(parser):
    return add_tokenizer_args(parser)


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=100,
                       help="Report loss and timing every this many iterations.")
    group.add_argument("--tensorboard-dir", type=str, default=None,
                       help="Write TensorBoard scalars to this directory.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1,
                       help="Report to TensorBoard every this many iterations.")
    group.add_argument("--wandb-project", type=str, default=None,
                       help="Also log the scalars to this Weights & Biases project (needs the "
                            "wandb package; without it a warning is printed and training goes "
                            "on).")
    group.add_argument("--wandb-exp-name", type=str, default=None,
                       help="The W&B run name (default: W&B's own).")
    group.add_argument("--wandb-save-dir", type=str, default=None,
                       help="Where W&B keeps its local files (default: W&B's own).")
    return parser


ARGUMENT_GROUPS: List[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = [
    _add_network_size_args,
    _add_regularization_args,
    _add_training_args,
    _add_initialization_args,
    _add_learning_rate_args,
    _add_checkpointing_args,
    _add_mixed_precision_args,
    _add_distributed_args,
    _add_validation_args,
    _add_data_args,
    _add_tokenizer_args,
    _add_moe_args,
    _add_mla_args,
    _add_logging_args,
    add_memory_args,
    add_quantization_args,
    add_tensor_args,
]


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: the stock parser prints its whole usage first,
    over a hundred lines for this many flags, burying the message."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each flag's default, unless it has none (None, off) or the help text
    already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text.lower()
                or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron-LM Arguments", allow_abbrev=False,
                     formatter_class=_DefaultsFormatter)
    for add_group in ARGUMENT_GROUPS:
        parser = add_group(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(argv: Optional[Iterable[str]] = None, extra_args_provider=None,
               ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) with any --model-preset applied beneath the flags,
    and with --load, the checkpoint's model arguments beneath both (model_args.py)."""
    argv = None if argv is None else list(argv)
    parser = build_parser(extra_args_provider)
    known, _ = parser.parse_known_args(argv)
    preset = preset_defaults(known.model_preset) if known.model_preset is not None else {}
    parser.set_defaults(**preset)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    if args.load and loadable_checkpoint_files(args.load):
        # (A tracker or common.pt that is a FIFO or a device is not read here: the --load
        # checks name it in one line once the flags are validated.)
        recorded = recorded_model_args(args.load)
        if recorded is not None:
            _take_checkpoint_model_args(parser, args, recorded,
                                        _given_dests(extra_args_provider, argv) | set(preset))
    return args


_UNSET = object()


def _given_dests(extra_args_provider, argv) -> set:
    """The dests set by the command line itself (not by defaults or a preset): argparse only
    fills in defaults for the dests a namespace does not hold yet."""
    probe = build_parser(extra_args_provider)
    unset = argparse.Namespace(**{dest: _UNSET for dest in vars(probe.parse_known_args([])[0])})
    parsed, _ = probe.parse_known_args(argv, namespace=unset)
    return {dest for dest, value in vars(parsed).items() if value is not _UNSET}


def _flag_text(parser, dest: str, value) -> str:
    """`dest = value` as the command line says it: '--hidden-size 64', '--swiglu',
    '--disable-bias-linear'."""
    action = next(a for a in parser._actions if a.dest == dest and a.option_strings)
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return flag if value != action.default else f"no {flag}"
    if isinstance(value, list):
        value = "[" + ",".join(map(str, value)) + "]"
    return f"{flag} {value}"


def _take_checkpoint_model_args(parser, args, recorded, keep: set) -> None:
    """Model flags given neither on the command line nor by --model-preset take the values
    the checkpoint recorded; one note lists those that differ from the defaults, one warning
    the given ones that differ from the checkpoint without changing its shapes (shape
    differences stop the load: checkpointing.check_model_shape)."""
    taken = take_model_args(args, recorded, keep)
    contradicted = [name for name in differing_model_args(args, recorded, keep)
                    if name not in MODEL_SHAPE_ARGS]
    if args.rank != 0:
        return
    defaults = vars(build_parser().parse_known_args([])[0])
    shown = [name for name in taken if getattr(args, name) != defaults.get(name)]
    if shown:
        print(f"note: --load {args.load}: model flags from its checkpoint: "
              + " ".join(_flag_text(parser, n, getattr(args, n)) for n in shown)
              + " (flags given on the command line or by --model-preset win)", flush=True)
    if contradicted:
        print(f"warning: --load {args.load}: model flags that differ from its checkpoint: "
              + "; ".join(f"{_flag_text(parser, n, getattr(args, n))} (checkpoint: "
                          f"{_flag_text(parser, n, recorded[n])})" for n in contradicted),
              flush=True)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def parse_data_path(data_path: List[str]):
    """['p'] -> (['p'], None); ['0.7', 'a', '0.3', 'b'] -> (['a', 'b'], [0.7, 0.3])."""
    if len(data_path) == 1:
        return list(data_path), None
    _require(len(data_path) % 2 == 0,
             f"--data-path {' '.join(data_path)}: a blend needs weight/path pairs "
             "('W1 PATH1 W2 PATH2 ...') or a single path")
    weights, paths = [], []
    for weight, path in zip(data_path[0::2], data_path[1::2]):
        try:
            weights.append(float(weight))
        except ValueError:
            raise ConfigError(f"--data-path: blend weight {weight!r} (before {path!r}) is not a "
                              "number; use 'W1 PATH1 W2 PATH2 ...'") from None
        _require(math.isfinite(weights[-1]) and weights[-1] > 0,
                 f"--data-path: blend weight {weight} for {path} must be a finite number > 0")
        paths.append(path)
    return paths, weights


def _check_dataset_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        problem = file_problem(prefix + ext)
        if problem not in (None, "is missing"):
            raise ConfigError(f"--data-path {prefix}: {prefix + ext} {problem} (a FIFO or "
                              "device cannot be memory-mapped); pass the prefix of a "
                              "preprocessed dataset (PREFIX.bin and PREFIX.idx)")
    missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise ConfigError(
            f"--data-path {prefix}: {', '.join(prefix + m for m in missing)} not found; pass the "
            "prefix of a preprocessed dataset (tools/preprocess_data.py writes PREFIX.bin and "
            "PREFIX.idx; `python tools/build_corpus.py --dataset wikipedia` builds the embedded one)")


def parse_split(split: str) -> List[float]:
    """'969, 30, 1' -> [969.0, 30.0, 1.0]: one to three non-negative decimal weights separated
    by ',' or '/' (megatron-core reads only the digits of each: 'nan,1,1' became a 1,1 split
    and 'abc' a nan one in silence, four weights an AssertionError), of which the first, the
    training share, must be positive. ConfigError otherwise."""
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    valid = "one to three non-negative numbers separated by commas, the first (the training " \
            "share) positive, e.g. '969,30,1'"
    if not 1 <= len(parts) <= 3 or \
            not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", p) for p in parts):
        raise ConfigError(f"--split {split!r} is not a split; valid: {valid}")
    weights = [float(p) for p in parts]
    if not all(math.isfinite(w) for w in weights) or weights[0] <= 0:
        raise ConfigError(f"--split {split!r} leaves no training data; valid: {valid}")
    return weights


def _check_writable_dir(flag: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: directory is not writable ({exc.strerror}); "
                          "choose a directory you can write to") from None


def _flag_of(dest: str) -> str:
    """The command-line flag of an argparse dest ('layernorm_epsilon' -> '--norm-epsilon')."""
    for action in build_parser()._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")


def _check_finite(args) -> None:
    """Every number given is finite: argparse's float() takes 'nan' and 'inf', which would
    slip through every comparison below (nan < x is False) into the model or the optimizer."""
    for dest, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{_flag_of(dest)} {value}: not a finite number; give a finite "
                              "value (see --help for its range)")


def _check_range(flag: str, value, low, high, what: str, low_open: bool = False,
                 high_open: bool = False) -> None:
    """ConfigError naming the flag, its value and the valid range unless low <(=) value <(=)
    high (None: unbounded on that side)."""
    ok = (low is None or (value > low if low_open else value >= low)) and \
        (high is None or (value < high if high_open else value <= high))
    if not ok:
        left = "" if low is None else f"{_number(low)} {'<' if low_open else '<='} "
        right = "" if high is None else f" {'<' if high_open else '<='} {_number(high)}"
        raise ConfigError(f"{flag} {_number(value)} is out of range; valid: {left}{flag}"
                          f"{right} ({what})")


def _number(value) -> str:
    """An int as it is typed, a float in the shortest form that reads back the same."""
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _max_learning_rate(args) -> Tuple[float, str]:
    """The largest learning rate whose optimizer scalars fit float32, and why: Adam's first
    step size is lr / (1 - beta1), AdamW multiplies by 1 - lr x weight decay, SGD adds
    -lr x grad."""
    factor, why = 1.0, "the optimizer's update multiplies by it in float32"
    if args.optimizer == "adam" and 1.0 / (1.0 - args.adam_beta1) > factor:
        factor = 1.0 / (1.0 - args.adam_beta1)
        why = (f"Adam's first step size, lr / (1 - --adam-beta1 {args.adam_beta1:g}), must be "
               "a float32")
    if args.weight_decay > factor:
        factor = args.weight_decay
        why = f"lr x --weight-decay {args.weight_decay:g} must be a float32"
    return FLOAT32_MAX / factor, why


def _check_optimizer_numbers(args) -> None:
    """The optimizer's and the schedule's numbers, in the ranges torch accepts (beyond them
    torch raises at the first step) and with learning rates whose float32 scalars do not
    overflow ('value cannot be converted to type float without overflow' inside Adam)."""
    _check_range("--adam-beta1", args.adam_beta1, 0, 1, "Adam's beta1", high_open=True)
    _check_range("--adam-beta2", args.adam_beta2, 0, 1, "Adam's beta2", high_open=True)
    _check_range("--adam-eps", args.adam_eps, 0, None, "added to Adam's denominator")
    _check_range("--weight-decay", args.weight_decay, 0, None, "0 disables it")
    _check_range("--clip-grad", args.clip_grad, 0, None, "0 disables clipping")
    highest, why = _max_learning_rate(args)
    _check_range("--lr", args.lr, 0, highest, f"a learning rate; {why}")
    _check_range("--min-lr", args.min_lr, 0, None, "the floor of the schedule, at most --lr")
    _check_range("--lr-warmup-init", args.lr_warmup_init, 0, None,
                 "where the warm-up starts, at most --lr")
    if args.lr_warmup_fraction is not None:
        _check_range("--lr-warmup-fraction", args.lr_warmup_fraction, 0, 1,
                     "a fraction of --lr-decay-iters", high_open=True)
    if args.loss_scale is not None:
        _check_range("--loss-scale", args.loss_scale, 0, FLOAT32_MAX,
                     "a static fp16 loss scale", low_open=True)
    _check_range("--initial-loss-scale", args.initial_loss_scale, 0, FLOAT32_MAX,
                 "the first dynamic fp16 loss scale", low_open=True)


def _check_model_numbers(args) -> None:
    """The model's sizes within MODEL_SIZE_LIMITS; its probabilities, standard deviations and
    fractions in their ranges (beyond them torch raises at the first forward)."""
    for dest, limit in MODEL_SIZE_LIMITS.items():
        value = getattr(args, dest, None)
        if value is not None and not isinstance(value, bool):
            _check_range(_flag_of(dest), value, 1, limit, "a model size; larger ones are "
                         "typos that would exhaust the memory while the model is built")
    for dest in ("attention_dropout", "hidden_dropout"):
        _check_range(_flag_of(dest), getattr(args, dest), 0, 1, "a dropout probability")
    _check_range("--init-method-std", args.init_method_std, 0, None,
                 "the standard deviation of the initial weights")
    _check_range("--rotary-percent", args.rotary_percent, 0, 1,
                 "the fraction of each head's dimensions that rotate", low_open=True)
    _check_range("--norm-epsilon", args.layernorm_epsilon, 0, None,
                 "added to the normalization's variance")
    _check_range("--rotary-base", args.rotary_base, 0, None, "rope theta", low_open=True)


def _default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    if swiglu:
        # Keep the parameter count of a 4h GeLU MLP with three matrices; round to 64.
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def validate_args(args: argparse.Namespace, check_paths: bool = True) -> argparse.Namespace:
    """Derive dependent values in place and reject impossible combinations (ConfigError)."""
    _check_finite(args)
    # Model shape.
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        _require(getattr(args, flag) is not None,
                 f"--{flag.replace('_', '-')} is required (or pass --model-preset NAME)")
    _require(args.seq_length is not None, "--seq-length is required")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} must be positive, "
                                          f"got {getattr(args, flag)}")
    _check_range("--seq-length", args.seq_length, 1, MAX_SEQ_LENGTH, "tokens per sequence")
    if args.max_position_embeddings is not None and \
            args.position_embedding_type == "learned_absolute":
        # (A table of this many rows; rotary embeddings allocate nothing for it.)
        _check_range("--max-position-embeddings", args.max_position_embeddings, 1,
                     MAX_SEQ_LENGTH, "rows of the learned position table")
    _check_model_numbers(args)
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                 f"{args.num_attention_heads}; change one of them or set --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = _default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(args.seq_length <= args.max_position_embeddings,
                 f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                 f"{args.max_position_embeddings}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    _require(args.num_attention_heads % args.num_query_groups == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--num-query-groups {args.num_query_groups}")

    # Parallel layout.
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    for flag, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep)):
        _require(value >= 1, f"{flag} must be >= 1, got {value}")
    _require(args.world_size % (tp * pp) == 0,
             f"world size {args.world_size} is not divisible by --tensor-model-parallel-size "
             f"{tp} x --pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks")
    args.data_parallel_size = args.world_size // (tp * pp)
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.num_query_groups % tp == 0,
             f"--num-query-groups {args.num_query_groups} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by "
             f"--pipeline-model-parallel-size {pp}")
    if tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                 f"--tensor-model-parallel-size {tp}")

    # MoE / MLA.
    if args.num_experts is not None:
        _require(args.num_experts % ep == 0,
                 f"--num-experts {args.num_experts} is not divisible by "
                 f"--expert-model-parallel-size {ep}")
        _require(args.data_parallel_size * tp % ep == 0,
                 f"--expert-model-parallel-size {ep} must divide data-parallel x tensor-parallel "
                 f"size {args.data_parallel_size * tp}")
        _require(tp == 1 or args.sequence_parallel,
                 "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel")
        _require(args.moe_router_topk <= args.num_experts,
                 f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        if isinstance(args.moe_layer_freq, list):
            _require(len(args.moe_layer_freq) == args.num_layers,
                     f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers but --num-layers "
                     f"is {args.num_layers}")
    else:
        _require(ep == 1, "--expert-model-parallel-size > 1 needs --num-experts")

    # Batch sizes.
    _require(args.micro_batch_size is not None and args.micro_batch_size > 0,
             "--micro-batch-size is required and must be positive")
    tokens = args.micro_batch_size * args.seq_length
    _require(tokens <= MAX_MICRO_BATCH_TOKENS,
             f"--micro-batch-size {args.micro_batch_size} x --seq-length {args.seq_length} = "
             f"{tokens:,} tokens per micro-batch is out of range; valid: at most "
             f"{MAX_MICRO_BATCH_TOKENS:,} (lower --micro-batch-size: more micro-batches keep "
             "the global batch)")
    dp_batch = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = dp_batch
    _check_range("--global-batch-size", args.global_batch_size, 1, MAX_GLOBAL_BATCH_SIZE,
                 "sequences per step")
    _require(args.global_batch_size > 0 and args.global_batch_size % dp_batch == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_micro_batches = args.global_batch_size // dp_batch

    # Precision.
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    if args.grad_reduce_in_bf16:
        _require(args.bf16, "--grad-reduce-in-bf16 needs --bf16")

    # Training schedule.
    _require(args.train_iters is not None and args.train_iters >= 0,
             "--train-iters is required (the number of iterations to train)")
    _require(args.lr is not None, "--lr is required (the peak learning rate)")
    _check_optimizer_numbers(args)
    _require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    _check_range("--seed", args.seed, 0, SEED_LIMIT - 1 - PIPELINE_SEED_STRIDE * (pp - 1),
                 "numpy seeds are below 2**32 and pipeline stage p uses --seed + "
                 f"{PIPELINE_SEED_STRIDE} p")
    _check_range("--num-workers", args.num_workers, 0, MAX_NUM_WORKERS,
                 "data-loader processes per rank")
    _check_range("--distributed-timeout-minutes", args.distributed_timeout_minutes, 1,
                 MAX_TIMEOUT_MINUTES, "minutes a collective may wait")
    if args.exit_duration_in_mins is not None:
        _check_range("--exit-duration-in-mins", args.exit_duration_in_mins, 0, None,
                     "minutes of training before the run saves and exits; 0 stops after the "
                     "first iteration")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(args.lr_warmup_iters == 0,
                 "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _require(args.lr_decay_iters > 0,
             f"--lr-decay-iters {args.lr_decay_iters} (default: --train-iters) must be positive")
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
             f"{args.lr_decay_iters} (default: --train-iters); shorten the warm-up or set "
             "--lr-decay-iters")
    _require(args.lr_warmup_init <= args.lr,
             f"--lr-warmup-init {args.lr_warmup_init} exceeds --lr {args.lr}")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None,
                 "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    for flag in ("log_interval", "eval_interval", "tensorboard_log_interval"):
        _require(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} must be positive")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, "--exit-interval must be positive")

    # Data.
    _require(args.mock_data or args.data_path,
             "no training data: pass --data-path PREFIX (see tools/preprocess_data.py) or "
             "--mock-data")
    _require(not (args.mock_data and args.data_path),
             "--mock-data and --data-path are mutually exclusive")
    if args.data_path:
        args.data_prefixes, args.data_weights = parse_data_path(args.data_path)
        if check_paths:
            for prefix in args.data_prefixes:
                _check_dataset_prefix(prefix)
        if args.split is None:
            args.split = "969, 30, 1"
        parse_split(args.split)
    else:
        args.data_prefixes, args.data_weights = None, None
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    model = getattr(args, "tokenizer_model", None)
    if model and check_paths and not os.path.isdir(model):
        problem = file_problem(model)
        _require(problem in (None, "is missing"),
                 f"--tokenizer-model {model} {problem}; give the tokenizer's file (a FIFO "
                 "would block its reader, a device never end)")

    # Checkpointing.
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive")
        _require(args.save is not None, "--save-interval needs --save DIR")
    if args.save is not None and check_paths:
        _check_writable_dir("--save", args.save)
    if args.load is not None and check_paths:
        _require(os.path.isdir(args.load),
                 f"--load {args.load}: directory not found; pass a directory written by --save")
    if args.tensorboard_dir is not None and check_paths:
        _check_writable_dir("--tensorboard-dir", args.tensorboard_dir)

    args.params_dtype_name = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    for validate_group in EXTRA_VALIDATORS:
        validate_group(args)
    if check_paths and args.capture_config is not None:
        # Found now, not after the first iteration has trained.
        _check_writable_dir("--tensor-save-dir", args.capture_config.directory)
    return args


# Group-specific validation registered by plugin groups (quantization, tensor capture).
EXTRA_VALIDATORS: List[Callable[[argparse.Namespace], None]] = [
    validate_quantization_args,
    validate_tensor_args,
    validate_memory_args,
]


def format_args(args: argparse.Namespace) -> str:
    """The arguments as Megatron prints them at start-up, one per line, sorted. Quantization
    flags show the values the run uses (what --fp8-* imply applied, the scheme's default)."""
    values = dict(vars(args))
    quant = values.get("quant_config")
    if quant is not None:
        values.update(quant.settings.as_flags(), quant_config=quant.label)
    width = max(len(k) for k in values)
    lines = [f"  {k} {'.' * (width + 4 - len(k))} {v}" for k, v in sorted(values.items())]
    return "------------------------ arguments ------------------------\n" + "\n".join(lines) + \
        "\n-------------------- end of arguments ---------------------"
