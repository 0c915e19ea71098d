#!/usr/bin/env python
"""Launch one cell of the experiment matrix: model x dataset x quant scheme x training config.

    python train_config.py --list
    python train_config.py --model llama32-1b --dataset wikipedia --quant-scheme FA_mxfp8 --dry-run
    python train_config.py --model llama-tiny --dataset mock --quant-scheme linear_hifp8 \\
        --training-config fast -- --train-iters 5
    python train_config.py --model llama-tiny --dataset mock --quant-scheme all --print-schemes

The command comes from the experiment matrix, megatron/training/experiments/ (the single source
of truth shared with examples/llama/ and the collection drivers). Without --dry-run the command
runs with its output streamed, and this script exits with its exit code. --quantization, the
original name of --quant-scheme, is still accepted.

Start-up stays light: nothing on the paths of --help, --list, --dry-run or --print-schemes
imports torch or megatron.core. --estimate-memory prints the per-GPU memory estimate of the
command (megatron/training/memory_estimate/) instead of running it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # runnable as `python train_config.py` from anywhere
    sys.path.insert(0, _HERE)

from megatron.training import corpora  # noqa: E402
from megatron.training import experiments as ex  # noqa: E402
from megatron.training.budget import describe_budget_of_command  # noqa: E402

PROG_TAG = "[train_config]"
# The commands run the pretrain_gpt.py beside this script.
PRETRAIN_SCRIPT = os.path.join(_HERE, "pretrain_gpt.py")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


class _Parser(argparse.ArgumentParser):
    """Errors as one line naming the bad value and the valid set (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(fa: bool = False) -> argparse.ArgumentParser:
    """The command line of train_config.py (fa=False) or flash_attention_config.py (fa=True)."""
    prog = "flash_attention_config.py" if fa else "train_config.py"
    what = ("an attention-only quantization study" if fa else
            "one experiment of the matrix")
    parser = _Parser(
        prog=prog, allow_abbrev=False,
        description=f"Print or run the torchrun command of {what}. Flags after '--' are "
                    "appended to the pretrain_gpt.py flags (and override them).",
        epilog="Every valid name: --list. Commands come from the experiment matrix, "
               "megatron/training/experiments/.")

    info = parser.add_argument_group("information")
    info.add_argument("--list", action="store_true",
                      help="List models, datasets, quantizations and training configs, then exit.")
    info.add_argument("--names", choices=ex.NAME_KINDS, default=None, metavar="KIND",
                      help="Print the valid names of one kind, one per line, then exit (for "
                           f"scripts). KIND: {', '.join(ex.NAME_KINDS)}.")
    info.add_argument("--print-schemes", action="store_true",
                      help="Check the experiments as --dry-run does, but print the canonical "
                           "quant scheme of each command, one per line, instead of the commands "
                           "(for scripts; with --check, exit 2 if an input is missing).")

    exp = parser.add_argument_group("experiment")
    exp.add_argument("--model", default=None, metavar="MODEL",
                     help=f"Model: {', '.join(ex.model_names(include_aliases=True))}.")
    exp.add_argument("--dataset", default=None, metavar="DATASET",
                     help=f"Dataset: {', '.join(ex.ALL_DATASETS)} (mock: synthetic tokens, "
                          "nothing on disk).")
    if fa:
        exp.add_argument("--fa-quantization", action="append", default=None, metavar="NAME",
                         help="Attention quantization: qk_<fmt> quantizes QK^T (scheme FA_<fmt>), "
                              "qk_pv_<fmt> also PV (--attn-pv-quant <fmt>), none = bf16. Valid: "
                              f"{', '.join(ex.FA_QUANTIZATIONS)}. With --dry-run, --check or "
                              "--print-schemes: several (repeated or comma-separated) or 'all'.")
    else:
        exp.add_argument("--quant-scheme", "--quantization", dest="quant_scheme",
                         action="append", default=None, metavar="SCHEME",
                         help=f"Quantization scheme: the experiment matrix's "
                              f"{', '.join(ex.QUANT_SCHEMES)} ('all' runs these), or "
                              f"{', '.join(s for s in ex.ALL_QUANT_SCHEMES if s not in ex.QUANT_SCHEMES)}"
                              f" (a bare format {'/'.join(ex.ELEMENT_FORMATS)} means "
                              "FA_linear_<fmt>, as CUSTOM_QUANT_TYPE did; --list describes each). "
                              "Default: bf16. With --dry-run, --check or --print-schemes: several "
                              "(repeated or comma-separated) or 'all'. --quantization is its "
                              "original name, still accepted.")
    exp.add_argument("--training-config", default="standard", metavar="NAME",
                     help=f"Training config: {', '.join(ex.TRAINING_CONFIG_NAMES)} (fast: smoke "
                          "test; standard: the model's pretraining recipe). Default: standard.")
    exp.add_argument("--dry-run", action="store_true",
                     help="Print the exact command instead of running it (missing data is "
                          "reported as a note).")
    exp.add_argument("--check", action="store_true",
                     help="Like --dry-run, but exit 2 if an input (dataset, tokenizer) is "
                          "missing.")
    exp.add_argument("--estimate-memory", action="store_true",
                     help="Print the per-GPU memory estimate of the command (as "
                          "tools/estimate_memory.py measures it) instead of running it; one "
                          "estimate per quantization.")

    launch = parser.add_argument_group("launch")
    launch.add_argument("--nproc-per-node", type=_positive_int, default=None,
                        help="Ranks per node (default: the model's, see --list).")
    launch.add_argument("--nnodes", type=_positive_int, default=os.environ.get("NNODES") or "1",
                        help="Number of nodes (default: $NNODES or 1).")
    launch.add_argument("--node-rank", type=_non_negative_int,
                        default=os.environ.get("NODE_RANK") or "0",
                        help="Rank of this node (default: $NODE_RANK or 0).")
    launch.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                        help="Address of node 0 (default: $MASTER_ADDR; one node without it "
                             "uses torchrun --standalone).")
    launch.add_argument("--master-port", type=_positive_int,
                        default=os.environ.get("MASTER_PORT") or None,
                        help="Port on node 0 (default: $MASTER_PORT, else 6000 on several nodes).")

    paths = parser.add_argument_group(
        "paths", "In --run-dir, --checkpoint-dir and --tensorboard-dir, '{scheme}' stands for "
                 "the quantization scheme of the command.")
    paths.add_argument("--tokenizer-model", default=None,
                       help="Tokenizer file for real data: a Llama 3 tokenizer.model or a "
                            "HuggingFace tokenizer.json (default: the built-in Llama 3 tokenizer).")
    paths.add_argument("--data-root", default=None,
                       help="Directory holding the embedded datasets (default: "
                            f"{corpora.DEFAULT_DATA_ROOT}"
                            + ("" if os.path.isabs(corpora.DEFAULT_DATA_ROOT)
                               else ", relative to the working directory") + ").")
    paths.add_argument("--run-dir", default=None,
                       help="Directory for checkpoints and TensorBoard logs (default: "
                            "runs/{model}/{dataset}/{quantization}/{training config}).")
    paths.add_argument("--checkpoint-dir", default=None,
                       help="--save/--load directory (default: {run-dir}/checkpoints).")
    paths.add_argument("--tensorboard-dir", default=None,
                       help="TensorBoard directory (default: {run-dir}/tensorboard for the "
                            "standard config, none for fast).")
    paths.add_argument("--checkpoints", action=argparse.BooleanOptionalAction, default=None,
                       help="Write (and resume from) checkpoints. Default: as the training "
                            "config says (standard: yes, fast: no).")

    capture = parser.add_argument_group("tensor capture (passed to pretrain_gpt.py)")
    capture.add_argument("--save-tensors", action="store_true",
                         help="Capture tensors of the attention and linear GEMMs.")
    capture.add_argument("--tensor-save-dir", default=None,
                         help="Capture root; records go to {dir}/{quantization scheme}/ "
                              "(default: pretrain_gpt.py's, ./enhanced_tensor_logs).")
    capture.add_argument("--control-iter", type=_non_negative_int, default=None,
                         help="Capture iterations 1..N, then end the run (0: every iteration).")
    capture.add_argument("--collect-micro-batches", type=_positive_int, default=None,
                         help="Micro-batches captured per captured iteration.")
    return parser


