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

SWEEPS = ("sites", "layers")
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
                        "increases over the unquantized model. layers (for deep models): one "
                        "layer at a time with all its sites, then one site kind in every "
                        "layer, then the output layer (L + kinds + 1 evaluations).")
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
    _check_eval_iters(rest)
    if own.load_hf:
        import_hf(own)
    else:
        _check_load_dir(own.load)
    rest += ["--load", hf_checkpoint_dir(own) if own.load_hf else own.load]
    args = parse_args(rest)
    if args.quant_scheme or args.quant_recipe or args.quant_recipe_file:
        raise ConfigError("give the arms with --schemes (SPEC@flag=value for an arm's own "
                          "flags), not --quant-scheme/--quant-recipe/--quant-recipe-file")
    if args.quant_schedule:
        from megatron.quantization.schedule import NOT_IN_EVALUATION

        raise ConfigError(NOT_IN_EVALUATION)
    # Training-only settings evaluation never uses (validate_args requires them).
    if args.train_iters is None:
        args.train_iters = 1
    if args.lr is None:
        args.lr = 0.0
    args = validate_args(args)
    check_tokenizer(args)
    return own, args


def _check_eval_iters(rest: List[str]) -> None:
    """--eval-iters is pretrain_gpt.py's flag; an evaluation needs at least one batch."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--eval-iters", type=int, default=None)
    try:
        known, _ = probe.parse_known_args(rest)
    except SystemExit:
        return              # not an integer: pretrain_gpt.py's parser names it
    if known.eval_iters is not None and known.eval_iters < 1:
        raise ConfigError(f"--eval-iters {known.eval_iters}: must be >= 1 (each arm evaluates "
                          "--eval-iters x micro-batches of the validation split)")


def _check_load_dir(load: str) -> None:
    """--load names an existing directory holding a checkpoint (before the model flags are
    looked for in it)."""
    from megatron.training.checkpoint_files import TRACKER_FILE

    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory; pass a checkpoint directory "
                          "(pretrain_gpt.py --save, tools/convert_hf.py import) or --load-hf")
    if not os.path.exists(os.path.join(load, TRACKER_FILE)):
        raise ConfigError(f"--load {load}: no checkpoint there (no {TRACKER_FILE})")


def check_tokenizer(args) -> None:
    """The tokenizer's vocabulary against the one the checkpoint was made for, before any
    work (NullTokenizer adds one entry, its end of document, to --vocab-size)."""
    from megatron.training.model_args import TOKENIZER_VOCAB_KEY, read_common_state
    from megatron.training.tokenizer import TokenizerError, build_tokenizer

    common = read_common_state(args.load)
    saved = None if common is None else common.get(TOKENIZER_VOCAB_KEY)
    try:
        size = build_tokenizer(args).vocab_size
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from None
    if saved is None or saved == size:
        return
    if args.tokenizer_type == "NullTokenizer":
        raise ConfigError(f"--load {args.load}: checkpoint made for a tokenizer of {saved} "
                          f"entries; --tokenizer-type NullTokenizer --vocab-size "
                          f"{args.vocab_size} has {size} (NullTokenizer adds its end of "
                          f"document): pass --vocab-size {saved - 1}, or no tokenizer flags "
                          "where the checkpoint records its tokenizer")
    raise ConfigError(f"--load {args.load}: checkpoint made for a tokenizer of {saved} entries, "
                      f"--tokenizer-type {args.tokenizer_type} has {size}; pass the checkpoint's "
                      "tokenizer (--tokenizer-type, --tokenizer-model, --vocab-size)")


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
    """--load-hf: import the HF directory or .gguf file once into OUT/hf_checkpoint; an
    import of another model there (or of this one before its files changed) is refused."""
    from megatron.training.hf_llama import (
        SOURCE_FILE, import_checkpoint, read_source_record, source_record)

    target = hf_checkpoint_dir(own)
    if not os.path.lexists(own.load_hf):
        raise ConfigError(f"--load-hf {own.load_hf}: no such file or directory; pass a local "
                          "HuggingFace Llama directory or a .gguf file")
    if os.path.exists(os.path.join(target, "latest_checkpointed_iteration.txt")):
        recorded = read_source_record(target)
        wanted = source_record(own.load_hf)
        if recorded == wanted:
            print(f"[evaluate] reusing {target} (imported from {own.load_hf})", flush=True)
            return
        if recorded is None:
            held = f"a checkpoint that does not record its source ({SOURCE_FILE})"
        elif recorded.get("source") != wanted["source"]:
            held = f"an import of {recorded.get('source')}"
        else:
            held = f"an import of {wanted['source']} made before its files changed"
        raise ConfigError(f"--output-dir {own.output_dir} holds {held} in {target}, not of "
                          f"--load-hf {own.load_hf}: give another --output-dir, or remove "
                          f"{target} to import it again")

    print(f"[evaluate] importing {own.load_hf} -> {target}", flush=True)
    import_checkpoint(own.load_hf, target)
