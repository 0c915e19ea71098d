# shellcheck shell=bash
# The bash that every launcher in examples/llama/ shares: argument parsing, the tokenizer, data
# and quantization flags, and the torchrun / python invocation. It is sourced, not run.
#
# A launcher (generated from the experiment matrix) sources this file, sets what is specific to
# its model and ends with one call:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#   QUANT_SCHEMES=(...)          valid QUANT_SCHEME values
#   EMBEDDED_DATASETS=(...)      NAME=PREFIX: DATA_ARG NAME means ${DATA_ROOT}/PREFIX
#   DATA_SPLIT=...               --split of real data
#   MOCK_VOCAB_SIZE=...          --vocab-size of MOCK data
#   MODEL_ARGS=(...) TRAINING_ARGS=(...) DTYPE_ARGS=(...) MODEL_PARALLEL_ARGS=(...)
#   DATA_LOADER_ARGS=(...) EVAL_AND_LOGGING_ARGS=(...)
#   run_on_gpus "$@"             with GPUS_PER_NODE set, or
#   run_on_cpu "$@"              with CPU_MODELS, MODEL (and MODEL_ARGS for it) and NPROC set
#
# The command is
#   LAUNCH pretrain_gpt.py MODEL_ARGS TRAINING_ARGS DTYPE_ARGS MODEL_PARALLEL_ARGS
#       DATA_ARGS_LIST DATA_LOADER_ARGS EVAL_AND_LOGGING_ARGS QUANT_ARGS EXTRA_ARGS
# so the flags after the positional arguments (EXTRA_ARGS) override the launcher's.

if [[ ${BASH_SOURCE[0]} == "${0}" ]]; then
    echo "error: ${BASH_SOURCE[0]} is sourced by the launchers beside it, not run" >&2
    exit 2
fi

LAUNCHER_PATH=${BASH_SOURCE[1]}   # the train_*.sh that sources this file
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PRETRAIN_SCRIPT_PATH="${REPO_ROOT}/pretrain_gpt.py"

