#!/bin/bash
# Pretrain a tiny model (llama-tiny, deepseek-tiny) on the CPU with simulated low-precision GEMMs.
#
# GENERATED from the experiment matrix (megatron/training/experiments/) by
#   python -m megatron.training.experiments --write-launchers
# Edit the matrix and regenerate; tests/test_experiments.py fails while this file is stale.
# The bash all launchers share is in common.sh, beside this file.
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
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The names the positional arguments may take (from the experiment matrix).
QUANT_SCHEMES=(bf16 FA_mxfp8 FA_mxfp4 FA_hifp8 linear_mxfp8 linear_mxfp4 linear_hifp8 FA_linear_mxfp8 FA_linear_mxfp4 FA_linear_hifp8)
EMBEDDED_DATASETS=(wikipedia=wikipedia/wikipedia_text_document dolma=dolma/dolma_text_document)
DATA_SPLIT=969,30,1

# The model (MODEL=NAME) and its architecture; MOCK data's vocabulary.
MODEL=${MODEL:-llama-tiny}
CPU_MODELS=(llama-tiny deepseek-tiny)
case "${MODEL}" in
    llama-tiny) MODEL_ARGS=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 768 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --max-position-embeddings 2048 --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0 --use-rope-scaling --rope-scaling-factor 32.0 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear --make-vocab-size-divisible-by 128 --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02) ;;
    deepseek-tiny) MODEL_ARGS=(--num-layers 3 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --kv-channels 16 --max-position-embeddings 2048 --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --qk-layernorm --make-vocab-size-divisible-by 128 --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 --num-experts 8 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 128 --moe-router-topk 2 --moe-layer-freq '([0]+[1]*2)' --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.001 --moe-router-score-function softmax --moe-router-pre-softmax --moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32 --multi-latent-attention --kv-lora-rank 64 --qk-head-dim 32 --qk-pos-emb-head-dim 32 --v-head-dim 32 --rotary-scaling-factor 40.0 --mscale 0.707 --mscale-all-dim 0.707) ;;
esac
MOCK_VOCAB_SIZE=8192

# One process, or NPROC ranks sharing the cores.
NPROC=${NPROC:-1}
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --distributed-backend gloo)

# The 'standard' recipe; common.sh adds --save/--load CHECKPOINT_PATH and --tensorboard-dir
# TENSORBOARD_LOGS_PATH to EVAL_AND_LOGGING_ARGS.
TRAINING_ARGS=(--seq-length 256 --micro-batch-size 2 --global-batch-size 4 --train-iters 150 --lr 0.001 --min-lr 0.0001 --lr-decay-style cosine --lr-decay-iters 150 --lr-warmup-iters 15 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0)
DTYPE_ARGS=(--bf16)
DATA_LOADER_ARGS=(--num-workers 0)
EVAL_AND_LOGGING_ARGS=(--log-interval 10 --eval-interval 50 --eval-iters 2 --save-interval 50)

run_on_cpu "$@"
