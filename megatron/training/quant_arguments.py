"""The simulated-GEMM flags and the `QuantConfig` built from them (`args.quant_config`).

Every quantization flag is generated from its setting in megatron/quantization/config.py (type,
choices, default, help); this module adds the two run-level flags (--quant-check,
--quant-stats-interval) and resolves the parsed flags once, in `validate_quantization_args`:
the typed settings, checked, resolved per site into `args.quant_config`, whose `label` names
the run (capture directories, run files, reports). The flags themselves stay as given.
`$CUSTOM_QUANT_TYPE` (the original system's variable) seeds --quant-scheme's default.
"""

from __future__ import annotations

from megatron.quantization.config import (
    QuantConfig, QuantSettings, SettingError, add_arguments)
from megatron.quantization import schedule
from megatron.quantization.schemes import resolve
from megatron.training.errors import ConfigError


def add_quantization_args(parser):
    group = parser.add_argument_group(title="simulated low-precision GEMMs")
    add_arguments(group)
    group.add_argument("--quant-stats-interval", type=int, default=0,
                       help="Every N iterations, measure each GEMM operand's quantization "
                            "(saturated %%, flushed %%, SQNR, relative error, amax, MX scale "
                            "exponents or HiFP8 region shares; amax alone for operands kept in "
                            "high precision), reduced over all ranks, and log it to TensorBoard "
                            "as quant/<site>/<gemm>.<operand>/<metric>, to W&B and as the worst "
                            "site in the log line. 0 (default): off.")
    group.add_argument("--quant-check", action="store_true",
                       help="Print the effective per-GEMM quantization configuration and exit.")
    return parser


def quant_config_from_args(args) -> QuantConfig:
    """The QuantConfig of parsed flags (SettingError for a setting or combination that cannot
    be used)."""
    quant = resolve(QuantSettings.from_args(args), args.num_layers, args.seed)
    _check_recompute(args, quant)
    return quant


def _check_recompute(args, quant: QuantConfig) -> None:
    """A recomputed forward would push a second amax into the delayed-scaling histories and
    draw new stochastic-rounding bits for forward operands: refuse those combinations."""
    if getattr(args, "recompute_granularity", None) is None and \
            not getattr(args, "recompute_activations", False):
        return
    configs = [quant.linear, quant.attn_qk, quant.attn_pv, quant.output_layer]
    if quant.rules is not None:
        configs += list(quant.rules.configs.values())
    for cfg in configs:
        if any(cfg.delayed(f) for f in cfg.formats):
            raise SettingError("delayed FP8 scaling with --recompute-* is not supported (the "
                               "recomputed forward would enter the amax history twice); use "
                               "--fp8-recipe tensorwise")
        if cfg.stochastic & {"fprop.a", "fprop.b"}:
            raise SettingError("stochastic rounding of forward operands with --recompute-* is "
                               "not supported (the recomputed forward would draw other bits); "
                               "use --quant-stochastic-rounding grad")


def validate_quantization_args(args):
    """Resolve the quantization flags (the scheme: flag, else $CUSTOM_QUANT_TYPE, else bf16)
    into args.quant_config."""
    if args.quant_stats_interval < 0:
        raise ConfigError(f"--quant-stats-interval {args.quant_stats_interval}: must be >= 0 "
                          "(0 = off, N = every N iterations)")
    try:
        args.quant_config = quant_config_from_args(args)
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    args.quant_schedule_switches = schedule_switches(args)


def schedule_switches(args):
    """--quant-schedule resolved against --train-iters (schedule.Switch list)."""
    entries = args.quant_config.settings.recipe.schedule
    if entries and not args.quant_config.enabled:
        raise ConfigError(f"--quant-schedule {' '.join(entries)}: this run quantizes nothing "
                          f"({args.quant_config.label}), so there is nothing to switch; give a "
                          "scheme, recipe or recipe file")
    try:
        return schedule.resolve(entries, args.train_iters)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
