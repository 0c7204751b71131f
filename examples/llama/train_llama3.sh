#!/usr/bin/env bash
# Train Llama 3 / 3.1 (or a tiny Llama on CPU) with pretrain_gpt.py under torchrun.
#
#   TP=2 MBS=1 BS=64 SEQ_LENGTH=8192 MODEL_SIZE=8 bash examples/llama/train_llama3.sh
#   bash examples/llama/train_llama3.sh            # no GPU, no MODEL_SIZE: tiny model on CPU (gloo)
#
# Environment (defaults in brackets), with Megatron-LM for ROCm's meanings where it has them:
#   MODEL_SIZE      8 | 70 | tiny            [8 with a GPU, tiny without]
#   LLAMA_VERSION   3 | 3.1 (3.1 adds RoPE frequency scaling)            [3]
#   MBS             micro-batch size per GPU                              [1; tiny: 8]
#   BS              global batch size                    [8 x MBS x data-parallel size; tiny: MBS x DP]
#   TP, PP          tensor / pipeline parallel sizes                      [1, 1]
#   VPP             virtual pipeline stages per rank (interleaved 1F1B)   [1]
#   CP              context parallel size (--context-parallel-size)       [1]
#   SEQ_LENGTH      tokens per sample                                     [8192; tiny: 128]
#   TOTAL_ITERS     optimizer steps                                       [10; tiny: 100]
#   LR              peak learning rate (cosine decay to LR/10)            [3e-4; tiny: 2e-3]
#   RECOMPUTE       1: full activation recomputation of every layer       [0]
#   FSDP            1: shard with PyTorch FSDP2                           [0]
#   USE_FLASH_ATTN  1: use the flash-attn package if installed            [0]
#   TE_FP8          1: FP8 training (hybrid format, delayed scaling; torch._scaled_mm)   [0]
#   ENABLE_PROFILING 1: PyTorch-profile one iteration mid-run; Chrome trace in LOG_DIR/profiles  [0]
#   NO_TORCH_COMPILE 1: run RMSNorm/RoPE/SwiGLU eagerly (by default torch.compile'd on GPU)  [0]
#   GEMM_TUNING     1: PyTorch TunableOp picks the fastest GEMM per shape (CUDA and ROCm); the
#                   choices are kept in LOG_DIR/tunableop_results<GPU>.csv for later runs  [0]
#   DATA_PATH       dataset prefix (.bin/.idx)  [unset: the quickstart corpus for the tiny model when
#                   examples/quickstart/prepare.sh has built it, else --mock-data]
#   TOKENIZER_MODEL local Hugging Face tokenizer dir/json (with DATA_PATH)  []
#   DATA_CACHE_PATH directory for cached dataset indices                   [beside the data]
#   QUICKSTART_DIR  where the quickstart corpus is looked for             [quickstart_work]
#   CKPT_DIR        save checkpoints here and resume from the latest one in it; SIGTERM/SIGUSR1
#                   save and stop (--save/--load/--exit-signal-handler)   []
#   LOAD_DIR        resume from here instead of CKPT_DIR                  [CKPT_DIR]
#   SAVE_INTERVAL   iterations between saves (always one at the end)      [end only]
#   ASYNC_SAVE      1: write checkpoints in the background (--async-save) [0]
#   CKPT_KEEP       keep only this many latest checkpoints                [all]
#   SHUTDOWN_TIMEOUT seconds torchrun waits for workers to save after a signal [300]
#   MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK: the rendezvous; with NNODES > 1 it is torchrun's c10d
#                   rendezvous hosted by NODE_RANK 0 at MASTER_ADDR:MASTER_PORT  [localhost, 29500, 1, 0]
#   RDZV_ID         rendezvous id shared by the nodes of one job           [megatron-lite]
#   LOCAL_ADDR      the address other nodes reach this node at, when its host name does not resolve
#                   to it (torchrun --local-addr)                          [the host name]
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: the network interface for gloo / NCCL (passed to the workers)
#   NPROC           processes per node                                   [GPUs on the node; 2 on CPU]
#   TEE_OUTPUT      1: print the output and write it to a log file in LOG_DIR; 0: the log file only [1]
#   LOG_DIR         logs, profiles and TunableOp results                   [logs]
#   EXTRA_ARGS      any further pretrain_gpt.py flags                    []
#   DRY_RUN         1: print the torchrun command and stop               [0]
#   DRY_RUN_GPU     the GPU the pre-flight plan is for: h100-80gb, h200, a100-80gb, mi300x [this machine's, else h100-80gb]
# Before torchrun starts, `pretrain_gpt.py --dry-run` checks the flags and the data files for all
# NNODES x NPROC processes in one process, so a mistake is reported once, and prints the plan per GPU
# (memory term by term, verdict, predicted step time: docs/planning.md).
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
  tiny) MODEL_ARGS=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
                    --group-query-attention --num-query-groups 2) ; VOCAB=8192 ;;
  *) echo "MODEL_SIZE must be 8, 70 or tiny for Llama 3 (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
MODEL_ARGS+=(--max-position-embeddings "$((SEQ_LENGTH > 8192 ? SEQ_LENGTH : 8192))" --position-embedding-type rope
             --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
             --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02)
if [ "$LLAMA_VERSION" = "3.1" ]; then MODEL_ARGS+=(--use-rope-scaling); fi
TOKENIZER_TYPE=HuggingFaceTokenizer

run_training