def _requested(values: Optional[Sequence[str]], default: str, every: Sequence[str]) -> List[str]:
    """Repeated / comma-separated names, 'all' expanded, order kept, duplicates dropped."""
    names: List[str] = []
    for value in values or [default]:
        for name in (n.strip() for n in value.split(",")):
            for item in (every if name == "all" else [name]):
                if item and item not in names:
                    names.append(item)
    return names


def resolve_quantizations(parser, args, fa: bool) -> List[Tuple[str, Optional[str]]]:
    """[(quant scheme, attention PV format or None)] from --quant-scheme or --fa-quantization."""
    if fa:
        if not args.fa_quantization:
            parser.error("--fa-quantization is required (valid: "
                         f"{', '.join(ex.FA_QUANTIZATIONS)})")
        out = []
        for name in _requested(args.fa_quantization, "none", list(ex.FA_QUANTIZATIONS)):
            try:
                out.append(ex.fa_quantization(name))
            except ex.ExperimentError as exc:
                parser.error(str(exc))
        return out
    out = []
    for name in _requested(args.quant_scheme, "bf16", ex.QUANT_SCHEMES):
        if name in ex.ELEMENT_FORMATS:
            quant_scheme = f"FA_linear_{name}"
            print(f"{PROG_TAG} note: quantization {name} means {quant_scheme} (linear layers "
                  "and attention QK^T)", file=sys.stderr)
            name = quant_scheme
        elif name not in ex.ALL_QUANT_SCHEMES:
            parser.error(f"unknown quantization scheme {name!r}; valid: "
                         f"{', '.join(ex.ALL_QUANT_SCHEMES)} (or "
                         f"{', '.join(ex.ELEMENT_FORMATS)}, all)")
        if (name, None) not in out:
            out.append((name, None))
    return out


