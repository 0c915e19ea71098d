"""The launchers in examples/llama/, generated from the matrix.

A launcher holds only what is specific to its model: the header (its --help text), the names
its positional arguments may take, MODEL_ARGS, the recipe and parallel-layout arrays, and one
call into the hand-written common.sh beside it, which holds all the shared bash.

Each array is written on one line: launchers of similar models differ in a few values, and one
flag per line would repeat the same column of lines in every launcher.
"""

from __future__ import annotations

import shlex
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import List, Sequence

from megatron.training import corpora
from megatron.training.experiments.commands import dtype_args, parallel_args, training_args
from megatron.training.experiments.listing import describe_layout
from megatron.training.experiments.matrix import (
    DATA_SPLIT, DATASETS, MODELS, QUANT_SCHEMES, ExperimentError, ModelSpec, TrainingConfig)
from megatron.training.experiments.preset_flags import preset_flags

# The shared bash, sourced by every launcher from its own directory; checked in, not generated.
COMMON_SCRIPT = "common.sh"

_HEADER = """\
#!/bin/bash
# {title}
#
# GENERATED from the experiment matrix (megatron/training/experiments/) by
#   python -m megatron.training.experiments --write-launchers
# Edit the matrix and regenerate; tests/test_experiments.py fails while this file is stale.
# The bash all launchers share is in {common}, beside this file.
#
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
#                          {quant_schemes}
#   Flags after the positional arguments go to pretrain_gpt.py and override the ones below
#   (e.g. --train-iters 100, or --save-tensors --control-iter 1 --tensor-save-dir DIR).
#
{environment}
#
# Recipe: the {config!r} training config of {recipe_of}: {description}.
# The 'fast' config and every other cell of the matrix: python train_config.py --list

set -euo pipefail
source "$(dirname "${{BASH_SOURCE[0]}}")/{common}"
"""


def _header(title: str, launcher: str, spec: ModelSpec, environment: str, recipe_of: str,
            cfg: TrainingConfig) -> str:
    others = [s for s in QUANT_SCHEMES if s != "bf16"]
    quant_schemes = ("\n#" + " " * 26).join(textwrap.wrap(", ".join(others), width=70))
    return _HEADER.format(
        title=title, launcher=launcher, common=COMMON_SCRIPT, mock_vocab=spec.mock_vocab_size,
        datasets="/".join(DATASETS), quant_schemes=quant_schemes, environment=environment,
        config=cfg.name, recipe_of=recipe_of, description=cfg.description)


def bash_array(name: str, args: Sequence[str]) -> str:
    """`NAME=(--flag value ...)` on one line; "${VAR}" references are kept unquoted."""
    words = [a if a.startswith('"$') else shlex.quote(a) for a in args]
    return f"{name}=({' '.join(words)})"


def _matrix_names() -> List[str]:
    """What common.sh checks the positional arguments against."""
    root = Path(corpora.DEFAULT_DATA_ROOT)
    datasets = [f"{name}={Path(corpora.embedded_data_prefix(name)).relative_to(root)}"
                for name in DATASETS]
    return ["# The names the positional arguments may take (from the experiment matrix).",
            bash_array("QUANT_SCHEMES", QUANT_SCHEMES),
            bash_array("EMBEDDED_DATASETS", datasets),
            f"DATA_SPLIT={DATA_SPLIT}"]


def _recipe(cfg: TrainingConfig, spec: ModelSpec, world_size: int) -> List[str]:
    eval_args = ["--log-interval", str(cfg.log_interval), "--eval-interval",
                 str(cfg.eval_interval), "--eval-iters", str(cfg.eval_iters),
                 "--save-interval", str(cfg.save_interval)]
    return [f"# The {cfg.name!r} recipe; {COMMON_SCRIPT} adds --save/--load CHECKPOINT_PATH and "
            "--tensorboard-dir\n# TENSORBOARD_LOGS_PATH to EVAL_AND_LOGGING_ARGS.",
            bash_array("TRAINING_ARGS", training_args(cfg, spec, world_size)),
            bash_array("DTYPE_ARGS", dtype_args(spec)),
            bash_array("DATA_LOADER_ARGS", ["--num-workers", str(cfg.num_workers)]),
            bash_array("EVAL_AND_LOGGING_ARGS", eval_args)]


