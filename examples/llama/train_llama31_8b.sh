#!/bin/bash
# Pretrain Llama 3.1 8B (preset llama31-8b) on a GPU cluster with simulated low-precision GEMMs.
#
# GENERATED from the experiment matrix (megatron/training/experiments/) by
#   python -m megatron.training.experiments --write-launchers
# Edit the matrix and regenerate; tests/test_experiments.py fails while this file is stale.
# The bash all launchers share is in common.sh, beside this file.
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
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The names the positional arguments may take (from the experiment matrix).
QUANT_SCHEMES=(bf16 FA_mxfp8 FA_mxfp4 FA_hifp8 linear_mxfp8 linear_mxfp4 linear_hifp8 FA_linear_mxfp8 FA_linear_mxfp4 FA_linear_hifp8)
EMBEDDED_DATASETS=(wikipedia=wikipedia/wikipedia_text_document dolma=dolma/dolma_text_document)
DATA_SPLIT=969,30,1

# The architecture (the flags of --model-preset llama31-8b); MOCK data's vocabulary.
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --max-position-embeddings 131072 --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0 --use-rope-scaling --rope-scaling-factor 8.0 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128 --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02)
MOCK_VOCAB_SIZE=128256

# The parallel layout; GPUS_PER_NODE from the environment wins.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel --use-distributed-optimizer)

# The 'standard' recipe; common.sh adds --save/--load CHECKPOINT_PATH and --tensorboard-dir
# TENSORBOARD_LOGS_PATH to EVAL_AND_LOGGING_ARGS.
TRAINING_ARGS=(--seq-length 8192 --micro-batch-size 1 --global-batch-size 512 --train-iters 38000 --lr 0.0003 --min-lr 3e-5 --lr-decay-style cosine --lr-decay-iters 38000 --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0)
DTYPE_ARGS=(--bf16)
DATA_LOADER_ARGS=(--num-workers 2)
EVAL_AND_LOGGING_ARGS=(--log-interval 10 --eval-interval 500 --eval-iters 32 --save-interval 1000)

run_on_gpus "$@"
