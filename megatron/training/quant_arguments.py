"""The simulated-GEMM flags and the `QuantConfig` built from them (`args.quant_config`).

`--quant-scheme` is the one name of the scheme inside the code; `$CUSTOM_QUANT_TYPE` (the
original system's variable) seeds its default.
"""

from __future__ import annotations

import argparse
import os

from megatron.quantization.formats import KERNEL_MODES
from megatron.quantization.gemm import FP8_RECIPES, RHT_BLOCKS, Fp8Settings
from megatron.quantization.recipes import RECIPE_NAMES, RECIPE_SOURCES, STOCHASTIC_ROUNDINGS
from megatron.quantization.schemes import (
    ATTENTION_IMPLS,
    ENV_SCHEME,
    FP8_FORMATS,
    GEMMS,
    GRAD_FORMATS,
    HIFP8_SCALINGS,
    OVERRIDE_FORMATS,
    SCHEMES,
    QuantConfig,
    RecipeSettings,
    SchemeError,
    build_quant_config,
    scheme_formats,
    scheme_from_env,
)
from megatron.training.errors import ConfigError


def add_quantization_args(parser):
    group = parser.add_argument_group(title="simulated low-precision GEMMs")
    group.add_argument("--quant-scheme", type=str, default=None, choices=SCHEMES,
                       help="Which GEMMs are simulated in low precision: bf16 (none), "
                            "FA_<fmt> (attention QK^T only; PV stays high precision unless "
                            "--attn-pv-quant is given), linear_<fmt> (every parallel linear "
                            "of every transformer layer), FA_linear_<fmt> (both), with fmt "
                            "mxfp8/mxfp4/hifp8 (the original ten schemes) or nvfp4, mxfp6_e2m3, "
                            "mxfp6_e3m2, fp8 (FP8 scaled per --fp8-format/--fp8-recipe). "
                            f"Default: ${ENV_SCHEME} if set, else bf16.")
    group.add_argument("--linear-quant", type=str, default=None, choices=OVERRIDE_FORMATS,
                       help="Override the element format of the linear layers ('none' = "
                            "high precision).")
    group.add_argument("--attn-qk-quant", type=str, default=None, choices=OVERRIDE_FORMATS,
                       help="Override the format of the attention QK^T GEMMs.")
    group.add_argument("--attn-pv-quant", type=str, default=None, choices=OVERRIDE_FORMATS,
                       help="Quantize the attention PV (probabilities x values) GEMMs in this "
                            "format (no scheme quantizes PV by itself).")
    group.add_argument("--quant-backward", action=argparse.BooleanOptionalAction, default=True,
                       help="Also quantize the backward GEMMs (dgrad and wgrad) of quantized "
                            "sites; --no-quant-backward keeps them in high precision.")
    for gemm, what in (("fprop", "the forward GEMM (X·W, Q·K^T, P·V)"),
                       ("dgrad", "the input-gradient GEMM (dY·W^T ...)"),
                       ("wgrad", "the weight-gradient GEMM (X^T·dY ...)")):
        group.add_argument(f"--quant-{gemm}", type=str, default=None, choices=OVERRIDE_FORMATS,
                           help=f"Format of {what} at every quantized site, overriding the "
                                "scheme for that GEMM ('none' = high precision, e.g. "
                                "--quant-wgrad none keeps weight gradients in bf16). Sites the "
                                "scheme keeps in high precision stay so.")
    group.add_argument("--hifp8-scaling", type=str, default="none", choices=HIFP8_SCALINGS,
                       help="Scaling of HiFP8 operands: none (the plain per-element cast) or "
                            "tensor (one power-of-two scale per operand from its current amax, "
                            "putting its largest magnitude in [8, 16), the 3-bit-mantissa "
                            "region; forward and backward).")
    group.add_argument("--mx-scale-mode", type=str, default="floor", choices=["floor", "rceil"],
                       help="MX shared-scale rule: floor (OCP spec: floor(log2 amax) - emax) or "
                            "rceil (NVIDIA recipe: ceil(log2(amax / max_normal))).")
    group.add_argument("--mx-grad-format", type=str, default="e4m3", choices=GRAD_FORMATS,
                       help="Element format of the gradient operands of MXFP8 GEMMs (E4M3 as "
                            "in NVIDIA's MXFP8 recipe, or E5M2).")
    group.add_argument("--quant-skip-layers", nargs="*", default=None,
                       help="Transformer layers kept in high precision: 1-based numbers, "
                            "ranges like 2-4, negative numbers from the end (e.g. 1 -1 keeps "
                            "the first and last layer in bf16).")
    group.add_argument("--quant-output-layer", action="store_true",
                       help="Also quantize the output (LM head) layer with the linear format.")
    group.add_argument("--quant-attention-impl", type=str, default="auto",
                       choices=ATTENTION_IMPLS,
                       help="Core attention: auto (default: the fused kernel when attention is "
                            "not quantized, exact linear-memory chunks when it is) or unfused "
                            "(megatron-core's full [b, heads, s, s] scores: the reference path, "
                            "O(s^2) memory; for checks and benchmarks).")
    group.add_argument("--quant-kernels", type=str, default=None, choices=KERNEL_MODES,
                       help="How fake quantization runs (bit for bit the same quantized "
                            "operands in every mode): auto (default: fused Triton kernels for "
                            "CUDA tensors where triton is installed and covers the call -- MX "
                            "formats, HiFP8, NVFP4; fp32/bf16 operands -- and the fused "
                            "quantized-attention kernels where they cover the attention "
                            "GEMMs' formats; eager PyTorch and the chunked attention "
                            "elsewhere), triton (the Triton kernels, an error for anything "
                            "they do not cover; on CPU tensors under TRITON_INTERPRET=1), "
                            "compile (torch.compile of the PyTorch code) or eager (plain "
                            "PyTorch).")
    group.add_argument("--quant-weight-cache", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="Keep each quantized linear weight's QDQ copy per GEMM axis until "
                            "the next optimizer step (every micro-batch and recomputed forward "
                            "reuses it; bit for bit the same numbers). Costs two copies of every "
                            "quantized weight (counted by the memory estimate); "
                            "--no-quant-weight-cache quantizes at every use.")
    group.add_argument("--quant-compile", action="store_true",
                       help="Same as --quant-kernels compile: run fake quantization through "
                            "torch.compile (fused kernels; results are bit for bit those of "
                            "eager mode).")
    group.add_argument("--quant-stats-interval", type=int, default=0,
                       help="Every N iterations, measure each GEMM operand's quantization "
                            "(saturated %%, flushed %%, SQNR, relative error, amax, MX scale "
                            "exponents or HiFP8 region shares; amax alone for operands kept in "
                            "high precision), reduced over all ranks, and log it to TensorBoard "
                            "as quant/<site>/<gemm>.<operand>/<metric>, to W&B and as the worst "
                            "site in the log line. 0 (default): off.")
    group.add_argument("--quant-recipe", type=str, default=None, choices=RECIPE_NAMES,
                       help="A published training recipe in one flag: " + "; ".join(
                           f"{name}: {text}" for name, text in RECIPE_SOURCES.items()
                       ).replace("%", "%%") + ". --first-last-layers-bf16 replaces the recipe's "
                       "BF16 layers.")
    group.add_argument("--quant-recipe-file", type=str, default=None, metavar="FILE",
                       help="A YAML/JSON recipe in megatron-core's RecipeConfig shape: named "
                            "configs (per GEMM format, stochastic rounding, Hadamard transform, "
                            "2-D weight tiles, scale rules) and ordered glob matchers over module "
                            "paths with global layer indices (decoder.layers.3.mlp.linear_fc1); "
                            "the first match decides a site's config, unmatched sites keep the "
                            "scheme's. See README 'Recipe files'.")
    group.add_argument("--quant-stochastic-rounding", type=str, default=None,
                       choices=STOCHASTIC_ROUNDINGS,
                       help="Stochastic rounding of the elements of quantized operands (MX, "
                            "NVFP4, FP8; scales as with round-to-nearest): none (default), grad "
                            "(the gradient operands dY of dgrad and wgrad, as the NVFP4 recipe) "
                            "or all. Draws are keyed by --seed, iteration, site and operand: "
                            "reproducible, also after resuming.")
    group.add_argument("--quant-rht", type=int, default=None, choices=(0,) + RHT_BLOCKS,
                       metavar="BLOCK",
                       help="Random Hadamard transform of block 16/32/64/128 (0: off, the "
                            "default) applied to both operands of the --quant-rht-gemms GEMMs of "
                            "quantized linear layers along their reduction axis before they are "
                            "quantized (the exact product is unchanged); one random sign vector "
                            "per run, from --seed.")
    group.add_argument("--quant-rht-gemms", nargs="+", default=None, choices=GEMMS,
                       metavar="GEMM",
                       help="GEMMs the Hadamard transform applies to (default: wgrad, as in "
                            "both FP4 papers).")
    group.add_argument("--quant-weight-2d", action=argparse.BooleanOptionalAction, default=None,
                       help="Quantize linear weights in 2-D tiles (NVFP4 16x16, FP8 blockwise "
                            "128x128), so the fprop and dgrad copies of a weight are the same "
                            "numbers. Default: on for the FP8 blockwise recipe, off otherwise "
                            "(the nvfp4 recipe sets it).")
    group.add_argument("--first-last-layers-bf16", action="store_true",
                       help="Keep the first --num-layers-at-start-in-bf16 and the last "
                            "--num-layers-at-end-in-bf16 transformer layers in high precision "
                            "(megatron-core's flag).")
    group.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                       help="Layers at the start kept in BF16 with --first-last-layers-bf16 "
                            "(default 1).")
    group.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                       help="Layers at the end kept in BF16 with --first-last-layers-bf16 "
                            "(default 1).")
    group.add_argument("--fp8-format", type=str, default=None, choices=FP8_FORMATS,
                       help="Simulate FP8 linear layers as megatron-core + TransformerEngine "
                            "would: e4m3 (every operand E4M3) or hybrid (E4M3 forward, E5M2 "
                            "gradients). Implies --quant-scheme linear_fp8 (linear_mxfp8 with "
                            "--fp8-recipe mxfp8) unless an *_fp8 scheme is given.")
    group.add_argument("--fp8-recipe", type=str, default=None,
                       choices=FP8_RECIPES[:2] + ("mxfp8",) + FP8_RECIPES[2:],
                       help="FP8 scaling: tensorwise (current scaling, per tensor), delayed "
                            "(per-tensor scale from an amax history; megatron's default), mxfp8 "
                            "(the MXFP8 path with the rceil scale rule), blockwise (1x128 tiles, "
                            "128x128 for weights).")
    group.add_argument("--fp8-margin", type=int, default=0,
                       help="Scaling margin: scale = (fp8_max * 2^-margin) / amax (default 0).")
    group.add_argument("--fp8-amax-history-len", type=int, default=1,
                       help="Delayed scaling: number of past amaxes kept per operand (default 1).")
    group.add_argument("--fp8-amax-compute-algo", type=str, default="most_recent",
                       choices=("most_recent", "max"),
                       help="Delayed scaling: the amax a scale uses, the latest in the history "
                            "or its maximum (default most_recent).")
    group.add_argument("--fp8-power-2-scales", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="Truncate FP8 scales to powers of two (default: on for blockwise, "
                            "as TransformerEngine's Float8BlockScaling, off otherwise).")
    group.add_argument("--quant-check", action="store_true",
                       help="Print the effective per-GEMM quantization configuration and exit.")
    return parser


