"""The experiment matrix: models, datasets, quantization schemes and training configs.

Everything here is plain data and name resolution, importable without torch or megatron.core,
so that listing the matrix (`train_config.py --list`) starts quickly and quietly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from megatron.training import corpora

LLAMA3_VOCAB_SIZE = 128256


class ExperimentError(ValueError):
    """An unknown name or an impossible combination, reported before anything runs."""


# ---------------------------------------------------------------------------------------------
# Quantization schemes
# ---------------------------------------------------------------------------------------------

# The names of megatron.quantization.schemes, spelled out here because importing that package
# loads torch (over a second of start-up) and the matrix only needs the names.
# tests/test_experiments.py checks that both spell the same names in the same order.
ELEMENT_FORMATS = ("mxfp8", "mxfp4", "hifp8")
QUANT_SCHEMES = ("bf16",) + tuple(
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in ELEMENT_FORMATS)
# The newer formats' schemes: accepted by name (the FP8 recipe as --fp8-* pass-through flags),
# not part of "all", so the matrix stays the original 3 x 2 x 10.
NEWER_FORMATS = ("nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8")
ALL_QUANT_SCHEMES = ("bf16",) + tuple(
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear")
    for fmt in ELEMENT_FORMATS + NEWER_FORMATS)


# ---------------------------------------------------------------------------------------------
# Training configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingConfig:
    """One training recipe of one model. Iteration counts are per run; batch sizes in samples.

    ``global_batch_size`` None means "one step = ``micro_batches`` micro-batches per
    data-parallel rank", so the config stays valid for any number of ranks.
    """

    name: str
    description: str
    seq_length: int
    micro_batch_size: int
    train_iters: int
    lr: float
    min_lr: float
    lr_warmup_iters: int
    global_batch_size: Optional[int] = None
    micro_batches: int = 1
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    log_interval: int = 1
    eval_interval: int = 1000
    eval_iters: int = 0
    save_interval: Optional[int] = None      # None: this config writes no checkpoints
    tensorboard: bool = False                # write TensorBoard scalars under the run dir
    num_workers: int = 2

    def global_batch(self, data_parallel_size: int) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.micro_batch_size * data_parallel_size * self.micro_batches

    @property
    def checkpoints(self) -> bool:
        return self.save_interval is not None


TRAINING_CONFIG_NAMES = ("fast", "standard")
TRAINING_CONFIG_DESCRIPTIONS = {
    "fast": "smoke test: a few iterations with a small batch and short sequences, no checkpoints",
    "standard": "the real pretraining recipe of the model (cosine schedule, AdamW, checkpoints); "
                "for the tiny CPU models a run sized for a 2-core machine",
}


def _cluster_fast(seq_length: int) -> TrainingConfig:
    return TrainingConfig(
        name="fast", description="20 iterations of 2 micro-batches per data-parallel rank",
        seq_length=seq_length,
        micro_batch_size=1, micro_batches=2, train_iters=20, lr=3e-4, min_lr=3e-5,
        lr_warmup_iters=2, log_interval=1, eval_interval=20, eval_iters=2, num_workers=2)


def _cluster_standard(seq_length: int, train_iters: int, warmup: int, tokens_note: str,
                      lr: float = 3e-4, min_lr: float = 3e-5) -> TrainingConfig:
    return TrainingConfig(
        name="standard", description=tokens_note,
        seq_length=seq_length, micro_batch_size=1, global_batch_size=512,
        train_iters=train_iters, lr=lr, min_lr=min_lr, lr_warmup_iters=warmup,
        log_interval=10, eval_interval=500, eval_iters=32, save_interval=1000, tensorboard=True,
        num_workers=2)


def _cpu_fast() -> TrainingConfig:
    return TrainingConfig(
        name="fast", description="10 iterations of 2 x 2 x 128 tokens", seq_length=128,
        micro_batch_size=2, micro_batches=2, train_iters=10, lr=1e-3, min_lr=1e-4,
        lr_warmup_iters=2, log_interval=1, eval_interval=10, eval_iters=1, num_workers=0)


def _cpu_standard() -> TrainingConfig:
    return TrainingConfig(
        name="standard",
        description="150 iterations of 4 x 256 tokens, sized for a 2-core CPU",
        seq_length=256, micro_batch_size=2, micro_batches=2, train_iters=150, lr=1e-3,
        min_lr=1e-4, lr_warmup_iters=15, log_interval=10, eval_interval=50, eval_iters=2,
        save_interval=50, tensorboard=True, num_workers=0)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model of the matrix: preset, where it runs, its parallel layout and its recipes."""

    name: str                              # matrix name (the original system's spelling)
    preset: str                            # megatron.training.presets name
    title: str
    target: str                            # "gpu" (NCCL cluster) or "cpu" (gloo)
    nproc_per_node: int                    # default ranks per node
    launcher: str                          # examples/llama/<launcher>
    training: Mapping[str, TrainingConfig]
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    mock_vocab_size: int = LLAMA3_VOCAB_SIZE
    extra_model_args: Tuple[str, ...] = ()
    aliases: Tuple[str, ...] = ()

    def data_parallel_size(self, world_size: int) -> int:
        return max(1, world_size // (self.tensor_parallel * self.pipeline_parallel))


def _configs(*configs: TrainingConfig) -> Mapping[str, TrainingConfig]:
    return OrderedDict((c.name, c) for c in configs)


MODELS: "OrderedDict[str, ModelSpec]" = OrderedDict((m.name, m) for m in (
    ModelSpec(
        name="llama31-8b", preset="llama31-8b", title="Llama 3.1 8B", target="gpu",
        nproc_per_node=8, launcher="train_llama31_8b.sh",
        # 8B in bf16 with simulated quantization: 2-way tensor parallelism with sequence
        # parallelism, data parallel over the rest, optimizer state sharded.
        tensor_parallel=2, sequence_parallel=True, distributed_optimizer=True,
        training=_configs(
            _cluster_fast(2048),
            _cluster_standard(8192, 38000, 2000,
                              "160B tokens (20 per parameter) at 512 x 8192 tokens per step"))),
    ModelSpec(
        name="llama32-1b", preset="llama32-1b", title="Llama 3.2 1B", target="gpu",
        nproc_per_node=8, launcher="train_llama32_1b.sh",
        distributed_optimizer=True,
        training=_configs(
            _cluster_fast(2048),
            _cluster_standard(8192, 6000, 500,
                              "25B tokens (20 per parameter) at 512 x 8192 tokens per step"))),
    ModelSpec(
        name="deepseek2_lite", preset="deepseek2-lite", title="DeepSeek-V2-Lite",
        target="gpu", nproc_per_node=8, launcher="train_deepseek2_lite.sh",
        # 64 routed experts spread over 8 expert-parallel ranks (Megatron-Bridge's layout).
        expert_parallel=8, distributed_optimizer=True,
        extra_model_args=("--moe-token-dispatcher-type", "alltoall"),
        aliases=("deepseek2-lite",),
        training=_configs(
            _cluster_fast(2048),
            _cluster_standard(4096, 23000, 2000,
                              "48B tokens (20 per active parameter) at 512 x 4096 tokens "
                              "per step"))),
    ModelSpec(
        name="llama-tiny", preset="llama-tiny", title="tiny Llama 3 (CPU)", target="cpu",
        nproc_per_node=1, launcher="train_tiny_cpu.sh", mock_vocab_size=8192,
        training=_configs(_cpu_fast(), _cpu_standard())),
    ModelSpec(
        name="deepseek-tiny", preset="deepseek-tiny", title="tiny DeepSeek-V2 (CPU)",
        target="cpu", nproc_per_node=1, launcher="train_tiny_cpu.sh", mock_vocab_size=8192,
        training=_configs(_cpu_fast(), _cpu_standard())),
))

# The original system's matrix: 3 models x 2 datasets x 10 schemes.
MATRIX_MODELS = ("llama31-8b", "llama32-1b", "deepseek2_lite")
TINY_MODELS = ("llama-tiny", "deepseek-tiny")


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

MOCK_DATASET = "mock"
DATASETS = corpora.EMBEDDED_DATASETS            # ("wikipedia", "dolma")
ALL_DATASETS = DATASETS + (MOCK_DATASET,)
DATASET_DESCRIPTIONS = dict(corpora.DATASET_DESCRIPTIONS)
DATASET_DESCRIPTIONS[MOCK_DATASET] = ("synthetic tokens (megatron.core MockGPTDataset) with "
                                      "NullTokenizer; needs nothing on disk")
DATA_SPLIT = "969,30,1"


# ---------------------------------------------------------------------------------------------
# Attention-only studies (flash_attention_config.py)
# ---------------------------------------------------------------------------------------------

# qk_<fmt>: attention QK^T in <fmt> (scheme FA_<fmt>); qk_pv_<fmt>: QK^T and PV in <fmt>.
FA_QUANTIZATIONS: "OrderedDict[str, Tuple[str, Optional[str]]]" = OrderedDict(
    [(f"qk_{fmt}", (f"FA_{fmt}", None)) for fmt in ELEMENT_FORMATS]
    + [(f"qk_pv_{fmt}", (f"FA_{fmt}", fmt)) for fmt in ELEMENT_FORMATS]
    + [("none", ("bf16", None))])


def fa_quantization(name: str) -> Tuple[str, Optional[str]]:
    """(quant scheme, --attn-pv-quant value or None) of an attention-only quantization name."""
    if name not in FA_QUANTIZATIONS:
        raise ExperimentError(f"unknown --fa-quantization {name!r}; valid: "
                              f"{', '.join(FA_QUANTIZATIONS)}")
    return FA_QUANTIZATIONS[name]


# ---------------------------------------------------------------------------------------------
# Name resolution
# ---------------------------------------------------------------------------------------------


def model_names(include_aliases: bool = False) -> List[str]:
    names = list(MODELS)
    if include_aliases:
        names += [a for m in MODELS.values() for a in m.aliases]
    return names


def resolve_model(name: str) -> ModelSpec:
    for spec in MODELS.values():
        if name == spec.name or name in spec.aliases:
            return spec
    raise ExperimentError(f"unknown model {name!r}; valid: {', '.join(model_names(True))}")


def resolve_dataset(name: str) -> str:
    if name not in ALL_DATASETS:
        raise ExperimentError(f"unknown dataset {name!r}; valid: {', '.join(ALL_DATASETS)}")
    return name


def resolve_quant_scheme(name: str) -> str:
    if name not in ALL_QUANT_SCHEMES:
        raise ExperimentError(f"unknown quantization scheme {name!r}; valid: "
                              f"{', '.join(ALL_QUANT_SCHEMES)}")
    return name


def resolve_training_config(model: ModelSpec, name: str) -> TrainingConfig:
    if name not in model.training:
        raise ExperimentError(f"unknown training config {name!r}; valid: "
                              f"{', '.join(model.training)}")
    return model.training[name]


# `train_config.py --names KIND`; the kinds are public names, kept as first released.
NAME_KINDS = ("models", "datasets", "schemes", "training-configs", "fa-quantizations",
              "element-formats")


def names(kind: str) -> List[str]:
    """Valid names of one kind (one of NAME_KINDS), for scripts."""
    table = {
        "models": lambda: model_names(include_aliases=True),
        "datasets": lambda: list(ALL_DATASETS),
        "schemes": lambda: list(QUANT_SCHEMES),
        "training-configs": lambda: list(TRAINING_CONFIG_NAMES),
        "fa-quantizations": lambda: list(FA_QUANTIZATIONS),
        "element-formats": lambda: list(ELEMENT_FORMATS),
    }
    if kind not in table:
        raise ExperimentError(f"unknown name kind {kind!r}; valid: {', '.join(table)}")
    return table[kind]()
