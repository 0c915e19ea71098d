"""The experiment matrix: models x datasets x quantization schemes x training configs -> commands.

The single source of truth for how an experiment is launched. Everything that starts a training
run reads it: ``train_config.py`` and ``flash_attention_config.py`` (print or run one command),
the launchers in ``examples/llama/`` (generated from it) and ``run_tensor_collection.sh`` /
``run_tensor_draw.sh`` (through ``train_config.py``).

    matrix.py        the names and recipes: models, datasets, quant schemes, training configs
    commands.py      an Experiment -> its exact torchrun ... pretrain_gpt.py command
    listing.py       the text of `train_config.py --list`
    preset_flags.py  --model-preset as explicit flags (for the launchers)
    launchers.py     render, write and check examples/llama/train_*.sh
    cli.py           python -m megatron.training.experiments --write-launchers | --check-launchers

This package imports neither torch nor megatron.core, except preset_flags.py when it renders.
"""

from megatron.training.experiments.commands import (
    DEFAULT_RUNS_DIR, Capture, Command, Experiment, build_command, capture_args,
    check_experiment, data_args, data_prefix, display_path, dtype_args, eval_and_logging_args,
    format_number, matrix, missing_inputs, model_args, parallel_args, quant_args,
    resolve_torchrun, split_extra, tokenizer_args, torchrun_args, training_args)
from megatron.training.experiments.listing import (
    describe_fa_quantization, describe_layout, describe_quant_scheme, describe_training_config,
    format_listing)
from megatron.training.experiments.matrix import (
    ALL_DATASETS, ALL_QUANT_SCHEMES, DATA_SPLIT, DATASET_DESCRIPTIONS, DATASETS, ELEMENT_FORMATS, FA_QUANTIZATIONS,
    LLAMA3_VOCAB_SIZE, MATRIX_MODELS, MOCK_DATASET, MODELS, NAME_KINDS, QUANT_SCHEMES,
    TINY_MODELS, TRAINING_CONFIG_DESCRIPTIONS, TRAINING_CONFIG_NAMES, ExperimentError,
    ModelSpec, TrainingConfig, fa_quantization, model_names, names, resolve_dataset,
    resolve_model, resolve_quant_scheme, resolve_training_config)