def _fp8_scheme(args) -> str:
    """The scheme once Megatron's --fp8-* flags are applied (they imply linear_fp8, or
    linear_mxfp8 for --fp8-recipe mxfp8, and tune its MX flags); conflicts are errors."""
    scheme = args.quant_scheme
    formats = scheme_formats(scheme)           # (linear, attention QK^T)
    if args.fp8_format is None:
        if args.fp8_recipe is not None and "fp8" not in formats:
            raise SchemeError(f"--fp8-recipe {args.fp8_recipe} needs --fp8-format (or an *_fp8 "
                              f"scheme); scheme {scheme} has no FP8 site")
        return scheme
    wanted = "mxfp8" if args.fp8_recipe == "mxfp8" else "fp8"
    if scheme == "bf16":
        scheme = f"linear_{wanted}"
    elif formats[0] != wanted:
        suggestion = ("FA_linear_" if scheme.startswith("FA") else "linear_") + wanted
        raise SchemeError(f"--fp8-format {args.fp8_format} --fp8-recipe "
                          f"{args.fp8_recipe or 'delayed'} quantizes the linear layers in "
                          f"{wanted}, but --quant-scheme {scheme} puts them in {formats[0]}; "
                          f"use --quant-scheme {suggestion} or drop one")
    if wanted == "mxfp8":
        # TransformerEngine's MXFP8BlockScaling: the rceil scale rule; hybrid = E5M2 gradients.
        args.mx_scale_mode = "rceil"
        args.mx_grad_format = "e5m2" if args.fp8_format == "hybrid" else "e4m3"
    return scheme


