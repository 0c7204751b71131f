#!/usr/bin/env bash
# Train Mixtral 8x7B / 8x22B (or a tiny mixture of experts on CPU) with pretrain_gpt.py under torchrun.
#
#   EP=8 MBS=1 BS=64 SEQ_LENGTH=4096 MODEL_SIZE=8x7B bash examples/mixtral/train_mixtral.sh
#   bash examples/mixtral/train_mixtral.sh           # no GPU, no MODEL_SIZE: tiny MoE on CPU (gloo)
#
# Environment: that of examples/llama/train_llama3.sh (MBS BS TP PP VPP CP SEQ_LENGTH TOTAL_ITERS LR
# RECOMPUTE USE_FLASH_ATTN TE_FP8 ENABLE_PROFILING NO_TORCH_COMPILE GEMM_TUNING DATA_PATH
# TOKENIZER_MODEL DATA_CACHE_PATH CKPT_DIR LOAD_DIR SAVE_INTERVAL MASTER_ADDR NNODES NODE_RANK NPROC
# TEE_OUTPUT LOG_DIR EXTRA_ARGS DRY_RUN; see its header), plus:
#   MODEL_SIZE      8x7B | 8x22B | tiny                                    [8x7B with a GPU, tiny without]
#   EP              expert-parallel size: experts split over data/context ranks  [8 for 8x7B/8x22B; 1 tiny]
#   ETP             expert-tensor-parallel size, 1 or TP                    [TP]
#   MOE_DISPATCHER  alltoall | allgather (--moe-token-dispatcher-type)      [alltoall]
#   MOE_AUX_LOSS    load-balancing loss coefficient (--moe-aux-loss-coeff) [1e-2]
#   MOE_LAYER_RECOMPUTE 1: recompute the MoE blocks in backward             [0]
# FSDP=1 is refused with experts (use the distributed optimizer, on by default with DP > 1).
# Slurm: MODEL=mixtral sbatch examples/llama/train_llama_slurm.sh 8x7B MBS BS_PER_NODE SEQ ITERS 0 RECOMPUTE
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEFAULT_GPU_MODEL_SIZE=8x7B
DEFAULT_SEQ_LENGTH=4096
if [ "${MODEL_SIZE:-}" != tiny ] && command -v nvidia-smi >/dev/null 2>&1; then EP=${EP:-8}; fi
source "$ROOT/examples/llama/common.sh"
MOE_DISPATCHER=${MOE_DISPATCHER:-alltoall}
MOE_AUX_LOSS=${MOE_AUX_LOSS:-1e-2}
MOE_LAYER_RECOMPUTE=${MOE_LAYER_RECOMPUTE:-0}

case "$MODEL_SIZE" in
  8x7B)  MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
                     --group-query-attention --num-query-groups 8 --num-experts 8) ; VOCAB=32000 ;;
  8x22B) MODEL_ARGS=(--num-layers 56 --hidden-size 6144 --ffn-hidden-size 16384 --num-attention-heads 48
                     --group-query-attention --num-query-groups 8 --num-experts 8) ; VOCAB=32768 ;;
  tiny)  MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
                     --group-query-attention --num-query-groups 2 --num-experts 4) ; VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 8x7B, 8x22B or tiny for Mixtral (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
MODEL_ARGS+=(--max-position-embeddings "$((SEQ_LENGTH > 32768 ? SEQ_LENGTH : 32768))" --position-embedding-type rope
             --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
             --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
             --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff "$MOE_AUX_LOSS"
             --moe-grouped-gemm --moe-token-dispatcher-type "$MOE_DISPATCHER")
if [ "$MOE_LAYER_RECOMPUTE" = 1 ]; then MODEL_ARGS+=(--moe-layer-recompute); fi
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