def _fill_scheme(path: Optional[str], variant: str) -> Optional[str]:
    """'{scheme}' in a path option stands for each command's quant scheme (and PV format)."""
    return None if path is None else path.replace("{scheme}", variant)


def experiments_from_args(parser, args, extra: Sequence[str], fa: bool) -> List[ex.Experiment]:
    if args.model is None:
        parser.error("--model is required (valid: "
                     f"{', '.join(ex.model_names(include_aliases=True))})")
    if args.dataset is None:
        parser.error(f"--dataset is required (valid: {', '.join(ex.ALL_DATASETS)})")
    quantizations = resolve_quantizations(parser, args, fa)
    if len(quantizations) > 1 and not (args.dry_run or args.check or args.print_schemes
                                       or args.estimate_memory):
        parser.error(f"{len(quantizations)} quantizations given; a run takes one (several only "
                     "with --dry-run, --check or --estimate-memory)")
    capture_given = [flag for flag, value in (("--tensor-save-dir", args.tensor_save_dir),
                                              ("--control-iter", args.control_iter),
                                              ("--collect-micro-batches",
                                               args.collect_micro_batches))
                     if value is not None]
    if capture_given and not args.save_tensors:
        parser.error(f"{', '.join(capture_given)} need --save-tensors")
    capture = ex.Capture(args.tensor_save_dir, args.control_iter,
                         args.collect_micro_batches) if args.save_tensors else None
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be < --nnodes {args.nnodes}")
    exps = []
    for quant_scheme, pv in quantizations:
        exp = ex.Experiment(
            model=args.model, dataset=args.dataset, quant_scheme=quant_scheme,
            training_config=args.training_config, attn_pv_quant=pv,
            nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
            master_addr=args.master_addr, master_port=args.master_port,
            tokenizer_model=args.tokenizer_model, data_root=args.data_root,
            checkpoints=args.checkpoints, capture=capture, extra_args=tuple(extra))
        exp = dataclasses.replace(
            exp, run_dir=_fill_scheme(args.run_dir, exp.variant),
            checkpoint_dir=_fill_scheme(args.checkpoint_dir, exp.variant),
            tensorboard_dir=_fill_scheme(args.tensorboard_dir, exp.variant))
        try:
            ex.check_experiment(exp)
        except ex.ExperimentError as exc:
            parser.error(str(exc))
        exps.append(exp)
    return exps


