#!/bin/bash
# Pretrain Llama 3.1 8B (preset llama31-8b) on a GPU cluster with simulated low-precision GEMMs.
#
# GENERATED from megatron/training/experiments.py (the experiment matrix) by
#   python -m megatron.training.experiments --write-launchers
# Edit experiments.py and regenerate; tests/test_experiments.py checks that this file is in sync.
#
# Usage:
#   bash examples/llama/train_llama31_8b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#       [TOKENIZER_ARG] [DATA_ARG] [QUANT_SCHEME] [pretrain_gpt.py flags ...]
#
#   CHECKPOINT_PATH        --save/--load directory (created if missing)
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir
#   TOKENIZER_ARG          DEFAULT (the Llama 3 tokenizer of the llama-models package), a Llama 3
#                          tokenizer.model, or a HuggingFace tokenizer.json (or its directory)
#   DATA_ARG               MOCK (synthetic data, NullTokenizer with 128256 ids; the
#                          default), wikipedia/dolma (the embedded datasets built by
#                          tools/build_corpus.py under $DATA_ROOT, default data/), or a
#                          --data-path prefix of PREFIX.bin/PREFIX.idx
#   QUANT_SCHEME           bf16 (default) or one of
#                          FA_mxfp8, FA_mxfp4, FA_hifp8, linear_mxfp8, linear_mxfp4,
#                          linear_hifp8, FA_linear_mxfp8, FA_linear_mxfp4, FA_linear_hifp8
#   Flags after the positional arguments go to pretrain_gpt.py and override the ones below
#   (e.g. --train-iters 100, or --save-tensors --control-iter 1 --tensor-save-dir DIR).
#
# Environment: GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost),
#   MASTER_PORT (6000), DATA_ROOT (data/); DRY_RUN=1 prints the command instead of running it.
# Default layout: 8 ranks/node, TP2 PP1, SP, NCCL (GPU); data parallel 4 on one node.
#
# Recipe: the 'standard' training config of llama31-8b: 160B tokens (20 per parameter) at 512 x 8192 tokens per step.
# The 'fast' config and every other cell of the matrix: python train_config.py --list

set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "${SCRIPT_DIR}/../.." && pwd)
PRETRAIN_SCRIPT_PATH="${REPO_ROOT}/pretrain_gpt.py"
MOCK_VOCAB_SIZE=128256

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

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
    bf16|FA_mxfp8|FA_mxfp4|FA_hifp8|linear_mxfp8|linear_mxfp4|linear_hifp8|FA_linear_mxfp8|FA_linear_mxfp4|FA_linear_hifp8) ;;
    *)
        echo "error: unknown QUANT_SCHEME '${QUANT_SCHEME}'; valid: bf16, FA_mxfp8, FA_mxfp4, FA_hifp8, linear_mxfp8, linear_mxfp4, linear_hifp8, FA_linear_mxfp8, FA_linear_mxfp4, FA_linear_hifp8" >&2
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

DATA_ROOT=${DATA_ROOT:-${REPO_ROOT}/data}
case "${DATA_ARG}" in
    MOCK)
        DATA_ARGS_LIST=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${MOCK_VOCAB_SIZE}")
        ;;
    wikipedia)
        DATA_ARGS_LIST=(--data-path "${DATA_ROOT}/wikipedia/wikipedia_text_document" --split 969,30,1 "${TOKENIZER_ARGS[@]}")
        ;;
    dolma)
        DATA_ARGS_LIST=(--data-path "${DATA_ROOT}/dolma/dolma_text_document" --split 969,30,1 "${TOKENIZER_ARGS[@]}")
        ;;
    *)
        DATA_ARGS_LIST=(--data-path "${DATA_ARG}" --split 969,30,1 "${TOKENIZER_ARGS[@]}")
        ;;
esac

DISTRIBUTED_ARGS=(
    --nproc-per-node "${GPUS_PER_NODE}"
    --nnodes "${NUM_NODES}"
    --node-rank "${NODE_RANK}"
    --master-addr "${MASTER_ADDR}"
    --master-port "${MASTER_PORT}"
)

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --use-rope-scaling
    --rope-scaling-factor 8.0
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --make-vocab-size-divisible-by 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)

TRAINING_ARGS=(
    --seq-length 8192
    --micro-batch-size 1
    --global-batch-size 512
    --train-iters 38000
    --lr 0.0003
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-decay-iters 38000
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
)

DTYPE_ARGS=(
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
)

DATA_LOADER_ARGS=(
    --num-workers 2
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 500
    --eval-iters 32
    --save-interval 1000
    --save "${CHECKPOINT_PATH}"
    --load "${CHECKPOINT_PATH}"
    --tensorboard-dir "${TENSORBOARD_LOGS_PATH}"
)

QUANT_ARGS=(
    --quant-scheme "${QUANT_SCHEME}"
)

if [[ ! -f ${PRETRAIN_SCRIPT_PATH} ]]; then
    echo "error: ${PRETRAIN_SCRIPT_PATH} not found" >&2
    exit 1
fi

CMD=(
    torchrun "${DISTRIBUTED_ARGS[@]}" "${PRETRAIN_SCRIPT_PATH}"
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