def _recipe_settings(args) -> RecipeSettings:
    fp8_recipe = args.fp8_recipe if args.fp8_recipe not in (None, "mxfp8") else "delayed"
    pow2 = args.fp8_power_2_scales
    return RecipeSettings(
        stochastic_rounding=args.quant_stochastic_rounding, rht_block=args.quant_rht,
        rht_gemms=tuple(args.quant_rht_gemms) if args.quant_rht_gemms else None,
        weight_2d=args.quant_weight_2d, fp8_format=args.fp8_format,
        fp8=Fp8Settings(recipe=fp8_recipe, margin=args.fp8_margin,
                        pow2_scale=(fp8_recipe == "blockwise") if pow2 is None else pow2,
                        amax_history_len=args.fp8_amax_history_len,
                        amax_compute_algo=args.fp8_amax_compute_algo),
        recipe=args.quant_recipe, recipe_file=args.quant_recipe_file,
        bf16_layers=((args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16)
                     if args.first_last_layers_bf16 else None),
        seed=args.seed)


def quant_config_from_args(args) -> QuantConfig:
    if args.fp8_amax_history_len < 1:
        raise SchemeError(f"--fp8-amax-history-len {args.fp8_amax_history_len}: must be >= 1")
    scheme = _fp8_scheme(args)
    quant = build_quant_config(
        scheme=scheme, num_layers=args.num_layers, linear_quant=args.linear_quant,
        attn_qk_quant=args.attn_qk_quant, attn_pv_quant=args.attn_pv_quant,
        backward=args.quant_backward, scale_mode=args.mx_scale_mode,
        grad_format=args.mx_grad_format, skip_layers=args.quant_skip_layers or (),
        output_layer=args.quant_output_layer, attention_impl=args.quant_attention_impl,
        hifp8_scaling=args.hifp8_scaling,
        gemm_formats={"fprop": args.quant_fprop, "dgrad": args.quant_dgrad,
                      "wgrad": args.quant_wgrad},
        recipe_settings=_recipe_settings(args))
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
            raise SchemeError("delayed FP8 scaling with --recompute-* is not supported (the "
                              "recomputed forward would enter the amax history twice); use "
                              "--fp8-recipe tensorwise")
        if cfg.stochastic & {"fprop.a", "fprop.b"}:
            raise SchemeError("stochastic rounding of forward operands with --recompute-* is "
                              "not supported (the recomputed forward would draw other bits); "
                              "use --quant-stochastic-rounding grad")