def effective_env(cmd: ex.Command) -> "dict":
    """The variables the command sets; a value already in the environment is kept."""
    return {k: os.environ.get(k, v) for k, v in cmd.env.items()}


def run(cmd: ex.Command) -> int:
    """Run the command with inherited stdout/stderr; return its exit code (128+N on signal N)."""
    for directory in cmd.makedirs:
        os.makedirs(directory, exist_ok=True)
    argv = ex.resolve_torchrun() + cmd.launcher[1:] + [cmd.script] + cmd.pretrain_args
    env = dict(os.environ)
    env.update(effective_env(cmd))
    proc = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C reaches the child through the terminal's process group; do not die before it.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def estimate_memory(cmds: Sequence[ex.Command]) -> int:
    """The per-GPU memory estimate of each command (nothing is launched or read from disk)."""
    # Imported here: it needs torch and megatron-core, which the other paths never load.
    from megatron.training.memory_estimate import main as estimate_main

    code = 0
    for i, cmd in enumerate(cmds):
        if i:
            print()
        print(f"{PROG_TAG} {cmd.shell()}", flush=True)
        code = max(code, estimate_main(cmd.pretrain_args
                                       + ["--world-size", str(cmd.experiment.world_size)]))
    return code


def main(argv: Optional[Sequence[str]] = None, fa: bool = False) -> int:
    own, extra = ex.split_extra(sys.argv[1:] if argv is None else argv)
    parser = build_parser(fa)
    args = parser.parse_args(own)
    if args.list:
        print(ex.format_listing(fa=fa))
        return 0
    if args.names:
        print("\n".join(ex.names(args.names)))
        return 0
    exps = experiments_from_args(parser, args, extra, fa)
    cmds = []
    for exp in exps:
        cmd = ex.build_command(exp, PRETRAIN_SCRIPT)
        env = effective_env(cmd)
        cmd.env.clear()
        cmd.env.update(env)
        cmds.append(cmd)
    if args.estimate_memory:
        return estimate_memory(cmds)
    problems = ex.missing_inputs(exps[0])   # the same data and tokenizer for every command
    if args.dry_run or args.check or args.print_schemes:
        for cmd in cmds:
            print(cmd.experiment.quant_scheme if args.print_schemes else cmd.shell(), flush=True)
        if not args.print_schemes:
            for line in describe_budget_of_command(cmds[0].pretrain_args):
                print(f"{PROG_TAG} {line}", file=sys.stderr, flush=True)
        for problem in problems:
            if args.check:
                print(f"{parser.prog}: error: {problem}", file=sys.stderr)
            else:
                print(f"{PROG_TAG} note: {problem}", file=sys.stderr)
        return 2 if (args.check and problems) else 0
    if problems:
        for problem in problems:
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    print(f"{PROG_TAG} {cmds[0].shell()}", flush=True)
    return run(cmds[0])


if __name__ == "__main__":
    sys.exit(main())