def _model_args(spec: ModelSpec) -> List[str]:
    return preset_flags(spec.preset) + list(spec.extra_model_args)


def render_cluster_launcher(spec: ModelSpec) -> str:
    cfg = spec.training["standard"]
    world = spec.nproc_per_node
    environment = (
        f"# Environment: GPUS_PER_NODE ({spec.nproc_per_node}), NNODES (1), NODE_RANK (0), "
        f"MASTER_ADDR (localhost),\n#   MASTER_PORT (6000), DATA_ROOT (data/); DRY_RUN=1 prints "
        f"the command instead of running it.\n# Default layout: {describe_layout(spec)}; data "
        f"parallel {spec.data_parallel_size(world)} on one node.")
    header = _header(f"Pretrain {spec.title} (preset {spec.preset}) on a GPU cluster with "
                     "simulated low-precision GEMMs.", spec.launcher, spec, environment,
                     spec.name, cfg)
    parts = [
        *_matrix_names(),
        "",
        f"# The architecture (the flags of --model-preset {spec.preset}); MOCK data's "
        "vocabulary.",
        bash_array("MODEL_ARGS", _model_args(spec)),
        f"MOCK_VOCAB_SIZE={spec.mock_vocab_size}",
        "",
        "# The parallel layout; GPUS_PER_NODE from the environment wins.",
        f"GPUS_PER_NODE=${{GPUS_PER_NODE:-{spec.nproc_per_node}}}",
        bash_array("MODEL_PARALLEL_ARGS", parallel_args(spec)),
        "",
        *_recipe(cfg, spec, world),
        "",
        'run_on_gpus "$@"',
    ]
    return header + "\n" + "\n".join(parts) + "\n"


def render_cpu_launcher(specs: Sequence[ModelSpec]) -> str:
    """One launcher for the tiny CPU models, chosen with MODEL; they share one recipe."""
    first = specs[0]
    cfg = first.training["standard"]
    for spec in specs[1:]:
        if spec.training["standard"] != cfg or spec.mock_vocab_size != first.mock_vocab_size:
            raise ExperimentError("the CPU launcher assumes one recipe for all tiny models")
    model_names = [s.name for s in specs]
    environment = (
        f"# Environment: MODEL ({model_names[0]}; or {', '.join(model_names[1:])}), NPROC (1: "
        "one process; N > 1: torchrun\n#   with N gloo ranks and OMP_NUM_THREADS=1 each), "
        "PYTHON (the repository's .venv if present),\n#   DATA_ROOT (data/); DRY_RUN=1 prints "
        "the command instead of running it.")
    header = _header("Pretrain a tiny model (" + ", ".join(model_names) + ") on the CPU with "
                     "simulated low-precision GEMMs.", first.launcher, first, environment,
                     "the tiny models", cfg)
    model_cases = [f"    {spec.name}) {bash_array('MODEL_ARGS', _model_args(spec))} ;;"
                   for spec in specs]
    parts = [
        *_matrix_names(),
        "",
        "# The model (MODEL=NAME) and its architecture; MOCK data's vocabulary.",
        f"MODEL=${{MODEL:-{model_names[0]}}}",
        bash_array("CPU_MODELS", model_names),
        'case "${MODEL}" in',
        *model_cases,
        "esac",
        f"MOCK_VOCAB_SIZE={first.mock_vocab_size}",
        "",
        "# One process, or NPROC ranks sharing the cores.",
        "NPROC=${NPROC:-1}",
        bash_array("MODEL_PARALLEL_ARGS", parallel_args(first)),
        "",
        *_recipe(cfg, first, 1),
        "",
        'run_on_cpu "$@"',
    ]
    return header + "\n" + "\n".join(parts) + "\n"


def render_launchers() -> "OrderedDict[str, str]":
    """File name -> text of every generated launcher (common.sh is written by hand)."""
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


def write_launchers(directory: Path) -> List[Path]:
    """Write every launcher (executable) into `directory`, which should hold common.sh."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_launchers().items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)
        written.append(path)
    return written


def stale_launchers(directory: Path) -> List[str]:
    """The launchers in `directory` that are missing or differ from what the matrix renders."""
    stale = []
    for name, text in render_launchers().items():
        path = Path(directory) / name
        if not path.is_file() or path.read_text() != text:
            stale.append(str(path))
    return stale
