#!/usr/bin/env bash
# Fine-tune a Hugging Face Llama 3 / 3.1 / 3.2 (or any model tools/checkpoint/convert.py reads) on
# conversations with --sft, then export a Hugging Face directory that chats (docs/finetuning.md).
#
#   HF_MODEL=./Llama-3.2-1B-Instruct DATA=data/chat.jsonl TP=2 bash examples/llama/finetune_llama3.sh
#
# Steps: (1) convert HF_MODEL into this framework's checkpoint format in WORK_DIR/base (once);
# (2) train with pretrain_gpt.py --load WORK_DIR/base --finetune --use-checkpoint-args --sft, saving in
# WORK_DIR/sft; (3) export the last checkpoint to HF_OUT with HF_MODEL's tokenizer, chat template
# included, so transformers' pipeline("text-generation") chats with it. With SFT=0 the same script
# continues pretraining from the Hugging Face weights on DATA, .bin/.idx prefixes tokenized with
# HF_MODEL's tokenizer (tools/preprocess_data.py).
#
# Environment (defaults in brackets):
#   HF_MODEL      local Hugging Face model directory (config.json, safetensors, tokenizer)   [required]
#   DATA          SFT=1: JSONL conversation files or tools/preprocess_sft.py prefixes, weighted or
#                 not ("0.7 a.jsonl 0.3 b.jsonl"); SFT=0: .bin/.idx prefixes                   [required]
#   SFT           1: supervised fine-tuning on conversations; 0: continued pretraining         [1]
#   PROMPT_FORMAT --sft-tokenizer-prompt-format: chat-template | identity                     [chat-template]
#   WORK_DIR      the converted model (WORK_DIR/base) and this run's checkpoints (WORK_DIR/sft) [finetune_work]
#   HF_OUT        the exported Hugging Face directory (must not exist yet)                     [WORK_DIR/hf]
#   TP, PP, CP    tensor / pipeline / context parallel sizes                                   [1, 1, 1]
#   MBS           micro-batch size (packed sequences per GPU)                                  [1]
#   BS            global batch size                                        [8 x MBS x data-parallel size]
#   SEQ_LENGTH    tokens per packed sequence                                                   [4096]
#   TOTAL_ITERS   optimizer steps                                                              [1000]
#   LR            peak learning rate (cosine decay to LR/10 after a 3% warm-up)                [1e-5]
#   SPLIT         train/validation/test proportions of DATA                                    [98,2,0]
#   EVAL_INTERVAL iterations between validation losses (on assistant tokens only)              [TOTAL_ITERS]
#   NPROC, MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, RDZV_ID, LOG_DIR, TEE_OUTPUT: as in train_llama3.sh
#   EXTRA_ARGS    further pretrain_gpt.py flags                                                []
#   DRY_RUN       1: print the commands and stop                                               [0]
# On a machine without a GPU it runs on CPU (gloo, fp32); with one, in bf16.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MBS=${MBS:-1}
DEFAULT_SEQ_LENGTH=4096
TOTAL_ITERS=${TOTAL_ITERS:-1000}
SEQ_LENGTH=${SEQ_LENGTH:-$DEFAULT_SEQ_LENGTH}
source "$ROOT/examples/llama/common.sh"
PYTHON=${PYTHON:-python}
HF_MODEL=${HF_MODEL:?set HF_MODEL to a local Hugging Face model directory}
DATA=${DATA:?set DATA to JSONL conversation files (or .bin/.idx prefixes with SFT=0)}
SFT=${SFT:-1}
PROMPT_FORMAT=${PROMPT_FORMAT:-chat-template}
WORK_DIR=${WORK_DIR:-finetune_work}
HF_OUT=${HF_OUT:-$WORK_DIR/hf}
LR=${LR:-1e-5}
SPLIT=${SPLIT:-98,2,0}
EVAL_INTERVAL=${EVAL_INTERVAL:-$TOTAL_ITERS}

DP=$((WORLD / (TP * PP * CP)))
if [ "$DP" -lt 1 ] || [ $((DP * TP * PP * CP)) -ne "$WORLD" ]; then
  echo "TP=$TP x PP=$PP x CP=$CP does not divide the $WORLD processes (NPROC=$NPROC x NNODES=$NNODES)" >&2
  exit 2
fi
BS=${BS:-$((8 * MBS * DP))}

CONVERT_IN=("$PYTHON" "$ROOT/tools/checkpoint/convert.py" --source-format hf --source "$HF_MODEL"
            --target "$WORK_DIR/base")
CONVERT_OUT=("$PYTHON" "$ROOT/tools/checkpoint/convert.py" --source-format torch_dist --source "$WORK_DIR/sft"
             --target-format hf --target "$HF_OUT")

# The architecture comes from the converted checkpoint (--use-checkpoint-args); the rest is training.
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --context-parallel-size "$CP" --distributed-backend "$BACKEND")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ "$DP" -gt 1 ]; then PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce); fi
TRAINING_ARGS=(--load "$WORK_DIR/base" --finetune --use-checkpoint-args --save "$WORK_DIR/sft"
               --micro-batch-size "$MBS" --global-batch-size "$BS" --seq-length "$SEQ_LENGTH"
               --train-iters "$TOTAL_ITERS" --lr "$LR" --min-lr "$(awk -v lr="$LR" 'BEGIN{print lr / 10}')"
               --lr-decay-style cosine --lr-warmup-iters "$((TOTAL_ITERS * 3 / 100))" --weight-decay 0.0
               --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0
               --calculate-per-token-loss "${PRECISION[@]}" --seed 1234)
DATA_ARGS=(--data-path $DATA --split "$SPLIT" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL")
if [ "$SFT" = 1 ]; then DATA_ARGS+=(--sft --sft-tokenizer-prompt-format "$PROMPT_FORMAT"); fi
LOGGING_ARGS=(--log-interval "$(( TOTAL_ITERS < 100 ? 1 : TOTAL_ITERS / 100 ))" --log-throughput
              --eval-interval "$EVAL_INTERVAL" --eval-iters 4)
FLAGS=("${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" $EXTRA_ARGS)

launcher
COMMAND=("${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${FLAGS[@]}")
echo "${CONVERT_IN[*]}"
echo "${COMMAND[*]}"
echo "${CONVERT_OUT[*]}"
if [ "${DRY_RUN:-0}" = 1 ]; then exit 0; fi

if [ -f "$WORK_DIR/base/latest_checkpointed_iteration.txt" ]; then
  echo "using the converted model in $WORK_DIR/base"
else
  "${CONVERT_IN[@]}"
fi
if ! WORLD_SIZE=$WORLD LOCAL_WORLD_SIZE=$NPROC "$PYTHON" "$ROOT/pretrain_gpt.py" "${FLAGS[@]}" --dry-run \
     --dry-run-gpu "${DRY_RUN_GPU:-$(dry_run_gpu)}" > /dev/null; then
  echo "stopped before starting torchrun (the check above failed)" >&2
  exit 2
fi
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/finetune_llama_tp${TP}_pp${PP}_cp${CP}_mbs${MBS}_bs${BS}_seq${SEQ_LENGTH}_$(date +%Y%m%d_%H%M%S).log"
if [ "$TEE_OUTPUT" = 1 ]; then
  "${COMMAND[@]}" 2>&1 | tee "$LOG"
else
  "${COMMAND[@]}" > "$LOG" 2>&1
fi
"${CONVERT_OUT[@]}"
echo "fine-tuned model: $HF_OUT (transformers.pipeline(\"text-generation\", model=\"$HF_OUT\"))"