def _resolve_kernel_mode(args) -> None:
    """args.quant_kernels from --quant-kernels / --quant-compile (its alias for compile);
    args.quant_compile says whether that mode is compile."""
    kernels = getattr(args, "quant_kernels", None)
    compiled = getattr(args, "quant_compile", False)
    if compiled and kernels not in (None, "compile"):
        raise ConfigError(f"--quant-compile is --quant-kernels compile; it contradicts "
                          f"--quant-kernels {kernels}")
    args.quant_kernels = kernels or ("compile" if compiled else "auto")
    args.quant_compile = args.quant_kernels == "compile"


def validate_quantization_args(args):
    """Resolve the scheme (flag, else $CUSTOM_QUANT_TYPE, else bf16) into args.quant_config."""
    _resolve_kernel_mode(args)
    if args.quant_stats_interval < 0:
        raise ConfigError(f"--quant-stats-interval {args.quant_stats_interval}: must be >= 0 "
                          "(0 = off, N = every N iterations)")
    try:
        if args.quant_scheme is None:
            args.quant_scheme = scheme_from_env()
            args.quant_scheme_source = ENV_SCHEME if os.environ.get(ENV_SCHEME) else "default"
        else:
            args.quant_scheme_source = "--quant-scheme"
        args.quant_config = quant_config_from_args(args)
    except SchemeError as exc:
        raise ConfigError(str(exc)) from None
    # The run's label (capture directories, run files, reports): the scheme the --fp8-* flags
    # imply, or the recipe's name.
    quant = args.quant_config
    if quant.scheme != args.quant_scheme:
        args.quant_scheme, args.quant_scheme_source = quant.scheme, "--fp8-format"
    if quant.recipe:
        args.quant_scheme, args.quant_scheme_source = f"recipe_{quant.recipe}", "--quant-recipe"
    elif quant.rules is not None:
        args.quant_scheme = ("recipe_file" if args.quant_scheme == "bf16"
                             else f"{args.quant_scheme}_recipe_file")
        args.quant_scheme_source += " and --quant-recipe-file"
