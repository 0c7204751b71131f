#!/usr/bin/env bash
# Train Falcon-7B / Falcon-40B (or a tiny Falcon-shaped model on CPU) with pretrain_gpt.py under torchrun.
#
#   MBS=1 BS=64 SEQ_LENGTH=2048 MODEL_SIZE=7B bash examples/falcon/train_falcon.sh
#   TP=8 NNODES=4 NODE_RANK=... MASTER_ADDR=... MODEL_SIZE=40B bash examples/falcon/train_falcon.sh
#   bash examples/falcon/train_falcon.sh           # no GPU, no MODEL_SIZE: tiny Falcon on CPU (gloo)
#
# Environment: that of examples/llama/train_llama3.sh (see its header), plus:
#   MODEL_SIZE      7B | 40B | tiny                                         [7B with a GPU, tiny without]
# Falcon runs attention and MLP in parallel (--parallel_attn, Megatron-LLM's flag): 7B from one norm
# with multi-query attention (--use_multiquery_attn; its 71 heads take TP=1), 40B from a norm each
# (--parallel_layernorm) with 8 key/value groups. docs/models.md maps the flags to Hugging Face's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEFAULT_GPU_MODEL_SIZE=7B
DEFAULT_SEQ_LENGTH=2048
source "$ROOT/examples/llama/common.sh"

case "$MODEL_SIZE" in
  7B)   MODEL_ARGS=(--num-layers 32 --hidden-size 4544 --ffn-hidden-size 18176 --num-attention-heads 71
                    --use_multiquery_attn) ;;
  40B)  MODEL_ARGS=(--num-layers 60 --hidden-size 8192 --ffn-hidden-size 32768 --num-attention-heads 128
                    --group-query-attention --num-query-groups 8 --parallel_layernorm) ;;
  tiny) MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
                    --use_multiquery_attn) ;;
  *) echo "MODEL_SIZE must be 7B, 40B or tiny for Falcon (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
VOCAB=$([ "$MODEL_SIZE" = tiny ] && echo 8192 || echo 65024)
MODEL_ARGS+=(--parallel_attn --max-position-embeddings "$((SEQ_LENGTH > 2048 ? SEQ_LENGTH : 2048))"
             --position-embedding-type rope --rotary-base 10000 --normalization LayerNorm --norm-epsilon 1e-5
             --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02)
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
