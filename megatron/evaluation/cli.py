"""tools/evaluate.py: one checkpoint, several quantization arms, identical batches.

    python tools/evaluate.py (--load CKPT_DIR | --load-hf HF_DIR) --schemes S1 [S2 ...]
        --output-dir OUT [--dump-logits FILE.npz] [--sweep sites] [--gradients]
        [pretrain_gpt.py data, batch and model flags]

The first scheme is the baseline. Every arm evaluates the same weights on the same validation
micro-batches (--eval-iters x micro-batches; without --bf16 in fp32). Outputs: OUT/evaluation.json
(schema in docs/evaluation.md), OUT/evaluation.md (the tables) and OUT/*.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import List, Optional

from megatron.training.errors import ConfigError, TrainingError

SWEEPS = ("sites",)
DEFAULT_SWEEP_SCHEME = "FA_linear_mxfp4@attn-pv-quant=mxfp4,quant-output-layer"
DEFAULT_DRAW_COUNTS = (1, 2, 4, 8, 16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evaluate.py", allow_abbrev=False,
        description="Evaluate one checkpoint under several quantization schemes on identical "
                    "validation batches (direct cast), optionally per GEMM site (--sweep "
                    "sites) and for gradient fidelity (--gradients). Every other flag is "
                    "pretrain_gpt.py's (data, batch, model, quantization flags shared by all "
                    "arms).",
        epilog="SPEC: a --quant-scheme, recipe_<name> (a named recipe) or a recipe file "
               "(*.yaml|*.yml|*.json), optionally followed by @flag=value,flag,... with "
               "pretrain_gpt.py quantization flags for that arm only, e.g. "
               "linear_mxfp8@mx-scale-mode=rceil (list values joined by '+').")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="Checkpoint directory of this stack (any TP/PP layout; "
                                    "its newest verified iteration).")
    src.add_argument("--load-hf", metavar="HF_DIR",
                     help="A local HuggingFace Llama directory (config.json + safetensors), "
                          "imported first into OUT/hf_checkpoint (reused when present).")
    p.add_argument("--schemes", nargs="+", required=True, metavar="SPEC",
                   help="The arms; the first is the baseline the others are compared with.")
    p.add_argument("--output-dir", required=True, help="Where evaluation.json, evaluation.md "
                                                        "and the figures go.")
    p.add_argument("--dump-logits", metavar="FILE.npz",
                   help="Write the baseline arm's first micro-batch: tokens [b, s] int64 and "
                        "logits [b, s, vocab] float32 (vocabulary padding removed).")
    p.add_argument("--sweep", choices=SWEEPS,
                   help="sites: quantize one GEMM site at a time (layer x qkv/proj/fc1/fc2/QK/"
                        "PV, and the output layer) in --sweep-scheme and rank the loss "
                        "increases over the unquantized model.")
    p.add_argument("--sweep-scheme", default=DEFAULT_SWEEP_SCHEME, metavar="SPEC",
                   help="The configuration a swept site gets (default: %(default)s).")
    p.add_argument("--gradients", action="store_true",
                   help="Gradient fidelity of every arm versus the baseline arm and the fp32 "
                        "unquantized model (cosine, relative L2, per site and in total); arms "
                        "with stochastic rounding also average K draws. One process; holds "
                        "float64 copies of the gradients: for small models.")
    p.add_argument("--gradient-micro-batches", type=int, default=2, metavar="N",
                   help="Micro-batches whose gradients are compared, each one's and their "
                        "token-weighted mean (default: %(default)s; the first N evaluation "
                        "micro-batches).")
    p.add_argument("--gradient-draws", type=int, nargs="+", default=list(DEFAULT_DRAW_COUNTS),
                   metavar="K", help="Draw counts K at which the mean of K stochastic-rounding "
                                     "gradients is compared (default: %(default)s).")
    p.add_argument("--rounding-seed", type=int, default=None, metavar="N",
                   help="Seed of the stochastic-rounding draws (default: --seed); change it to "
                        "redraw the rounding on the same batches (--seed also picks the data).")
    return p


def parse(argv: Optional[List[str]] = None):
    """(evaluate's own args, pretrain_gpt.py's validated args)."""
    from megatron.training.arguments import parse_args, validate_args

    own, rest = build_parser().parse_known_args(argv)
    if own.gradient_micro_batches < 1:
        raise ConfigError(f"--gradient-micro-batches {own.gradient_micro_batches}: must be >= 1")
    if any(k < 1 for k in own.gradient_draws):
        raise ConfigError(f"--gradient-draws {own.gradient_draws}: every K must be >= 1")
    if own.load_hf:
        import_hf(own)
    rest += ["--load", hf_checkpoint_dir(own) if own.load_hf else own.load]
    args = parse_args(rest)
    if args.quant_scheme or args.quant_recipe or args.quant_recipe_file:
        raise ConfigError("give the arms with --schemes (SPEC@flag=value for an arm's own "
                          "flags), not --quant-scheme/--quant-recipe/--quant-recipe-file")
    # Training-only settings evaluation never uses (validate_args requires them).
    if args.train_iters is None:
        args.train_iters = 1
    if args.lr is None:
        args.lr = 0.0
    args = validate_args(args)
    return own, args


def hf_checkpoint_dir(own) -> str:
    return os.path.join(own.output_dir, "hf_checkpoint")


def main(argv: Optional[List[str]] = None) -> int:
    start = time.time()
    try:
        own, args = parse(argv)
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
        from megatron.evaluation.run import evaluate

        evaluate(own, args, start)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def import_hf(own) -> None:
    """--load-hf: import the HF directory once into OUT/hf_checkpoint."""
    target = hf_checkpoint_dir(own)
    if os.path.exists(os.path.join(target, "latest_checkpointed_iteration.txt")):
        print(f"[evaluate] reusing {target} (imported from {own.load_hf})", flush=True)
        return
    from megatron.training.hf_llama import import_checkpoint

    print(f"[evaluate] importing {own.load_hf} -> {target}", flush=True)
    import_checkpoint(own.load_hf, target)
