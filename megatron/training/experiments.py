"""The experiment matrix: models x datasets x quantization schemes x training configs -> commands.

This module is the single source of truth for how an experiment is launched. Everything that
starts a training run reads it:

* ``train_config.py`` and ``flash_attention_config.py`` (print or run one command),
* the launchers in ``examples/llama/`` (generated from here, see ``write_launchers``),
* ``run_tensor_collection.sh`` / ``run_tensor_draw.sh`` (through ``train_config.py``).

An experiment is a model (an architecture preset plus its parallel layout and training
recipes), a dataset (an embedded corpus or synthetic mock data), a quantization scheme (one of
``megatron.quantization.schemes.SCHEMES``) and a training config (``fast`` or ``standard``).
``build_command`` turns it into an exact ``torchrun ... pretrain_gpt.py <flags>`` command whose
flags are grouped like the bash arrays of Megatron-LM's example scripts.

    python -m megatron.training.experiments --write-launchers   # regenerate examples/llama/
    python -m megatron.training.experiments --check-launchers   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import textwrap
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from megatron.quantization.schemes import ELEMENT_FORMATS, SCHEMES
from megatron.training import corpora
from megatron.training.presets import MODEL_PRESETS

REPO_ROOT = Path(__file__).resolve().parents[2]
PRETRAIN_SCRIPT = REPO_ROOT / "pretrain_gpt.py"
LAUNCHER_DIR = REPO_ROOT / "examples" / "llama"
DEFAULT_RUNS_DIR = "runs"
LLAMA3_VOCAB_SIZE = 128256


class ExperimentError(ValueError):
    """An unknown name or an impossible combination, reported before anything runs."""


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
    """(scheme, --attn-pv-quant value or None) of an attention-only quantization name."""
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


def resolve_scheme(name: str) -> str:
    if name not in SCHEMES:
        raise ExperimentError(f"unknown quantization scheme {name!r}; valid: {', '.join(SCHEMES)}")
    return name


def resolve_training_config(model: ModelSpec, name: str) -> TrainingConfig:
    if name not in model.training:
        raise ExperimentError(f"unknown training config {name!r}; valid: "
                              f"{', '.join(model.training)}")
    return model.training[name]


# ---------------------------------------------------------------------------------------------
# Experiments and commands
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    """Tensor-capture flags passed through to pretrain_gpt.py (None: pretrain_gpt's default)."""

    tensor_save_dir: Optional[str] = None
    control_iter: Optional[int] = None
    collect_micro_batches: Optional[int] = None


@dataclass(frozen=True)
class Experiment:
    """One cell of the matrix plus where it runs and writes."""

    model: str
    dataset: str
    scheme: str
    training_config: str = "standard"
    attn_pv_quant: Optional[str] = None
    nproc_per_node: Optional[int] = None       # None: the model's default
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    tokenizer_model: Optional[str] = None      # None: the built-in Llama 3 tokenizer
    data_root: Optional[str] = None            # None: corpora.DEFAULT_DATA_ROOT
    run_dir: Optional[str] = None              # None: runs/{model}/{dataset}/{scheme}/{config}
    checkpoint_dir: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    checkpoints: Optional[bool] = None         # None: as the training config says
    capture: Optional[Capture] = None
    extra_args: Tuple[str, ...] = ()

    @property
    def spec(self) -> ModelSpec:
        return resolve_model(self.model)

    @property
    def nproc(self) -> int:
        return self.nproc_per_node if self.nproc_per_node is not None else \
            self.spec.nproc_per_node

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def default_run_dir(self) -> str:
        variant = self.scheme if self.attn_pv_quant is None else \
            f"{self.scheme}_pv_{self.attn_pv_quant}"
        return os.path.join(DEFAULT_RUNS_DIR, self.spec.name, self.dataset, variant,
                            self.training_config)


@dataclass
class Command:
    """An exact launch: environment additions, the torchrun argv and its flag groups."""

    env: "OrderedDict[str, str]"
    launcher: List[str]                        # torchrun and its flags
    script: str                                # pretrain_gpt.py path
    groups: "OrderedDict[str, List[str]]"      # Megatron-style named flag groups
    experiment: Experiment
    makedirs: List[str] = field(default_factory=list)  # created before the run (--load needs it)

    @property
    def pretrain_args(self) -> List[str]:
        return [arg for group in self.groups.values() for arg in group]

    @property
    def argv(self) -> List[str]:
        return self.launcher + [self.script] + self.pretrain_args

    def shell(self, multiline: bool = False) -> str:
        """The command as one shell line (or one group per line with backslashes)."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        if not multiline:
            return " ".join(env + [shlex.quote(a) for a in self.argv])
        lines = [" ".join(env + [shlex.quote(a) for a in self.launcher + [self.script]])]
        lines += ["    " + " ".join(shlex.quote(a) for a in group)
                  for group in self.groups.values() if group]
        return " \\\n".join(lines)


def _fmt_number(value) -> str:
    """Numbers as Megatron scripts write them: 3e-4 -> 3e-4, 0.1 -> 0.1, 1.0 -> 1.0."""
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exponent = text.split("e")
            return f"{mantissa}e{int(exponent)}"
        return text
    return str(value)


def torchrun_args(exp: Experiment) -> List[str]:
    """torchrun flags: standalone rendezvous on one node, explicit master on several."""
    args = ["--nproc-per-node", str(exp.nproc)]
    if exp.nnodes == 1 and exp.master_addr is None and exp.master_port is None:
        return ["--standalone", "--nnodes", "1"] + args
    return args + ["--nnodes", str(exp.nnodes), "--node-rank", str(exp.node_rank),
                   "--master-addr", exp.master_addr or "localhost",
                   "--master-port", str(exp.master_port or 6000)]


def model_args(spec: ModelSpec) -> List[str]:
    return ["--model-preset", spec.preset, *spec.extra_model_args]


def training_args(cfg: TrainingConfig, spec: ModelSpec, world_size: int) -> List[str]:
    dp = spec.data_parallel_size(world_size)
    return [
        "--seq-length", str(cfg.seq_length),
        "--micro-batch-size", str(cfg.micro_batch_size),
        "--global-batch-size", str(cfg.global_batch(dp)),
        "--train-iters", str(cfg.train_iters),
        "--lr", _fmt_number(cfg.lr),
        "--min-lr", _fmt_number(cfg.min_lr),
        "--lr-decay-style", cfg.lr_decay_style,
        # Explicit, so a shorter run (--train-iters N after '--') follows the recipe's schedule.
        "--lr-decay-iters", str(cfg.train_iters),
        "--lr-warmup-iters", str(cfg.lr_warmup_iters),
        "--weight-decay", _fmt_number(cfg.weight_decay),
        "--adam-beta1", _fmt_number(cfg.adam_beta1),
        "--adam-beta2", _fmt_number(cfg.adam_beta2),
        "--clip-grad", _fmt_number(cfg.clip_grad),
    ]


def dtype_args(spec: ModelSpec) -> List[str]:
    return ["--bf16"]


def parallel_args(spec: ModelSpec) -> List[str]:
    args = ["--tensor-model-parallel-size", str(spec.tensor_parallel),
            "--pipeline-model-parallel-size", str(spec.pipeline_parallel)]
    if spec.expert_parallel > 1:
        args += ["--expert-model-parallel-size", str(spec.expert_parallel)]
    if spec.sequence_parallel:
        args.append("--sequence-parallel")
    if spec.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if spec.target == "cpu":
        args += ["--distributed-backend", "gloo"]   # GPU models: nccl, pretrain_gpt's default
    return args


def tokenizer_args(tokenizer_model: Optional[str]) -> List[str]:
    """Llama 3 tokenizer (built in, or a tokenizer.model); HuggingFace for tokenizer.json."""
    if tokenizer_model is None:
        return ["--tokenizer-type", "Llama3Tokenizer"]
    kind = "HuggingFaceTokenizer" if (tokenizer_model.endswith(".json")
                                      or os.path.isdir(tokenizer_model)) else "Llama3Tokenizer"
    return ["--tokenizer-type", kind, "--tokenizer-model", tokenizer_model]


def data_prefix(dataset: str, data_root: Optional[str] = None) -> str:
    return display_path(corpora.embedded_data_prefix(dataset, data_root))


def data_args(exp: Experiment, cfg: TrainingConfig) -> List[str]:
    spec = exp.spec
    if exp.dataset == MOCK_DATASET:
        args = ["--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", str(spec.mock_vocab_size)]
    else:
        args = ["--data-path", data_prefix(exp.dataset, exp.data_root), "--split", DATA_SPLIT]
        args += tokenizer_args(exp.tokenizer_model)
    return args + ["--num-workers", str(cfg.num_workers)]


def _paths(exp: Experiment, cfg: TrainingConfig) -> Tuple[Optional[str], Optional[str]]:
    """(checkpoint dir or None, tensorboard dir or None) of an experiment."""
    run_dir = exp.run_dir or exp.default_run_dir()
    checkpoints = cfg.checkpoints if exp.checkpoints is None else exp.checkpoints
    ckpt = (exp.checkpoint_dir or os.path.join(run_dir, "checkpoints")) if checkpoints else None
    tensorboard = exp.tensorboard_dir
    if tensorboard is None and cfg.tensorboard:
        tensorboard = os.path.join(run_dir, "tensorboard")
    return ckpt, tensorboard


def eval_and_logging_args(exp: Experiment, cfg: TrainingConfig) -> List[str]:
    args = ["--log-interval", str(cfg.log_interval),
            "--eval-interval", str(cfg.eval_interval),
            "--eval-iters", str(cfg.eval_iters)]
    ckpt, tensorboard = _paths(exp, cfg)
    if ckpt is not None:
        args += ["--save", ckpt, "--load", ckpt,
                 "--save-interval", str(cfg.save_interval or cfg.train_iters)]
    if tensorboard is not None:
        args += ["--tensorboard-dir", tensorboard]
    return args


def quant_args(exp: Experiment) -> List[str]:
    args = ["--quant-scheme", exp.scheme]
    if exp.attn_pv_quant is not None:
        args += ["--attn-pv-quant", exp.attn_pv_quant]
    return args


def capture_args(capture: Optional[Capture]) -> List[str]:
    if capture is None:
        return []
    args = ["--save-tensors"]
    if capture.tensor_save_dir is not None:
        args += ["--tensor-save-dir", capture.tensor_save_dir]
    if capture.control_iter is not None:
        args += ["--control-iter", str(capture.control_iter)]
    if capture.collect_micro_batches is not None:
        args += ["--collect-micro-batches", str(capture.collect_micro_batches)]
    return args


def check_experiment(exp: Experiment) -> TrainingConfig:
    """Resolve every name of `exp` (ExperimentError on a bad one) and return its config."""
    spec = resolve_model(exp.model)
    resolve_dataset(exp.dataset)
    resolve_scheme(exp.scheme)
    cfg = resolve_training_config(spec, exp.training_config)
    if exp.attn_pv_quant is not None and exp.attn_pv_quant not in ELEMENT_FORMATS:
        raise ExperimentError(f"unknown attention PV format {exp.attn_pv_quant!r}; valid: "
                              f"{', '.join(ELEMENT_FORMATS)}")
    for flag, value in (("--nproc-per-node", exp.nproc), ("--nnodes", exp.nnodes)):
        if value < 1:
            raise ExperimentError(f"{flag} {value} must be >= 1")
    model_parallel = spec.tensor_parallel * spec.pipeline_parallel
    if exp.world_size % model_parallel:
        raise ExperimentError(
            f"{spec.name} uses tensor x pipeline parallel size {model_parallel}: "
            f"--nproc-per-node x --nnodes ({exp.world_size}) must be a multiple of it")
    dp = spec.data_parallel_size(exp.world_size)
    if spec.expert_parallel > 1 and (dp * spec.tensor_parallel) % spec.expert_parallel:
        raise ExperimentError(
            f"{spec.name} uses expert parallel size {spec.expert_parallel}: "
            f"--nproc-per-node x --nnodes ({exp.world_size}) must be a multiple of it")
    if cfg.global_batch_size is not None and \
            cfg.global_batch_size % (cfg.micro_batch_size * dp):
        raise ExperimentError(
            f"training config {cfg.name!r} of {spec.name} has global batch "
            f"{cfg.global_batch_size}, not a multiple of micro batch {cfg.micro_batch_size} x "
            f"data-parallel size {dp}; choose another --nproc-per-node")
    return cfg


def build_command(exp: Experiment) -> Command:
    """The exact launch of `exp`. Names are checked; paths are not (see `missing_inputs`)."""
    cfg = check_experiment(exp)
    spec = exp.spec
    exp = replace(exp, model=spec.name)
    env: "OrderedDict[str, str]" = OrderedDict()
    if spec.target == "gpu":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    elif exp.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"     # ranks share the cores; one thread each
    groups: "OrderedDict[str, List[str]]" = OrderedDict([
        ("MODEL_ARGS", model_args(spec)),
        ("TRAINING_ARGS", training_args(cfg, spec, exp.world_size)),
        ("DTYPE_ARGS", dtype_args(spec)),
        ("MODEL_PARALLEL_ARGS", parallel_args(spec)),
        ("DATA_ARGS_LIST", data_args(exp, cfg)),
        ("EVAL_AND_LOGGING_ARGS", eval_and_logging_args(exp, cfg)),
        ("QUANT_ARGS", quant_args(exp)),
        ("TENSOR_CAPTURE_ARGS", capture_args(exp.capture)),
        ("EXTRA_ARGS", list(exp.extra_args)),
    ])
    ckpt, _ = _paths(exp, cfg)
    return Command(env=env, launcher=["torchrun", *torchrun_args(exp)],
                   script=_script_path(), groups=groups, experiment=exp,
                   makedirs=[ckpt] if ckpt else [])


def display_path(path: os.PathLike) -> str:
    """`path` relative to the working directory when it lies inside it, else absolute."""
    path = os.path.abspath(path)
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel == ".." or rel.startswith(".." + os.sep) else rel


def _script_path() -> str:
    return display_path(PRETRAIN_SCRIPT)


def missing_inputs(exp: Experiment) -> List[str]:
    """What the run needs on disk and is not there, each as one line with the fix."""
    problems = []
    if exp.dataset in DATASETS and not corpora.dataset_is_built(exp.dataset, exp.data_root):
        prefix = data_prefix(exp.dataset, exp.data_root)
        problems.append(f"dataset {exp.dataset!r} is not built ({prefix}.bin/.idx missing); "
                        f"build it with: python tools/build_corpus.py --dataset {exp.dataset}")
    if exp.tokenizer_model is not None and exp.dataset != MOCK_DATASET and \
            not os.path.exists(exp.tokenizer_model):
        problems.append(f"tokenizer {exp.tokenizer_model!r} not found; pass an existing "
                        "tokenizer.model / tokenizer.json or omit it for the built-in Llama 3 "
                        "tokenizer")
    return problems


def resolve_torchrun() -> List[str]:
    """How to start torchrun from this interpreter: its torchrun script, PATH, or -m."""
    beside = Path(sys.executable).parent / "torchrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        on_path = shutil.which("torchrun")
        if on_path and Path(on_path).resolve() == beside.resolve():
            return ["torchrun"]
        return [str(beside)]
    if shutil.which("torchrun"):
        return ["torchrun"]
    return [sys.executable, "-m", "torch.distributed.run"]


def matrix(models: Sequence[str] = MATRIX_MODELS, datasets: Sequence[str] = DATASETS,
           schemes: Sequence[str] = SCHEMES,
           training_configs: Sequence[str] = TRAINING_CONFIG_NAMES) -> List[Experiment]:
    """Every experiment of the given names (default: the 3 x 2 x 10 x 2 matrix)."""
    return [Experiment(model=m, dataset=d, scheme=s, training_config=c)
            for m in models for d in datasets for s in schemes for c in training_configs]


# ---------------------------------------------------------------------------------------------
# Listing
# ---------------------------------------------------------------------------------------------


def names(kind: str) -> List[str]:
    """Valid names of one kind, for scripts: models, datasets, schemes, training-configs,
    fa-quantizations."""
    table = {
        "models": lambda: model_names(include_aliases=True),
        "datasets": lambda: list(ALL_DATASETS),
        "schemes": lambda: list(SCHEMES),
        "training-configs": lambda: list(TRAINING_CONFIG_NAMES),
        "fa-quantizations": lambda: list(FA_QUANTIZATIONS),
        "element-formats": lambda: list(ELEMENT_FORMATS),
    }
    if kind not in table:
        raise ExperimentError(f"unknown name kind {kind!r}; valid: {', '.join(table)}")
    return table[kind]()


NAME_KINDS = ("models", "datasets", "schemes", "training-configs", "fa-quantizations",
              "element-formats")

SCHEME_DESCRIPTIONS = {
    "bf16": "nothing quantized (high-precision baseline)",
    "FA": "attention QK^T in {fmt} (PV stays high precision)",
    "linear": "every linear layer of every transformer layer in {fmt}",
    "FA_linear": "attention QK^T and every linear layer in {fmt}",
}


def describe_scheme(scheme: str) -> str:
    if scheme == "bf16":
        return SCHEME_DESCRIPTIONS["bf16"]
    prefix, fmt = scheme.rsplit("_", 1)
    return SCHEME_DESCRIPTIONS[prefix].format(fmt=fmt.upper())


def describe_fa_quantization(name: str) -> str:
    scheme, pv = FA_QUANTIZATIONS[name]
    if pv is None:
        return f"--quant-scheme {scheme}" + ("" if scheme != "bf16" else " (nothing quantized)")
    return f"--quant-scheme {scheme} --attn-pv-quant {pv}"


def _layout(spec: ModelSpec) -> str:
    parts = [f"{spec.nproc_per_node} rank{'s' if spec.nproc_per_node > 1 else ''}/node"]
    if spec.target == "gpu":
        parts.append(f"TP{spec.tensor_parallel} PP{spec.pipeline_parallel}")
        if spec.expert_parallel > 1:
            parts.append(f"EP{spec.expert_parallel}")
        if spec.sequence_parallel:
            parts.append("SP")
    parts.append("gloo (CPU)" if spec.target == "cpu" else "NCCL (GPU)")
    return ", ".join(parts)


def _config_line(cfg: TrainingConfig, spec: ModelSpec) -> str:
    gbs = str(cfg.global_batch_size) if cfg.global_batch_size is not None else \
        f"{cfg.micro_batches} x {cfg.micro_batch_size} x DP"
    ckpt = f", checkpoint every {cfg.save_interval}" if cfg.checkpoints else ""
    return (f"{cfg.name:<9} seq {cfg.seq_length}, micro batch {cfg.micro_batch_size}, global "
            f"batch {gbs}, {cfg.train_iters} iterations, lr {_fmt_number(cfg.lr)} "
            f"({cfg.lr_decay_style}, warm-up {cfg.lr_warmup_iters}){ckpt}")


def format_listing(fa: bool = False) -> str:
    """The text of `train_config.py --list` (or `flash_attention_config.py --list`)."""
    out = ["Models (--model):"]
    for spec in MODELS.values():
        alias = f" (also: {', '.join(spec.aliases)})" if spec.aliases else ""
        out.append(f"  {spec.name:<15} {spec.title}{alias}; preset {spec.preset}; "
                   f"{_layout(spec)}; launcher examples/llama/{spec.launcher}")
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
        out.append("Quantization schemes (--quantization):")
        for scheme in SCHEMES:
            out.append(f"  {scheme:<15} {describe_scheme(scheme)}")
    out.append("")
    out.append("Training configs (--training-config):")
    for name in TRAINING_CONFIG_NAMES:
        out.append(f"  {name:<15} {TRAINING_CONFIG_DESCRIPTIONS[name]}")
        for spec in MODELS.values():
            out.append(f"    {spec.name:<15} {_config_line(spec.training[name], spec)}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Launchers (examples/llama/), generated
# ---------------------------------------------------------------------------------------------


def _flag_actions():
    from megatron.training.arguments import build_parser

    return {a.dest: a for a in build_parser()._actions if a.option_strings}


def _list_expression(values: Sequence[int]) -> str:
    """[0, 1, 1, 1] -> '([0]+[1]*3)' (the --moe-layer-freq form Megatron-LM scripts use)."""
    runs: List[List[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]" if n == 1 else f"[{v}]*{n}" for v, n in runs) + ")"


def preset_flags(preset: str, skip: Sequence[str] = ("seq_length",)) -> List[str]:
    """The explicit Megatron-LM flags equivalent to `--model-preset preset`."""
    actions = _flag_actions()
    order = {dest: i for i, dest in enumerate(actions)}
    flags: List[str] = []
    for dest, value in sorted(MODEL_PRESETS[preset].items(), key=lambda kv: order[kv[0]]):
        if dest in skip:
            continue
        action = actions[dest]
        option = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                flags.append(option)
        elif isinstance(action, argparse._StoreFalseAction):
            if not value:
                flags.append(option)
        elif value is None:
            if action.default is not None:
                raise ExperimentError(f"preset {preset}: {dest}=None has no flag form")
        elif isinstance(value, list):
            flags += [option, _list_expression(value)]
        else:
            flags += [option, _fmt_number(value)]
    return flags


def _bash_array(name: str, args: Sequence[str], indent: str = "") -> str:
    """`NAME=(\n    --flag value\n)` with one flag (and its values) per line."""
    lines, current = [], []
    for arg in args:
        if arg.startswith("--") and current:
            lines.append(current)
            current = []
        current.append(arg if arg.startswith("${") or arg.startswith('"$') else shlex.quote(arg))
    if current:
        lines.append(current)
    body = "".join(f"{indent}    {' '.join(line)}\n" for line in lines)
    return f"{indent}{name}=(\n{body}{indent})"


def _generated_header(title: str) -> str:
    return (f"#!/bin/bash\n"
            f"# {title}\n"
            f"#\n"
            f"# GENERATED from megatron/training/experiments.py (the experiment matrix) by\n"
            f"#   python -m megatron.training.experiments --write-launchers\n"
            f"# Edit experiments.py and regenerate; tests/test_experiments.py checks that this "
            f"file is in sync.")


_SCHEME_CASE = "|".join(SCHEMES)

_COMMON_POSITIONAL = r'''
usage() {
    sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}
if [[ $# -ge 1 && ( $1 == -h || $1 == --help ) ]]; then
    usage
    exit 0
fi

# Positional arguments stop at the first flag; everything from there goes to pretrain_gpt.py.
POSITIONAL=()
while [[ $# -gt 0 && ${#POSITIONAL[@]} -lt 5 && $1 != -* ]]; do
    POSITIONAL+=("$1")
    shift
done
EXTRA_ARGS=("$@")
if [[ ${#POSITIONAL[@]} -lt 2 ]]; then
    echo "error: CHECKPOINT_PATH and TENSORBOARD_LOGS_PATH are required (see --help)" >&2
    exit 2
fi
CHECKPOINT_PATH=${POSITIONAL[0]}
TENSORBOARD_LOGS_PATH=${POSITIONAL[1]}
TOKENIZER_ARG=${POSITIONAL[2]:-DEFAULT}
DATA_ARG=${POSITIONAL[3]:-MOCK}
QUANT_SCHEME=${POSITIONAL[4]:-bf16}

case "${QUANT_SCHEME}" in
    @SCHEMES@) ;;
    *)
        echo "error: unknown QUANT_SCHEME '${QUANT_SCHEME}'; valid: @SCHEME_LIST@" >&2
        exit 2
        ;;
esac

if [[ ${TOKENIZER_ARG} == DEFAULT ]]; then
    TOKENIZER_ARGS=(--tokenizer-type Llama3Tokenizer)
elif [[ ${TOKENIZER_ARG} == *.json || -d ${TOKENIZER_ARG} ]]; then
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_ARG}")
else
    TOKENIZER_ARGS=(--tokenizer-type Llama3Tokenizer --tokenizer-model "${TOKENIZER_ARG}")
fi

DATA_ROOT=${DATA_ROOT:-${REPO_ROOT}/@DATA_ROOT_REL@}
case "${DATA_ARG}" in
    MOCK)
        DATA_ARGS_LIST=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${MOCK_VOCAB_SIZE}")
        ;;
@DATASET_CASES@
    *)
        DATA_ARGS_LIST=(--data-path "${DATA_ARG}" --split @SPLIT@ "${TOKENIZER_ARGS[@]}")
        ;;
esac
'''


def _dataset_cases() -> str:
    root = Path(corpora.DEFAULT_DATA_ROOT)
    cases = []
    for name in DATASETS:
        rel = Path(corpora.embedded_data_prefix(name)).relative_to(root)
        cases.append(f"    {name})\n"
                     f"        DATA_ARGS_LIST=(--data-path \"${{DATA_ROOT}}/{rel}\" --split "
                     f"{DATA_SPLIT} \"${{TOKENIZER_ARGS[@]}}\")\n"
                     f"        ;;")
    return "\n".join(cases)


def _positional_block() -> str:
    rel_root = os.path.relpath(corpora.DEFAULT_DATA_ROOT, REPO_ROOT)
    return (_COMMON_POSITIONAL
            .replace("@SCHEMES@", _SCHEME_CASE)
            .replace("@SCHEME_LIST@", ", ".join(SCHEMES))
            .replace("@DATA_ROOT_REL@", rel_root)
            .replace("@DATASET_CASES@", _dataset_cases())
            .replace("@SPLIT@", DATA_SPLIT))


_USAGE = """#
# Usage:
#   bash examples/llama/{launcher} CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \\
#       [TOKENIZER_ARG] [DATA_ARG] [QUANT_SCHEME] [pretrain_gpt.py flags ...]
#
#   CHECKPOINT_PATH        --save/--load directory (created if missing)
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir
#   TOKENIZER_ARG          DEFAULT (the Llama 3 tokenizer of the llama-models package), a Llama 3
#                          tokenizer.model, or a HuggingFace tokenizer.json (or its directory)
#   DATA_ARG               MOCK (synthetic data, NullTokenizer with {mock_vocab} ids; the
#                          default), {datasets} (the embedded datasets built by
#                          tools/build_corpus.py under $DATA_ROOT, default data/), or a
#                          --data-path prefix of PREFIX.bin/PREFIX.idx
#   QUANT_SCHEME           bf16 (default) or one of
#                          {schemes}
#   Flags after the positional arguments go to pretrain_gpt.py and override the ones below
#   (e.g. --train-iters 100, or --save-tensors --control-iter 1 --tensor-save-dir DIR)."""


def _usage(spec: ModelSpec, launcher: str) -> str:
    others = [s for s in SCHEMES if s != "bf16"]
    wrapped = textwrap.wrap(", ".join(others), width=70)
    schemes = ("\n#" + " " * 26).join(wrapped)
    return _USAGE.format(launcher=launcher, mock_vocab=spec.mock_vocab_size,
                         datasets="/".join(DATASETS), schemes=schemes)


def _recipe_comment(name: str, cfg: TrainingConfig) -> str:
    return (f"#\n# Recipe: the {cfg.name!r} training config of {name}: {cfg.description}.\n"
            f"# The 'fast' config and every other cell of the matrix: python train_config.py "
            f"--list\n")


def render_cluster_launcher(spec: ModelSpec) -> str:
    cfg = spec.training["standard"]
    world = spec.nproc_per_node
    dp_note = spec.data_parallel_size(world)
    header = _generated_header(f"Pretrain {spec.title} (preset {spec.preset}) on a GPU cluster "
                               f"with simulated low-precision GEMMs.")
    env_doc = (f"#\n# Environment: GPUS_PER_NODE ({spec.nproc_per_node}), NNODES (1), NODE_RANK "
               f"(0), MASTER_ADDR (localhost),\n#   MASTER_PORT (6000), DATA_ROOT (data/); "
               f"DRY_RUN=1 prints the command instead of running it.\n"
               f"# Default layout: {_layout(spec)}; data parallel {dp_note} on one node.")
    training = training_args(cfg, spec, world)
    eval_args = ["--log-interval", str(cfg.log_interval), "--eval-interval",
                 str(cfg.eval_interval), "--eval-iters", str(cfg.eval_iters),
                 "--save-interval", str(cfg.save_interval),
                 "--save", '"${CHECKPOINT_PATH}"', "--load", '"${CHECKPOINT_PATH}"',
                 "--tensorboard-dir", '"${TENSORBOARD_LOGS_PATH}"']
    parts = [
        header,
        _usage(spec, spec.launcher),
        env_doc,
        _recipe_comment(spec.name, cfg),
        "set -euo pipefail\n",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1\n",
        'SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)',
        'REPO_ROOT=$(cd "${SCRIPT_DIR}/../.." && pwd)',
        'PRETRAIN_SCRIPT_PATH="${REPO_ROOT}/pretrain_gpt.py"',
        f"MOCK_VOCAB_SIZE={spec.mock_vocab_size}",
        "",
        f"GPUS_PER_NODE=${{GPUS_PER_NODE:-{spec.nproc_per_node}}}",
        "NUM_NODES=${NNODES:-1}",
        "NODE_RANK=${NODE_RANK:-0}",
        "MASTER_ADDR=${MASTER_ADDR:-localhost}",
        "MASTER_PORT=${MASTER_PORT:-6000}",
        _positional_block(),
        _bash_array("DISTRIBUTED_ARGS", [
            "--nproc-per-node", '"${GPUS_PER_NODE}"', "--nnodes", '"${NUM_NODES}"',
            "--node-rank", '"${NODE_RANK}"', "--master-addr", '"${MASTER_ADDR}"',
            "--master-port", '"${MASTER_PORT}"']),
        "",
        _bash_array("MODEL_ARGS", preset_flags(spec.preset) + list(spec.extra_model_args)),
        "",
        _bash_array("TRAINING_ARGS", training),
        "",
        _bash_array("DTYPE_ARGS", dtype_args(spec)),
        "",
        _bash_array("MODEL_PARALLEL_ARGS", parallel_args(spec)),
        "",
        _bash_array("DATA_LOADER_ARGS", ["--num-workers", str(cfg.num_workers)]),
        "",
        _bash_array("EVAL_AND_LOGGING_ARGS", eval_args),
        "",
        _bash_array("QUANT_ARGS", ["--quant-scheme", '"${QUANT_SCHEME}"']),
        "",
        'if [[ ! -f ${PRETRAIN_SCRIPT_PATH} ]]; then\n'
        '    echo "error: ${PRETRAIN_SCRIPT_PATH} not found" >&2\n'
        '    exit 1\n'
        'fi',
        "",
        "CMD=(\n"
        "    torchrun \"${DISTRIBUTED_ARGS[@]}\" \"${PRETRAIN_SCRIPT_PATH}\"\n"
        "    \"${MODEL_ARGS[@]}\" \"${TRAINING_ARGS[@]}\" \"${DTYPE_ARGS[@]}\"\n"
        "    \"${MODEL_PARALLEL_ARGS[@]}\" \"${DATA_ARGS_LIST[@]}\" \"${DATA_LOADER_ARGS[@]}\"\n"
        "    \"${EVAL_AND_LOGGING_ARGS[@]}\" \"${QUANT_ARGS[@]}\" \"${EXTRA_ARGS[@]}\"\n"
        ")",
        "if [[ ${DRY_RUN:-0} == 1 ]]; then\n"
        "    printf '%q ' \"${CMD[@]}\"\n"
        "    echo\n"
        "    exit 0\n"
        "fi",
        'mkdir -p "${CHECKPOINT_PATH}" "${TENSORBOARD_LOGS_PATH}"',
        'exec "${CMD[@]}"',
    ]
    return "\n".join(parts) + "\n"


def render_cpu_launcher(specs: Sequence[ModelSpec]) -> str:
    launcher = specs[0].launcher
    names_ = [s.name for s in specs]
    header = _generated_header("Pretrain a tiny model (" + ", ".join(names_) + ") on the CPU "
                               "with simulated low-precision GEMMs.")
    env_doc = ("#\n# Environment: MODEL (" + names_[0] + "; or " + ", ".join(names_[1:]) +
               "), NPROC (1: one process; N > 1: torchrun\n"
               "#   with N gloo ranks and OMP_NUM_THREADS=1 each), PYTHON (the repository's "
               ".venv if present),\n#   DATA_ROOT (data/); DRY_RUN=1 prints the command "
               "instead of running it.\n")
    cfg0 = specs[0].training["standard"]
    model_cases = []
    for spec in specs:
        flags = preset_flags(spec.preset) + list(spec.extra_model_args)
        model_cases.append(f"    {spec.name})\n"
                           f"{_bash_array('MODEL_ARGS', flags, indent='        ')}\n"
                           f"        ;;")
    for spec in specs[1:]:
        if spec.training["standard"] != cfg0 or spec.mock_vocab_size != specs[0].mock_vocab_size:
            raise ExperimentError("the CPU launcher assumes one recipe for all tiny models")
    eval_args = ["--log-interval", str(cfg0.log_interval), "--eval-interval",
                 str(cfg0.eval_interval), "--eval-iters", str(cfg0.eval_iters),
                 "--save-interval", str(cfg0.save_interval),
                 "--save", '"${CHECKPOINT_PATH}"', "--load", '"${CHECKPOINT_PATH}"',
                 "--tensorboard-dir", '"${TENSORBOARD_LOGS_PATH}"']
    parts = [
        header,
        _usage(specs[0], launcher),
        env_doc,
        _recipe_comment("the tiny models", cfg0),
        "set -euo pipefail\n",
        'SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)',
        'REPO_ROOT=$(cd "${SCRIPT_DIR}/../.." && pwd)',
        'PRETRAIN_SCRIPT_PATH="${REPO_ROOT}/pretrain_gpt.py"',
        f"MOCK_VOCAB_SIZE={specs[0].mock_vocab_size}",
        "",
        f"MODEL=${{MODEL:-{names_[0]}}}",
        "NPROC=${NPROC:-1}",
        'if [[ -z ${PYTHON:-} ]]; then\n'
        '    if [[ -x ${REPO_ROOT}/.venv/bin/python ]]; then PYTHON=${REPO_ROOT}/.venv/bin/python; '
        'else PYTHON=python3; fi\n'
        'fi',
        'if ! [[ ${NPROC} =~ ^[1-9][0-9]*$ ]]; then\n'
        '    echo "error: NPROC=${NPROC} is not a positive integer" >&2\n'
        '    exit 2\n'
        'fi',
        _positional_block(),
        'case "${MODEL}" in',
        "\n".join(model_cases),
        "    *)\n"
        f"        echo \"error: unknown MODEL '${{MODEL}}'; valid: {', '.join(names_)}\" >&2\n"
        "        exit 2\n"
        "        ;;",
        "esac",
        "",
        _bash_array("TRAINING_ARGS", training_args(cfg0, specs[0], 1)),
        "",
        _bash_array("DTYPE_ARGS", dtype_args(specs[0])),
        "",
        _bash_array("MODEL_PARALLEL_ARGS", parallel_args(specs[0])),
        "",
        _bash_array("DATA_LOADER_ARGS", ["--num-workers", str(cfg0.num_workers)]),
        "",
        _bash_array("EVAL_AND_LOGGING_ARGS", eval_args),
        "",
        _bash_array("QUANT_ARGS", ["--quant-scheme", '"${QUANT_SCHEME}"']),
        "",
        "# One process runs pretrain_gpt.py directly; several share the cores through torchrun.",
        'if [[ ${NPROC} -eq 1 ]]; then\n'
        '    LAUNCH=("${PYTHON}")\n'
        'else\n'
        '    export OMP_NUM_THREADS=1\n'
        '    LAUNCH=("${PYTHON}" -m torch.distributed.run --standalone --nnodes 1 '
        '--nproc-per-node "${NPROC}")\n'
        'fi',
        "",
        "CMD=(\n"
        "    \"${LAUNCH[@]}\" \"${PRETRAIN_SCRIPT_PATH}\"\n"
        "    \"${MODEL_ARGS[@]}\" \"${TRAINING_ARGS[@]}\" \"${DTYPE_ARGS[@]}\"\n"
        "    \"${MODEL_PARALLEL_ARGS[@]}\" \"${DATA_ARGS_LIST[@]}\" \"${DATA_LOADER_ARGS[@]}\"\n"
        "    \"${EVAL_AND_LOGGING_ARGS[@]}\" \"${QUANT_ARGS[@]}\" \"${EXTRA_ARGS[@]}\"\n"
        ")",
        "if [[ ${DRY_RUN:-0} == 1 ]]; then\n"
        "    printf '%q ' \"${CMD[@]}\"\n"
        "    echo\n"
        "    exit 0\n"
        "fi",
        'mkdir -p "${CHECKPOINT_PATH}" "${TENSORBOARD_LOGS_PATH}"',
        'exec "${CMD[@]}"',
    ]
    return "\n".join(parts) + "\n"


def render_launchers() -> "OrderedDict[str, str]":
    """File name -> text of every generated launcher in examples/llama/."""
    out: "OrderedDict[str, str]" = OrderedDict()
    cpu_groups: "OrderedDict[str, List[ModelSpec]]" = OrderedDict()
    for spec in MODELS.values():
        if spec.target == "gpu":
            out[spec.launcher] = render_cluster_launcher(spec)
        else:
            cpu_groups.setdefault(spec.launcher, []).append(spec)
    for launcher, specs in cpu_groups.items():
        out[launcher] = render_cpu_launcher(specs)
    return out


def write_launchers(directory: Path = LAUNCHER_DIR) -> List[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_launchers().items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)
        written.append(path)
    return written


def stale_launchers(directory: Path = LAUNCHER_DIR) -> List[str]:
    """Generated launchers whose file is missing or differs from what this module renders."""
    stale = []
    for name, text in render_launchers().items():
        path = directory / name
        if not path.is_file() or path.read_text() != text:
            stale.append(str(path))
    return stale


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="The experiment matrix. Regenerate or check the examples/llama launchers.",
        allow_abbrev=False)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-launchers", action="store_true",
                        help="Write the generated launchers into examples/llama/.")
    action.add_argument("--check-launchers", action="store_true",
                        help="Exit 1 if a generated launcher is missing or out of date.")
    args = parser.parse_args(argv)
    if args.write_launchers:
        for path in write_launchers():
            print(f"wrote {os.path.relpath(path)}")
        return 0
    stale = stale_launchers()
    for path in stale:
        print(f"out of date: {path} (run python -m megatron.training.experiments "
              "--write-launchers)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