# The launcher's header comment, from its second line down to 'set -euo pipefail'.
usage() {
    sed -n '2,/^set -euo pipefail/p' "${LAUNCHER_PATH}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

# is_one_of VALUE CHOICE...: whether VALUE is one of the choices.
is_one_of() {
    local value=$1 choice
    shift
    for choice in "$@"; do
        if [[ ${value} == "${choice}" ]]; then
            return 0
        fi
    done
    return 1
}

# comma_list WORD...: "a, b, c", for error messages.
comma_list() {
    local list
    printf -v list '%s, ' "$@"
    echo "${list%, }"
}

# parse_launcher_args "$@": --help, then CHECKPOINT_PATH TENSORBOARD_LOGS_PATH [TOKENIZER_ARG]
# [DATA_ARG] [QUANT_SCHEME] and EXTRA_ARGS. Sets TOKENIZER_ARGS, DATA_ARGS_LIST and QUANT_ARGS,
# and adds the checkpoint and TensorBoard directories to EVAL_AND_LOGGING_ARGS. Usage errors
# exit 2.
parse_launcher_args() {
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

    if ! is_one_of "${QUANT_SCHEME}" "${QUANT_SCHEMES[@]}"; then
        local valid
        valid=$(comma_list "${QUANT_SCHEMES[@]}")
        echo "error: unknown QUANT_SCHEME '${QUANT_SCHEME}'; valid: ${valid}" >&2
        exit 2
    fi
    QUANT_ARGS=(--quant-scheme "${QUANT_SCHEME}")

    if [[ ${TOKENIZER_ARG} == DEFAULT ]]; then
        TOKENIZER_ARGS=(--tokenizer-type Llama3Tokenizer)
    elif [[ ${TOKENIZER_ARG} == *.json || -d ${TOKENIZER_ARG} ]]; then
        TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_ARG}")
    else
        TOKENIZER_ARGS=(--tokenizer-type Llama3Tokenizer --tokenizer-model "${TOKENIZER_ARG}")
    fi

    # DATA_ARG: MOCK, the name of an embedded dataset (under DATA_ROOT), or a --data-path prefix.
    DATA_ROOT=${DATA_ROOT:-${REPO_ROOT}/data}
    if [[ ${DATA_ARG} == MOCK ]]; then
        DATA_ARGS_LIST=(
            --mock-data --tokenizer-type NullTokenizer --vocab-size "${MOCK_VOCAB_SIZE}"
        )
    else
        local data_path=${DATA_ARG} dataset
        for dataset in "${EMBEDDED_DATASETS[@]}"; do
            if [[ ${DATA_ARG} == "${dataset%%=*}" ]]; then
                data_path=${DATA_ROOT}/${dataset#*=}
            fi
        done
        DATA_ARGS_LIST=(--data-path "${data_path}" --split "${DATA_SPLIT}" "${TOKENIZER_ARGS[@]}")
    fi

    EVAL_AND_LOGGING_ARGS+=(
        --save "${CHECKPOINT_PATH}"
        --load "${CHECKPOINT_PATH}"
        --tensorboard-dir "${TENSORBOARD_LOGS_PATH}"
    )
}

# run_pretrain LAUNCH...: runs LAUNCH pretrain_gpt.py with every flag group; DRY_RUN=1 prints
# the command instead of running it.
run_pretrain() {
    CMD=(
        "$@" "${PRETRAIN_SCRIPT_PATH}"
        "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DTYPE_ARGS[@]}"
        "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS_LIST[@]}" "${DATA_LOADER_ARGS[@]}"
        "${EVAL_AND_LOGGING_ARGS[@]}" "${QUANT_ARGS[@]}" "${EXTRA_ARGS[@]}"
    )
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '%q ' "${CMD[@]}"
        echo
        exit 0
    fi
    mkdir -p "${CHECKPOINT_PATH}" "${TENSORBOARD_LOGS_PATH}"
    exec "${CMD[@]}"
}

# run_on_gpus "$@": torchrun with GPUS_PER_NODE ranks on each of NNODES (1) nodes; NODE_RANK (0),
# MASTER_ADDR (localhost), MASTER_PORT (6000).
run_on_gpus() {
    parse_launcher_args "$@"
    export CUDA_DEVICE_MAX_CONNECTIONS=1

    NUM_NODES=${NNODES:-1}
    NODE_RANK=${NODE_RANK:-0}
    MASTER_ADDR=${MASTER_ADDR:-localhost}
    MASTER_PORT=${MASTER_PORT:-6000}
    DISTRIBUTED_ARGS=(
        --nproc-per-node "${GPUS_PER_NODE}"
        --nnodes "${NUM_NODES}"
        --node-rank "${NODE_RANK}"
        --master-addr "${MASTER_ADDR}"
        --master-port "${MASTER_PORT}"
    )

    if [[ ! -f ${PRETRAIN_SCRIPT_PATH} ]]; then
        echo "error: ${PRETRAIN_SCRIPT_PATH} not found" >&2
        exit 1
    fi
    run_pretrain torchrun "${DISTRIBUTED_ARGS[@]}"
}

# run_on_cpu "$@": MODEL (one of CPU_MODELS) on the CPU. NPROC=1 runs pretrain_gpt.py in one
# python process; NPROC=N > 1 runs N gloo ranks through torchrun, one OMP thread each. PYTHON
# defaults to the checkout's .venv when there is one.
run_on_cpu() {
    if [[ -z ${PYTHON:-} ]]; then
        PYTHON=python3
        if [[ -x ${REPO_ROOT}/.venv/bin/python ]]; then
            PYTHON=${REPO_ROOT}/.venv/bin/python
        fi
    fi
    if ! [[ ${NPROC} =~ ^[1-9][0-9]*$ ]]; then
        echo "error: NPROC=${NPROC} is not a positive integer" >&2
        exit 2
    fi

    parse_launcher_args "$@"

    if ! is_one_of "${MODEL}" "${CPU_MODELS[@]}"; then
        echo "error: unknown MODEL '${MODEL}'; valid: $(comma_list "${CPU_MODELS[@]}")" >&2
        exit 2
    fi

    if [[ ${NPROC} -eq 1 ]]; then
        LAUNCH=("${PYTHON}")
    else
        export OMP_NUM_THREADS=1
        LAUNCH=(
            "${PYTHON}" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "${NPROC}"
        )
    fi
    run_pretrain "${LAUNCH[@]}"
}
