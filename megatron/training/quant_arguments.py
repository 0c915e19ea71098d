"""The simulated-GEMM flags and the `QuantConfig` built from them (`args.quant_config`).

`--quant-scheme` is the one name of the scheme inside the code; `$CUSTOM_QUANT_TYPE` (the
original system's variable) seeds its default.
"""

from __future__ import annotations

import argparse
import os

from megatron.quantization.schemes import (
    ATTENTION_IMPLS,
    ENV_SCHEME,
    GRAD_FORMATS,
    HIFP8_SCALINGS,
    OVERRIDE_FORMATS,
    SCHEMES,
    QuantConfig,
    SchemeError,
    build_quant_config,
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
                            f"mxfp8/mxfp4/hifp8. Default: ${ENV_SCHEME} if set, else bf16.")
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
    group.add_argument("--quant-compile", action="store_true",
                       help="Run fake quantization through torch.compile (fused kernels; "
                            "results are bit for bit those of eager mode).")
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
    return build_quant_config(
        scheme=args.quant_scheme, num_layers=args.num_layers, linear_quant=args.linear_quant,
        attn_qk_quant=args.attn_qk_quant, attn_pv_quant=args.attn_pv_quant,
        backward=args.quant_backward, scale_mode=args.mx_scale_mode,
        grad_format=args.mx_grad_format, skip_layers=args.quant_skip_layers or (),
        output_layer=args.quant_output_layer, attention_impl=args.quant_attention_impl,
        hifp8_scaling=args.hifp8_scaling,
        gemm_formats={"fprop": args.quant_fprop, "dgrad": args.quant_dgrad,
                      "wgrad": args.quant_wgrad})


def validate_quantization_args(args):
    """Resolve the scheme (flag, else $CUSTOM_QUANT_TYPE, else bf16) into args.quant_config."""
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
