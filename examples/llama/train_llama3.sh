#!/usr/bin/env bash
# Train Llama 3 / 3.1 (or a tiny Llama on CPU) with pretrain_gpt.py under torchrun.
#
#   TP=2 MBS=2 BS=64 SEQ_LENGTH=8192 MODEL_SIZE=8 bash examples/llama/train_llama3.sh
#   bash examples/llama/train_llama3.sh            # no GPU, no MODEL_SIZE: tiny model on CPU (gloo)
#
# Environment (defaults in brackets):
#   MODEL_SIZE      8 | 70 | tiny            [8 with a GPU, tiny without]
#   LLAMA_VERSION   3 | 3.1 (3.1 adds RoPE frequency scaling)            [3]
#   MBS             micro-batch size per GPU                              [1; tiny: 4]
#   BS              global batch size                                     [8 x MBS x data-parallel size]
#   TP, PP          tensor / pipeline parallel sizes                      [1, 1]
#   VPP             virtual pipeline stages per rank (interleaved 1F1B)   [1]
#   CP              context parallel size (--context-parallel-size; ring attention) [1]
#   SEQ_LENGTH      tokens per sample                                     [8192; tiny: 128]
#   TOTAL_ITERS     optimizer steps                                       [10; tiny: 60]
#   RECOMPUTE       1: full activation recomputation of every layer       [0]
#   FSDP            1: shard with PyTorch FSDP2                           [0]
#   USE_FLASH_ATTN  1: use the flash-attn package if installed            [0]
#   TE_FP8          1: FP8 training (hybrid format, delayed scaling; torch._scaled_mm)   [0]
#   ENABLE_PROFILING 1: PyTorch-profile one iteration mid-run; Chrome trace in logs/profiles  [0]
#   NO_TORCH_COMPILE 1: run RMSNorm/RoPE/SwiGLU eagerly (by default torch.compile'd on GPU)  [0]
#   GEMM_TUNING     accepted; no effect yet.
#   DATA_PATH       dataset prefix (.bin/.idx); unset: --mock-data         []
#   TOKENIZER_MODEL local Hugging Face tokenizer dir/json (with DATA_PATH)  []
#   DATA_CACHE_PATH directory for cached dataset indices                   []
#   CKPT_DIR        save checkpoints here and resume from the latest one in it; SIGTERM/SIGUSR1
#                   save and stop (--save/--load/--exit-signal-handler)   []
#   LOAD_DIR        resume from here instead of CKPT_DIR                  [CKPT_DIR]
#   SAVE_INTERVAL   iterations between saves (always one at the end)      [end only]
#   ASYNC_SAVE      1: write checkpoints in the background (--async-save) [0]
#   CKPT_KEEP       keep only this many latest checkpoints                [all]
#   SHUTDOWN_TIMEOUT seconds torchrun waits for workers to save after a signal [300]
#   MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK: multi-node rendezvous   [localhost, 29500, 1, 0]
#   NPROC           processes per node                                   [GPUs on the node; 2 on CPU]
#   TEE_OUTPUT      1: also write the log to a file under logs/          [1]
#   EXTRA_ARGS      any further pretrain_gpt.py flags                    []
#   DRY_RUN         1: print the torchrun command and stop               [0]
# At the end it prints the mean elapsed ms/iteration, TFLOP/s/GPU and tokens/s/GPU of the run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
LLAMA_VERSION=${LLAMA_VERSION:-3}
# 70B: tensor parallel within a node, 4 pipeline stages across nodes (the memory arithmetic is in
# docs/parallelism.md, "Default layout for 70B"); TP and PP from the environment win.
if [ "${MODEL_SIZE:-}" = 70 ]; then TP=${TP:-8}; PP=${PP:-4}; fi
source "$ROOT/examples/llama/common.sh"

case "$MODEL_SIZE" in
  8)  MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
                  --group-query-attention --num-query-groups 8) ; VOCAB=128256 ;;
  70) MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
                  --group-query-attention --num-query-groups 8) ; VOCAB=128256 ;;
  tiny) MODEL_ARGS=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8
                    --group-query-attention --num-query-groups 4) ; VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 8, 70 or tiny for Llama 3 (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
MODEL_ARGS+=(--max-position-embeddings "$((SEQ_LENGTH > 8192 ? SEQ_LENGTH : 8192))" --position-embedding-type rope
             --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
             --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02)
if [ "$LLAMA_VERSION" = "3.1" ]; then MODEL_ARGS+=(--use-rope-scaling); fi
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
