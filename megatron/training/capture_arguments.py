"""The tensor-capture flags (names from the original system), their validation, and the
`CaptureConfig` built from them (`args.capture_config`, None when capture is off).

`TENSOR_SAVE_ENABLED` and `TENSOR_SAVE_DIR` in the environment seed the defaults of
`--save-tensors` and `--tensor-save-dir`; flags given on the command line win.

Which records are captured when comes from `--tensor-save-config FILE` (capture rules) and
the flags, an explicit flag overriding the file: `--tensor-save-mode` (rules that are not
`off`), `--tensor-save-kinds`, `--collect-micro-batches`, and the schedule flags
`--tensor-save-iters` / `--tensor-save-interval` / `--control-iter` (every rule's iterations).
Without any schedule a run captures its first iteration and ends (`--control-iter 1`).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import replace
from typing import FrozenSet, List, Optional

from megatron.tensor_capture.capture_file import read_capture_file
from megatron.tensor_capture.config import MODES, CaptureConfig, rules_mode
from megatron.tensor_capture.policy import (
    GROUPS, CaptureRule, Schedule, parse_filter, parse_kinds, parse_layers)
from megatron.training.checkpoint_files import file_problem
from megatron.training.errors import ConfigError

ENV_ENABLED = "TENSOR_SAVE_ENABLED"
ENV_DIR = "TENSOR_SAVE_DIR"
DEFAULT_DIR = "./enhanced_tensor_logs"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def add_tensor_args(parser):
    group = parser.add_argument_group(title="tensor capture")
    group.add_argument("--save-tensors", action=argparse.BooleanOptionalAction, default=None,
                       help="Capture the tensors of the attention and linear GEMMs (forward "
                            "and backward, high precision and quantized) with their statistics "
                            "(docs/capture-format.md). Default: on if $" + ENV_ENABLED +
                            " is 1/true/yes/on, else off; --no-save-tensors overrides it.")
    group.add_argument("--tensor-save-dir", type=str, default=None, metavar="DIR",
                       help="Directory for captures; records go to DIR/<quant scheme>/. "
                            f"Default: ${ENV_DIR} if set, else {DEFAULT_DIR}.")
    group.add_argument("--control-iter", type=int, default=None, metavar="N",
                       help="Capture the first N iterations of the run, then end it cleanly "
                            "(exit code 0, after saving if --save). 0 = capture every "
                            "iteration and do not stop early. Default: 1 when no schedule "
                            "(--tensor-save-iters, --tensor-save-interval, a config file) is "
                            "given; with a schedule the run is not stopped by capture.")
    group.add_argument("--tensor-save-iters", nargs="+", default=None, metavar="ITER",
                       help="Capture these global iterations (1-based, as in the training log; "
                            "after --load too, e.g. 1000 when resuming from 990), comma- or "
                            "space-separated. Overrides the config file's iterations.")
    group.add_argument("--tensor-save-interval", type=str, default=None, metavar="N",
                       help="Capture every N-th global iteration (N, 2N, ...). Overrides the "
                            "config file's intervals.")
    group.add_argument("--tensor-save-config", type=str, default=None, metavar="FILE",
                       help="YAML or JSON capture rules: per module regex / module names / "
                            "tensor kinds, the mode (full, stats, off), iterations and kept "
                            "statistics (docs/capture-format.md). Flags given explicitly "
                            "override it.")
    group.add_argument("--collect-micro-batches", type=int, default=None, metavar="M",
                       help="Number of micro-batches captured in each captured iteration (the "
                            "first M; default: the config file's micro_batches, else 1).")
    group.add_argument("--tensor-save-layers", nargs="+", default=None, metavar="LAYER",
                       help="Capture only these layers: 1-based transformer layer numbers, "
                            "ranges like 2-4, negative numbers from the last layer, 0 for the "
                            "output layer; comma- or space-separated. Default: every layer.")
    group.add_argument("--tensor-save-filter", type=str, default=None, metavar="REGEX",
                       help="Capture only records whose name matches this regular expression "
                            "(re.search on e.g. 'linear_L2_forward_pre_linear_input_linear_fc1', "
                            "see docs/capture-format.md).")
    group.add_argument("--tensor-save-kinds", nargs="+", default=None, metavar="KIND",
                       help="Which tensors: tokens [attention.|linear.]<name or group>, e.g. "
                            "'attention.query linear.grad_weight backward'. Groups: "
                            f"{', '.join(GROUPS)}. Default: 'default' = attention q/k/v/output "
                            "and their gradients, linear input/weight/output, grad_output and "
                            "grad_input, plus every operand a quantized GEMM uses.")
    group.add_argument("--tensor-save-mode", type=str, default=None,
                       metavar="{full,stats}",
                       help="full (default): write each tensor, its quantized version and "
                            "statistics to a .pt file; stats: no tensor data, only the "
                            "statistics in the manifest (cheap enough for every iteration with "
                            "--control-iter 0). Overrides the config file's modes (rules "
                            "with mode off stay off).")
    group.add_argument("--tensor-save-continue-on-error", action="store_true",
                       help="When capture fails (full disk, unwritable directory), stop "
                            "capturing and keep training instead of ending the run with an "
                            "error.")
    group.add_argument("--tensor-save-queue-size", type=int, default=256, metavar="N",
                       help="Maximum number of records waiting for the writer thread; the "
                            "training step waits (back-pressure) when it is full (default 256).")
    group.add_argument("--tensor-save-queue-mb", type=float, default=1024.0, metavar="MB",
                       help="Maximum host memory (MiB) held by records waiting for the writer "
                            "thread (default 1024; a single larger record is still accepted "
                            "alone).")
    group.add_argument("--tensor-save-drain-timeout", type=float, default=600.0,
                       metavar="SECONDS",
                       help="Seconds to wait at the end of the run for the writer to finish "
                            "pending records before giving up on them (default 600).")
    return parser


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={os.environ[name]!r} is not a boolean; valid: "
                      f"{', '.join(_TRUE + _FALSE[1:])} (or unset)")


def validate_tensor_args(args) -> None:
    """Apply environment defaults, check the flags and set `args.capture_config`."""
    if args.save_tensors is None:
        args.save_tensors = _env_flag(ENV_ENABLED)
    if args.tensor_save_dir is None:
        args.tensor_save_dir = os.environ.get(ENV_DIR) or DEFAULT_DIR
    if not str(args.tensor_save_dir).strip():
        raise ConfigError("--tensor-save-dir is empty; give a directory path")
    args.capture_warnings = _unused_capture_flags(args)
    if args.control_iter is not None and args.control_iter < 0:
        raise ConfigError(f"--control-iter {args.control_iter} is invalid; valid: 0 (capture "
                          "every iteration, no early stop) or a positive number of iterations")
    if args.save_tensors and args.control_iter and args.train_iters is not None and \
            args.control_iter > args.train_iters:
        raise ConfigError(f"--control-iter {args.control_iter} is beyond --train-iters "
                          f"{args.train_iters}; valid: 0 or 1..{args.train_iters}")
    if args.collect_micro_batches is not None and args.collect_micro_batches < 1:
        raise ConfigError(f"--collect-micro-batches {args.collect_micro_batches} is invalid; "
                          "valid: a positive number of micro-batches")
    if args.tensor_save_mode is not None and args.tensor_save_mode not in MODES:
        raise ConfigError(f"--tensor-save-mode {args.tensor_save_mode!r} is invalid; valid: "
                          f"{', '.join(MODES)}")
    if args.tensor_save_queue_size < 1:
        raise ConfigError(f"--tensor-save-queue-size {args.tensor_save_queue_size} is invalid; "
                          "valid: a positive number of records")
    if not args.tensor_save_queue_mb > 0:
        raise ConfigError(f"--tensor-save-queue-mb {args.tensor_save_queue_mb} is invalid; "
                          "valid: a positive number of MiB")
    if not args.tensor_save_drain_timeout > 0:
        raise ConfigError(f"--tensor-save-drain-timeout {args.tensor_save_drain_timeout} is "
                          "invalid; valid: a positive number of seconds")
    try:
        layers = parse_layers(args.tensor_save_layers, args.num_layers)
        kinds = parse_kinds(args.tensor_save_kinds)
        name_filter = parse_filter(args.tensor_save_filter)
        iterations = parse_iterations(args.tensor_save_iters, args.train_iters)
        interval = parse_interval(args.tensor_save_interval, args.train_iters)
        if args.tensor_save_config:
            _check_config_file(args.tensor_save_config)
        capture_file = read_capture_file(args.tensor_save_config, args.train_iters) \
            if args.tensor_save_config else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    flag_schedule = bool(iterations) or bool(interval)
    if args.tensor_save_iters is not None:
        args.tensor_save_iters = sorted(iterations)
    if args.tensor_save_interval is not None:
        args.tensor_save_interval = interval
    overrides = {}
    if args.tensor_save_kinds is not None:
        overrides["kinds"] = kinds
    if flag_schedule or args.control_iter is not None:
        overrides["schedule"] = Schedule(iterations, interval)
    if args.control_iter is None and not flag_schedule and \
            not (capture_file is not None and capture_file.has_schedule):
        args.control_iter = 1          # no schedule at all: the first iteration, then stop
    if args.tensor_save_mode is not None:
        overrides["mode"] = args.tensor_save_mode
    rules = capture_file.rules if capture_file is not None else (CaptureRule(name="flags"),)
    # An explicit mode does not switch on what a rule turned off.
    rules = tuple(replace(rule, **{k: v for k, v in overrides.items()
                                   if k != "mode" or rule.mode != "off"}) for rule in rules)
    if args.collect_micro_batches is None:
        args.collect_micro_batches = (capture_file.micro_batches if capture_file else None) or 1
    if args.tensor_save_mode is None:
        args.tensor_save_mode = rules_mode(rules)
    args.capture_config = None if not args.save_tensors else CaptureConfig(
        root=args.tensor_save_dir, quant_scheme=args.quant_config.label, rules=rules,
        control_iter=args.control_iter, micro_batches=args.collect_micro_batches,
        layers=layers, name_filter=name_filter, config_file=args.tensor_save_config,
        continue_on_error=bool(args.tensor_save_continue_on_error),
        queue_records=args.tensor_save_queue_size,
        queue_bytes=int(args.tensor_save_queue_mb * 2 ** 20),
        drain_timeout=args.tensor_save_drain_timeout, train_iters=args.train_iters,
        num_micro_batches=args.num_micro_batches, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, element_bytes=2 if (args.bf16 or args.fp16) else 4)


# A capture config file holds a few rules; anything larger is not one (and /dev/zero would be
# read until the memory ran out).
CONFIG_FILE_BYTES = 1 << 20


def _check_config_file(path: str) -> None:
    """--tensor-save-config names a regular file of at most CONFIG_FILE_BYTES (a FIFO would
    block the reader forever, a device never end)."""
    problem = file_problem(path, CONFIG_FILE_BYTES)
    if problem is not None and problem != "is missing":    # (missing: the reader says so)
        raise ConfigError(f"--tensor-save-config {path} {problem}; give a YAML or JSON file "
                          "of capture rules")


def _tokens(values):
    return [t for value in values for t in re.split(r"[,\s]+", str(value)) if t]


def _iteration(flag: str, token: str, train_iters: int, what: str = "iteration") -> int:
    try:
        value = int(token)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{flag} {token!r} is not a positive integer {what}; valid: "
                         f"1..{train_iters} (1-based, as in the training log)")
    if value > train_iters:
        raise ValueError(f"{flag} {value} is beyond --train-iters {train_iters}; valid: "
                         f"1..{train_iters}")
    return value


def parse_iterations(values, train_iters: int) -> FrozenSet[int]:
    """--tensor-save-iters: global iterations within 1..--train-iters."""
    return frozenset(_iteration("--tensor-save-iters", token, train_iters)
                     for token in _tokens(values or []))


def parse_interval(value: Optional[str], train_iters: int) -> int:
    """--tensor-save-interval: 0 when not given."""
    if value is None:
        return 0
    return _iteration("--tensor-save-interval", str(value).strip(), train_iters, "interval")


# The flags recorded in each capture's run-{run_id}.json (provenance for the analysis), besides
# every quantization flag (config.py), which run_args records as the run uses them.
RUN_ARGS = (
    "model_preset", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "seq_length", "micro_batch_size", "global_batch_size",
    "num_micro_batches", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "data_parallel_size", "expert_model_parallel_size", "sequence_parallel", "num_experts",
    "multi_latent_attention", "quant_stats_interval", "bf16", "fp16", "seed", "lr",
    "train_iters", "tokenizer_type", "vocab_size", "padded_vocab_size", "mock_data", "data_path",
    "tensor_save_mode", "tensor_save_layers", "tensor_save_filter", "tensor_save_kinds",
    "tensor_save_iters", "tensor_save_interval", "tensor_save_config", "git_commit",
)


def run_args(args) -> dict:
    """RUN_ARGS and the quantization flags as JSON-ready values: the quantization flags as the
    run uses them (what --fp8-* imply applied), quant_scheme the run's label."""
    values = {name: getattr(args, name, None) for name in RUN_ARGS}
    quant = getattr(args, "quant_config", None)
    if quant is not None:
        values.update(quant.settings.as_flags(), quant_scheme=quant.label)
    out = {}
    for name, value in values.items():
        out[name] = value if isinstance(value, (bool, int, float, str, type(None))) else \
            (list(value) if isinstance(value, (list, tuple)) else str(value))
    return out


def _unused_capture_flags(args) -> List[str]:
    """Warning lines for schedule flags given while --save-tensors is off (they do nothing)."""
    if args.save_tensors:
        return []
    given = [flag for flag, value in (("--tensor-save-iters", args.tensor_save_iters),
                                      ("--tensor-save-interval", args.tensor_save_interval),
                                      ("--tensor-save-config", args.tensor_save_config),
                                      ("--control-iter", args.control_iter))
             if value is not None]
    if not given:
        return []
    return [f"warning: {', '.join(given)} given without --save-tensors "
            f"(or ${ENV_ENABLED}=1): nothing is captured"]
