#!/bin/bash
# Pretrain a tiny model (llama-tiny, deepseek-tiny) on the CPU with simulated low-precision GEMMs.
#
# GENERATED from megatron/training/experiments.py (the experiment matrix) by
#   python -m megatron.training.experiments --write-launchers
# Edit experiments.py and regenerate; tests/test_experiments.py checks that this file is in sync.
#
# Usage:
#   bash examples/llama/train_tiny_cpu.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#       [TOKENIZER_ARG] [DATA_ARG] [QUANT_SCHEME] [pretrain_gpt.py flags ...]
#
#   CHECKPOINT_PATH        --save/--load directory (created if missing)
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir
#   TOKENIZER_ARG          DEFAULT (the Llama 3 tokenizer of the llama-models package), a Llama 3
#                          tokenizer.model, or a HuggingFace tokenizer.json (or its directory)
#   DATA_ARG               MOCK (synthetic data, NullTokenizer with 8192 ids; the
#                          default), wikipedia/dolma (the embedded datasets built by
#                          tools/build_corpus.py under $DATA_ROOT, default data/), or a
#                          --data-path prefix of PREFIX.bin/PREFIX.idx
#   QUANT_SCHEME           bf16 (default) or one of
#                          FA_mxfp8, FA_mxfp4, FA_hifp8, linear_mxfp8, linear_mxfp4,
#                          linear_hifp8, FA_linear_mxfp8, FA_linear_mxfp4, FA_linear_hifp8
#   Flags after the positional arguments go to pretrain_gpt.py and override the ones below
#   (e.g. --train-iters 100, or --save-tensors --control-iter 1 --tensor-save-dir DIR).
#
# Environment: MODEL (llama-tiny; or deepseek-tiny), NPROC (1: one process; N > 1: torchrun
#   with N gloo ranks and OMP_NUM_THREADS=1 each), PYTHON (the repository's .venv if present),
#   DATA_ROOT (data/); DRY_RUN=1 prints the command instead of running it.

#
# Recipe: the 'standard' training config of the tiny models: 150 iterations of 4 x 256 tokens, sized for a 2-core CPU.
# The 'fast' config and every other cell of the matrix: python train_config.py --list

set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "${SCRIPT_DIR}/../.." && pwd)
PRETRAIN_SCRIPT_PATH="${REPO_ROOT}/pretrain_gpt.py"
MOCK_VOCAB_SIZE=8192

MODEL=${MODEL:-llama-tiny}
NPROC=${NPROC:-1}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x ${REPO_ROOT}/.venv/bin/python ]]; then PYTHON=${REPO_ROOT}/.venv/bin/python; else PYTHON=python3; fi
fi
if ! [[ ${NPROC} =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC=${NPROC} is not a positive integer" >&2
    exit 2
fi

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

case "${MODEL}" in
    llama-tiny)
        MODEL_ARGS=(
            --num-layers 4
            --hidden-size 256
            --ffn-hidden-size 768
            --num-attention-heads 8
            --group-query-attention
            --num-query-groups 2
            --max-position-embeddings 2048
            --position-embedding-type rope
            --rotary-base 500000
            --rotary-percent 1.0
            --use-rope-scaling
            --rope-scaling-factor 32.0
            --normalization RMSNorm
            --norm-epsilon 1e-5
            --swiglu
            --disable-bias-linear
            --make-vocab-size-divisible-by 128
            --attention-dropout 0.0
            --hidden-dropout 0.0
            --init-method-std 0.02
        )
        ;;
    deepseek-tiny)
        MODEL_ARGS=(
            --num-layers 3
            --hidden-size 128
            --ffn-hidden-size 384
            --num-attention-heads 4
            --kv-channels 16
            --max-position-embeddings 2048
            --position-embedding-type rope
            --rotary-base 10000
            --normalization RMSNorm
            --norm-epsilon 1e-6
            --swiglu
            --untie-embeddings-and-output-weights
            --disable-bias-linear
            --qk-layernorm
            --make-vocab-size-divisible-by 128
            --attention-dropout 0.0
            --hidden-dropout 0.0
            --init-method-std 0.02
            --num-experts 8
            --moe-ffn-hidden-size 64
            --moe-shared-expert-intermediate-size 128
            --moe-router-topk 2
            --moe-layer-freq '([0]+[1]*2)'
            --moe-router-load-balancing-type seq_aux_loss
            --moe-aux-loss-coeff 0.001
            --moe-router-score-function softmax
            --moe-router-pre-softmax
            --moe-router-topk-scaling-factor 1.0
            --moe-router-dtype fp32
            --multi-latent-attention
            --kv-lora-rank 64
            --qk-head-dim 32
            --qk-pos-emb-head-dim 32
            --v-head-dim 32
            --rotary-scaling-factor 40.0
            --mscale 0.707
            --mscale-all-dim 0.707
        )
        ;;
    *)
        echo "error: unknown MODEL '${MODEL}'; valid: llama-tiny, deepseek-tiny" >&2
        exit 2
        ;;
esac

TRAINING_ARGS=(
    --seq-length 256
    --micro-batch-size 2
    --global-batch-size 4
    --train-iters 150
    --lr 0.001
    --min-lr 0.0001
    --lr-decay-style cosine
    --lr-decay-iters 150
    --lr-warmup-iters 15
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
)

DTYPE_ARGS=(
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --distributed-backend gloo
)

DATA_LOADER_ARGS=(
    --num-workers 0
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 50
    --eval-iters 2
    --save-interval 50
    --save "${CHECKPOINT_PATH}"
    --load "${CHECKPOINT_PATH}"
    --tensorboard-dir "${TENSORBOARD_LOGS_PATH}"
)

QUANT_ARGS=(
    --quant-scheme "${QUANT_SCHEME}"
)

# One process runs pretrain_gpt.py directly; several share the cores through torchrun.
if [[ ${NPROC} -eq 1 ]]; then
    LAUNCH=("${PYTHON}")
else
    export OMP_NUM_THREADS=1
    LAUNCH=("${PYTHON}" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "${NPROC}")
fi

CMD=(
    "${LAUNCH[@]}" "${PRETRAIN_SCRIPT_PATH}"
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
