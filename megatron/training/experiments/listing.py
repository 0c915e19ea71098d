"""Human-readable descriptions of the matrix: `train_config.py --list` and the launcher headers."""

from __future__ import annotations

from megatron.training import corpora
from megatron.training.experiments.commands import format_number
from megatron.training.experiments.matrix import (
    ALL_DATASETS, ALL_QUANT_SCHEMES, DATASET_DESCRIPTIONS, DATASETS, FA_QUANTIZATIONS, MODELS,
    QUANT_SCHEMES, TRAINING_CONFIG_DESCRIPTIONS, TRAINING_CONFIG_NAMES, ModelSpec,
    TrainingConfig)

# What each scheme prefix quantizes; {fmt} is the element format.
QUANT_SCHEME_DESCRIPTIONS = {
    "bf16": "nothing quantized (high-precision baseline)",
    "FA": "attention QK^T in {fmt}; PV stays high precision",
    "linear": "every linear layer of every transformer layer in {fmt}",
    "FA_linear": "attention QK^T and every linear layer in {fmt}",
}


# How the element formats of scheme names read.
FORMAT_TITLES = {"mxfp8": "MXFP8", "mxfp4": "MXFP4", "hifp8": "HiFP8", "nvfp4": "NVFP4",
                 "mxfp6_e2m3": "MXFP6 (E2M3)", "mxfp6_e3m2": "MXFP6 (E3M2)",
                 "fp8": "FP8 (format and scaling per --fp8-format, --fp8-recipe)"}
MATRIX_MARK = "[matrix]"


def describe_quant_scheme(quant_scheme: str) -> str:
    if quant_scheme == "bf16":
        return QUANT_SCHEME_DESCRIPTIONS["bf16"]
    # The longest prefix first: FA_linear_<fmt> before FA_<fmt>; formats may hold "_".
    for prefix in ("FA_linear", "linear", "FA"):
        if quant_scheme.startswith(prefix + "_"):
            fmt = quant_scheme[len(prefix) + 1:]
            return QUANT_SCHEME_DESCRIPTIONS[prefix].format(fmt=FORMAT_TITLES.get(fmt,
                                                                                  fmt.upper()))
    raise ValueError(f"not a scheme name: {quant_scheme!r}")


def describe_fa_quantization(name: str) -> str:
    quant_scheme, pv = FA_QUANTIZATIONS[name]
    if pv is None:
        return f"--quant-scheme {quant_scheme}" + \
            ("" if quant_scheme != "bf16" else " (nothing quantized)")
    return f"--quant-scheme {quant_scheme} --attn-pv-quant {pv}"


def describe_layout(spec: ModelSpec) -> str:
    """e.g. '8 ranks/node, TP2 PP1, SP, NCCL (GPU)'."""
    parts = [f"{spec.nproc_per_node} rank{'s' if spec.nproc_per_node > 1 else ''}/node"]
    if spec.target == "gpu":
        parts.append(f"TP{spec.tensor_parallel} PP{spec.pipeline_parallel}")
        if spec.expert_parallel > 1:
            parts.append(f"EP{spec.expert_parallel}")
        if spec.sequence_parallel:
            parts.append("SP")
    parts.append("gloo (CPU)" if spec.target == "cpu" else "NCCL (GPU)")
    return ", ".join(parts)


def describe_training_config(cfg: TrainingConfig) -> str:
    gbs = str(cfg.global_batch_size) if cfg.global_batch_size is not None else \
        f"{cfg.micro_batches} x {cfg.micro_batch_size} x DP"
    ckpt = f", checkpoint every {cfg.save_interval}" if cfg.checkpoints else ""
    return (f"{cfg.name:<9} seq {cfg.seq_length}, micro batch {cfg.micro_batch_size}, global "
            f"batch {gbs}, {cfg.train_iters} iterations, lr {format_number(cfg.lr)} "
            f"({cfg.lr_decay_style}, warm-up {cfg.lr_warmup_iters}){ckpt}")


def format_listing(fa: bool = False) -> str:
    """The text of `train_config.py --list` (or `flash_attention_config.py --list`)."""
    out = ["Models (--model):"]
    for spec in MODELS.values():
        alias = f" (also: {', '.join(spec.aliases)})" if spec.aliases else ""
        out.append(f"  {spec.name:<15} {spec.title}{alias}; preset {spec.preset}; "
                   f"{describe_layout(spec)}; launcher examples/llama/{spec.launcher}")
    out.append("")
    out.append("Datasets (--dataset):")
    for name in ALL_DATASETS:
        built = ""
        if name in DATASETS:
            built = " [built]" if corpora.dataset_is_built(name) else \
                f" [not built: python tools/build_corpus.py --dataset {name}]"
        out.append(f"  {name:<15} {DATASET_DESCRIPTIONS[name]}{built}")
    out.append("")
    if fa:
        out.append("Attention quantizations (--fa-quantization):")
        for name in FA_QUANTIZATIONS:
            out.append(f"  {name:<15} {describe_fa_quantization(name)}")
    else:
        out.append(f"Quantization schemes (--quant-scheme; {MATRIX_MARK}: the experiment "
                   f"matrix, what 'all' and the launchers run; {len(ALL_QUANT_SCHEMES)} in all):")
        width = max(len(name) for name in ALL_QUANT_SCHEMES)
        for quant_scheme in ALL_QUANT_SCHEMES:
            mark = MATRIX_MARK if quant_scheme in QUANT_SCHEMES else ""
            out.append(f"  {quant_scheme:<{width}} {mark:<{len(MATRIX_MARK)}} "
                       f"{describe_quant_scheme(quant_scheme)}")
    out.append("")
    out.append("Training configs (--training-config):")
    for name in TRAINING_CONFIG_NAMES:
        out.append(f"  {name:<15} {TRAINING_CONFIG_DESCRIPTIONS[name]}")
        for spec in MODELS.values():
            out.append(f"    {spec.name:<15} {describe_training_config(spec.training[name])}")
    return "\n".join(out)
