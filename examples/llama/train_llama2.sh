#!/usr/bin/env bash
# Train Llama 2 (or a tiny Llama on CPU) with pretrain_gpt.py under torchrun.
#
#   TP=2 MBS=2 BS=64 SEQ_LENGTH=4096 MODEL_SIZE=7 bash examples/llama/train_llama2.sh
#
# Environment: as in train_llama3.sh, with MODEL_SIZE 7 | 13 | 70 | tiny  [7 with a GPU, tiny without]
# and TOKENIZER_MODEL a SentencePiece tokenizer.model (Llama2Tokenizer).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEFAULT_GPU_MODEL_SIZE=7
DEFAULT_SEQ_LENGTH=4096
# 70B: tensor parallel within a node, 4 pipeline stages across nodes (the memory arithmetic is in
# docs/parallelism.md, "Default layout for 70B"); TP and PP from the environment win.
if [ "${MODEL_SIZE:-}" = 70 ]; then TP=${TP:-8}; PP=${PP:-4}; fi
source "$ROOT/examples/llama/common.sh"

case "$MODEL_SIZE" in
  7)  MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32) ; VOCAB=32000 ;;
  13) MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40) ; VOCAB=32000 ;;
  70) MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
                  --group-query-attention --num-query-groups 8) ; VOCAB=32000 ;;
  tiny) MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4) ; VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 7, 13, 70 or tiny for Llama 2 (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
MODEL_ARGS+=(--max-position-embeddings "$((SEQ_LENGTH > 4096 ? SEQ_LENGTH : 4096))" --position-embedding-type rope
             --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
             --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02)
TOKENIZER_TYPE=Llama2Tokenizer

run_training
