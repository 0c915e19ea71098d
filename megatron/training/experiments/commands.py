"""From an experiment (one cell of the matrix plus where it runs) to its exact launch command.

The pretrain_gpt.py flags are grouped like the bash arrays of Megatron-LM's example scripts
(MODEL_ARGS, TRAINING_ARGS, ...). The path of pretrain_gpt.py is given by the caller: the
library does not know where the checkout is.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megatron.training import corpora
from megatron.training.experiments.matrix import (
    DATA_SPLIT, DATASETS, ELEMENT_FORMATS, MATRIX_MODELS, MOCK_DATASET, QUANT_SCHEMES,
    TRAINING_CONFIG_NAMES, ExperimentError, ModelSpec, TrainingConfig, resolve_dataset,
    resolve_model, resolve_quant_scheme, resolve_training_config)

DEFAULT_RUNS_DIR = "runs"


def format_number(value) -> str:
    """Numbers as Megatron scripts write them: 3e-05 -> 3e-5, 0.1 -> 0.1, 1.0 -> 1.0."""
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exponent = text.split("e")
            return f"{mantissa}e{int(exponent)}"
        return text
    return str(value)


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
    quant_scheme: str
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

    @property
    def variant(self) -> str:
        """The quant scheme, plus the PV format of an attention study: a run-directory name."""
        if self.attn_pv_quant is None:
            return self.quant_scheme
        return f"{self.quant_scheme}_pv_{self.attn_pv_quant}"

    def default_run_dir(self) -> str:
        return os.path.join(DEFAULT_RUNS_DIR, self.spec.name, self.dataset, self.variant,
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


# ---------------------------------------------------------------------------------------------
# Flag groups
# ---------------------------------------------------------------------------------------------


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
        "--lr", format_number(cfg.lr),
        "--min-lr", format_number(cfg.min_lr),
        "--lr-decay-style", cfg.lr_decay_style,
        # Explicit, so a shorter run (--train-iters N after '--') follows the recipe's schedule.
        "--lr-decay-iters", str(cfg.train_iters),
        "--lr-warmup-iters", str(cfg.lr_warmup_iters),
        "--weight-decay", format_number(cfg.weight_decay),
        "--adam-beta1", format_number(cfg.adam_beta1),
        "--adam-beta2", format_number(cfg.adam_beta2),
        "--clip-grad", format_number(cfg.clip_grad),
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


def _output_dirs(exp: Experiment, cfg: TrainingConfig) -> Tuple[Optional[str], Optional[str]]:
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
    ckpt, tensorboard = _output_dirs(exp, cfg)
    if ckpt is not None:
        args += ["--save", ckpt, "--load", ckpt,
                 "--save-interval", str(cfg.save_interval or cfg.train_iters)]
    if tensorboard is not None:
        args += ["--tensorboard-dir", tensorboard]
    return args


def quant_args(exp: Experiment) -> List[str]:
    args = ["--quant-scheme", exp.quant_scheme]
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


# ---------------------------------------------------------------------------------------------
# Checking and building
# ---------------------------------------------------------------------------------------------


def check_experiment(exp: Experiment) -> TrainingConfig:
    """Resolve every name of `exp` (ExperimentError on a bad one) and return its config."""
    spec = resolve_model(exp.model)
    resolve_dataset(exp.dataset)
    resolve_quant_scheme(exp.quant_scheme)
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


def build_command(exp: Experiment, pretrain_script: os.PathLike) -> Command:
    """The exact launch of `exp` running `pretrain_script` (the caller's pretrain_gpt.py).

    Names are checked; paths are not (see `missing_inputs`).
    """
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
    ckpt, _ = _output_dirs(exp, cfg)
    return Command(env=env, launcher=["torchrun", *torchrun_args(exp)],
                   script=display_path(pretrain_script), groups=groups, experiment=exp,
                   makedirs=[ckpt] if ckpt else [])


def display_path(path: os.PathLike) -> str:
    """`path` relative to the working directory when it lies inside it, else absolute."""
    path = os.path.abspath(path)
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel == ".." or rel.startswith(".." + os.sep) else rel


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
           quant_schemes: Sequence[str] = QUANT_SCHEMES,
           training_configs: Sequence[str] = TRAINING_CONFIG_NAMES) -> List[Experiment]:
    """Every experiment of the given names (default: the 3 x 2 x 10 x 2 matrix)."""
    return [Experiment(model=m, dataset=d, quant_scheme=s, training_config=c)
            for m in models for d in datasets for s in quant_schemes for c in training_configs]


def split_extra(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(own flags, flags after the first '--'): the pass-through convention of the drivers."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []
