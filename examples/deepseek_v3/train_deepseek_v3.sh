#!/usr/bin/env bash
# Train DeepSeek-V3-shaped models (multi-latent attention, 256 fine-grained experts with a shared
# expert, sigmoid routing with expert bias, group-limited top-8) with pretrain_gpt.py under torchrun.
#
#   EP=8 MBS=1 BS=64 SEQ_LENGTH=4096 MODEL_SIZE=proxy bash examples/deepseek_v3/train_deepseek_v3.sh
#   EP=64 PP=16 NNODES=128 NODE_RANK=... MASTER_ADDR=... MODEL_SIZE=671B bash examples/deepseek_v3/train_deepseek_v3.sh
#   bash examples/deepseek_v3/train_deepseek_v3.sh   # no GPU, no MODEL_SIZE: tiny DeepSeek-shaped model on CPU
#
# Environment: that of examples/llama/train_llama3.sh (see its header), plus:
#   MODEL_SIZE      671B | proxy | tiny                                     [proxy with a GPU, tiny without]
#   NUM_LAYERS      layers of the proxy (full width, the first dense)       [4]
#   EP              expert-parallel size                                    [8 with a GPU; 1 tiny]
#   ETP             expert-tensor-parallel size, 1 or TP                    [TP]
#   MOE_DISPATCHER  alltoall | allgather                                    [alltoall]
#   MOE_AUX_LOSS    sequence-level load-balancing loss coefficient          [1e-4]
#   MOE_LAYER_RECOMPUTE 1: recompute the MoE blocks in backward             [0]
# 671B is DeepSeek-V3's 61 layers (the first 3 dense); `proxy` keeps every width and the routing at
# NUM_LAYERS layers (the first dense), as the proxy configurations of Megatron-LM for ROCm do, so
# one node measures a layer's speed. Not built yet (docs/models.md): multi-token prediction
# (--mtp-num-layers), so this trains the main model. It uses plain RoPE at DeepSeek-V3's pretraining
# context of 4096; with SEQ_LENGTH above it, DeepSeek-V3's YaRN context extension (--rope-type yarn,
# factor 40 over 4096, mscale and mscale-all-dim 1, beta 32 and 1, as its config.json).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEFAULT_GPU_MODEL_SIZE=proxy
DEFAULT_SEQ_LENGTH=4096
if [ "${MODEL_SIZE:-}" != tiny ] && command -v nvidia-smi >/dev/null 2>&1; then EP=${EP:-8}; fi
source "$ROOT/examples/llama/common.sh"
MOE_DISPATCHER=${MOE_DISPATCHER:-alltoall}
MOE_AUX_LOSS=${MOE_AUX_LOSS:-1e-4}
MOE_LAYER_RECOMPUTE=${MOE_LAYER_RECOMPUTE:-0}
NUM_LAYERS=${NUM_LAYERS:-4}

FULL_WIDTH=(--hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --q-lora-rank 1536
            --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --num-experts 256
            --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
            --moe-router-num-groups 8 --moe-router-group-topk 4)
case "$MODEL_SIZE" in
  671B)  MODEL_ARGS=("${FULL_WIDTH[@]}" --num-layers 61 --moe-layer-freq "[0]*3+[1]*58") ; VOCAB=129280 ;;
  proxy) MODEL_ARGS=("${FULL_WIDTH[@]}" --num-layers "$NUM_LAYERS" --moe-layer-freq "[0]*1+[1]*$((NUM_LAYERS - 1))")
         VOCAB=129280 ;;
  tiny)  MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 --q-lora-rank 64
                     --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --num-experts 16
                     --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --moe-router-topk 4
                     --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-layer-freq "[0]*1+[1]*3")
         VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 671B, proxy or tiny for DeepSeek-V3 (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
MODEL_ARGS+=(--multi-latent-attention --qk-layernorm --max-position-embeddings "$((SEQ_LENGTH > 4096 ? SEQ_LENGTH : 4096))"
             --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
             --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
             --init-method-std 0.006 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
             --moe-router-bias-update-rate 1e-3 --moe-router-topk-scaling-factor 2.5
             --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff "$MOE_AUX_LOSS"
             --moe-grouped-gemm --moe-token-dispatcher-type "$MOE_DISPATCHER")
if [ "$MOE_LAYER_RECOMPUTE" = 1 ]; then MODEL_ARGS+=(--moe-layer-recompute); fi
if [ "$SEQ_LENGTH" -gt 4096 ]; then
  MODEL_ARGS+=(--rope-type yarn --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
               --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1)
fi
# 61 layers over 16 pipeline stages: 3 on the first (with the embedding), 2 on the last (with the
# output layer), 4 on each other stage. Other uneven splits: the same two flags in EXTRA_ARGS.
if [ "$MODEL_SIZE" = 671B ] && [ "$PP" = 16 ]; then
  MODEL_ARGS+=(--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2)
fi
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
