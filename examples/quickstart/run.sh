#!/usr/bin/env bash
# The quickstart: build a real-text dataset from the Python standard library's sources, then train a
# tiny Llama on it with 2 processes (data parallel, gloo on CPU; NCCL when a GPU is present) and print
# the validation loss as it falls. About 1 minute on 2 CPU cores.
#
#   bash examples/quickstart/run.sh
#
# Environment (defaults in brackets):
#   WORK_DIR     [quickstart_work]  data, tokenizer and logs
#   NPROC        [2]                processes (data-parallel ranks)
#   TRAIN_ITERS  [300]              optimizer steps
#   EVAL_INTERVAL [50]              iterations between validation passes
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK_DIR=${WORK_DIR:-quickstart_work}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-300}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ ! -f "$WORK_DIR/stdlib_text_document.idx" ]; then
  WORK_DIR="$WORK_DIR" PYTHON="$PYTHON" VOCAB_SIZE=${VOCAB_SIZE:-4096} bash "$ROOT/examples/quickstart/prepare.sh"
fi

MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
            --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128
            --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --swiglu
            --disable-bias-linear --hidden-dropout 0 --attention-dropout 0)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" --lr 2e-3 --min-lr 2e-4
               --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
               --seed 1234)
DATA_ARGS=(--data-path "$WORK_DIR/stdlib_text_document" --split 95,5,0 --data-cache-path "$WORK_DIR/cache"
           --tokenizer-type GPT2BPETokenizer --vocab-file "$WORK_DIR/tokenizer/vocab.json"
           --merge-file "$WORK_DIR/tokenizer/merges.txt" --num-workers 1)
LOGGING_ARGS=(--log-interval 10 --eval-interval "$EVAL_INTERVAL" --eval-iters 10)

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29512}" \
  "$ROOT/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
