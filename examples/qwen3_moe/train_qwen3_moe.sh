#!/usr/bin/env bash
# Train Qwen3-30B-A3B (or a tiny Qwen3-style mixture of experts on CPU) with pretrain_gpt.py under torchrun.
#
#   EP=8 MBS=1 BS=64 SEQ_LENGTH=4096 MODEL_SIZE=30B-A3B bash examples/qwen3_moe/train_qwen3_moe.sh
#   bash examples/qwen3_moe/train_qwen3_moe.sh        # no GPU, no MODEL_SIZE: tiny MoE on CPU (gloo)
#
# Environment: that of examples/llama/train_llama3.sh (see its header), plus:
#   MODEL_SIZE      30B-A3B | tiny                                          [30B-A3B with a GPU, tiny without]
#   EP              expert-parallel size                                    [8 for 30B-A3B; 1 tiny]
#   ETP             expert-tensor-parallel size, 1 or TP                    [TP]
#   MOE_DISPATCHER  alltoall | allgather                                    [alltoall]
#   MOE_AUX_LOSS    load-balancing loss coefficient (global batch, as Qwen3) [1e-3]
#   MOE_LAYER_RECOMPUTE 1: recompute the MoE blocks in backward             [0]
# Slurm: MODEL=qwen3_moe sbatch examples/llama/train_llama_slurm.sh 30B-A3B MBS BS_PER_NODE SEQ ITERS 0 RECOMPUTE
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEFAULT_GPU_MODEL_SIZE=30B-A3B
DEFAULT_SEQ_LENGTH=4096
if [ "${MODEL_SIZE:-}" != tiny ] && command -v nvidia-smi >/dev/null 2>&1; then EP=${EP:-8}; fi
source "$ROOT/examples/llama/common.sh"
MOE_DISPATCHER=${MOE_DISPATCHER:-alltoall}
MOE_AUX_LOSS=${MOE_AUX_LOSS:-1e-3}
MOE_LAYER_RECOMPUTE=${MOE_LAYER_RECOMPUTE:-0}

case "$MODEL_SIZE" in
  30B-A3B) MODEL_ARGS=(--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128
                       --group-query-attention --num-query-groups 4 --num-experts 128 --moe-ffn-hidden-size 768
                       --moe-router-topk 8 --ffn-hidden-size 6144) ; VOCAB=151936 ;;
  tiny)    MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 32
                       --group-query-attention --num-query-groups 2 --num-experts 8 --moe-ffn-hidden-size 64
                       --moe-router-topk 2 --ffn-hidden-size 352) ; VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 30B-A3B or tiny for Qwen3-MoE (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
# --ffn-hidden-size is that of a dense layer (Qwen3's config lists it); every layer here is a mixture of experts.
MODEL_ARGS+=(--max-position-embeddings "$((SEQ_LENGTH > 40960 ? SEQ_LENGTH : 40960))"
             --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-6
             --qk-layernorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0
             --attention-dropout 0 --init-method-std 0.02 --moe-router-load-balancing-type global_aux_loss
             --moe-aux-loss-coeff "$MOE_AUX_LOSS" --moe-grouped-gemm --moe-token-dispatcher-type "$MOE_DISPATCHER")
if [ "$MOE_LAYER_RECOMPUTE" = 1 ]; then MODEL_ARGS+=(--moe-layer-recompute); fi
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
