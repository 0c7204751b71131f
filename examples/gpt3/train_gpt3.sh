#!/usr/bin/env bash
# Train a GPT-3 model with pretrain_gpt.py under torchrun, laid out as Megatron-LM's
# examples/gpt3/train_gpt3_175b_distributed.sh (same positional arguments and flag arrays):
#
#   MODEL_SIZE=1.3B bash examples/gpt3/train_gpt3.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH
#   MODEL_SIZE=tiny bash examples/gpt3/train_gpt3.sh            # CPU, mock data, a few seconds
#
# Shapes, batch sizes and learning rates are the GPT-3 paper's (Brown et al. 2020, table 2.1); the
# schedule is its: 300B tokens, cosine decay to 10% over 260B, warmup over 375M, the batch size
# ramped up over the first 12B tokens, sequences of 2048, Adam (0.9, 0.95), weight decay 0.1,
# gradient clipping 1.0. Everything is counted in samples of 2048 tokens, as Megatron-LM's
# sample-based flags take it.
#
#   MODEL_SIZE  layers  hidden  heads  head dim  batch (samples)  lr       default TP x PP
#   125M        12      768     12     64        256              6.0e-4   1 x 1
#   350M        24      1024    16     64        256              3.0e-4   1 x 1
#   760M        24      1536    16     96        256              2.5e-4   1 x 1
#   1.3B        24      2048    16     128       512              2.0e-4   1 x 1
#   2.7B        32      2560    32     80        512              1.6e-4   2 x 1
#   6.7B        32      4096    32     128       1024             1.2e-4   4 x 1
#   13B         40      5120    40     128       1024             1.0e-4   8 x 1
#   175B        96      12288   96     128       1536             0.6e-4   8 x 16
#   tiny        2       64      4      16        16               6.0e-4   1 x 1 (CPU smoke test)
# (The paper prints 1.3B with 24 heads of 128 channels, which would make 1.5B parameters; 16 heads of
# 128 give the 1.3B it reports. It prints 13B's hidden size as 5140; 40 heads of 128 make 5120.)
#
# Environment: MODEL_SIZE [1.3B with a GPU, tiny without], TP, PP, MBS [1; tiny 2],
# TRAIN_SAMPLES [146484375 = 300B tokens; tiny 320], NPROC [GPUs; 2 on CPU], NNODES [1],
# NODE_RANK [0], MASTER_ADDR [localhost], MASTER_PORT [6000], RDZV_ID, LOG_DIR [logs],
# EXTRA_ARGS, DRY_RUN (1: print the command and stop). Without DATA_PATH: mock data.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

CHECKPOINT_PATH=${1:-}
TENSORBOARD_LOGS_PATH=${2:-}
VOCAB_FILE=${3:-}
MERGE_FILE=${4:-}
DATA_PATH=${5:-}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | wc -l); BACKEND=nccl; PRECISION=(--fp16); DEFAULT_SIZE=1.3B
else
  GPUS=0; BACKEND=gloo; PRECISION=(); DEFAULT_SIZE=tiny; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
MODEL_SIZE=${MODEL_SIZE:-$DEFAULT_SIZE}
NPROC=${NPROC:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
RDZV_ID=${RDZV_ID:-megatron-lite-gpt3}
LOG_DIR=${LOG_DIR:-$ROOT/logs}
EXTRA_ARGS=${EXTRA_ARGS:-}

#                 layers hidden heads kv  batch lr      TP PP
case "$MODEL_SIZE" in
  125M) SHAPE=(12 768    12    64  256   6.0e-4  1  1) ;;
  350M) SHAPE=(24 1024   16    64  256   3.0e-4  1  1) ;;
  760M) SHAPE=(24 1536   16    96  256   2.5e-4  1  1) ;;
  1.3B) SHAPE=(24 2048   16    128 512   2.0e-4  1  1) ;;
  2.7B) SHAPE=(32 2560   32    80  512   1.6e-4  2  1) ;;
  6.7B) SHAPE=(32 4096   32    128 1024  1.2e-4  4  1) ;;
  13B)  SHAPE=(40 5120   40    128 1024  1.0e-4  8  1) ;;
  175B) SHAPE=(96 12288  96    128 1536  0.6e-4  8  16) ;;
  tiny) SHAPE=(2  64     4     16  16    6.0e-4  1  1) ;;
  *) echo "MODEL_SIZE must be one of 125M 350M 760M 1.3B 2.7B 6.7B 13B 175B tiny (got '$MODEL_SIZE')" >&2; exit 2 ;;
esac
TP=${TP:-${SHAPE[6]}}
PP=${PP:-${SHAPE[7]}}
GLOBAL_BATCH=${BS:-${SHAPE[4]}}
if [ "$MODEL_SIZE" = tiny ]; then
  SEQ=64; MBS=${MBS:-2}; TRAIN_SAMPLES=${TRAIN_SAMPLES:-320}
  DECAY_SAMPLES=$((TRAIN_SAMPLES * 26 / 30)); WARMUP_SAMPLES=32; RAMPUP=(4 4 64)
else
  # 300B tokens; decay over 260B; warmup over 375M; ramp from 32 sequences up over 12B tokens
  SEQ=2048; MBS=${MBS:-1}; TRAIN_SAMPLES=${TRAIN_SAMPLES:-146484375}
  DECAY_SAMPLES=$((TRAIN_SAMPLES * 26 / 30)); WARMUP_SAMPLES=183105; RAMPUP=(32 32 5859375)
fi

DISTRIBUTED_ARGS=(--nproc_per_node "$NPROC" --nnodes "$NNODES")
if [ "$NNODES" -gt 1 ]; then
  DISTRIBUTED_ARGS+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
                     --rdzv-conf "is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
else
  DISTRIBUTED_ARGS+=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi

GPT_MODEL_ARGS=(
    --num-layers "${SHAPE[0]}"
    --hidden-size "${SHAPE[1]}"
    --num-attention-heads "${SHAPE[2]}"
    --kv-channels "${SHAPE[3]}"
    --seq-length "$SEQ"
    --max-position-embeddings "$SEQ"
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GLOBAL_BATCH"
    --rampup-batch-size "${RAMPUP[@]}"
    --train-samples "$TRAIN_SAMPLES"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    "${PRECISION[@]}"
    --lr "${SHAPE[5]}"
    --lr-decay-style cosine
    --min-lr "$(awk -v lr="${SHAPE[5]}" 'BEGIN{print lr / 10}')"
    --lr-warmup-samples "$WARMUP_SAMPLES"
    --lr-decay-samples "$DECAY_SAMPLES"
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --distributed-backend "$BACKEND"
)
if [ "$TP" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi

if [ -n "$DATA_PATH" ]; then
  DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1)
else
  echo "data: mock (random tokens: the loss stays near ln(50257) = 10.8); pass DATA_PATH and the GPT-2 vocab/merges to learn"
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi

EVAL_AND_LOGGING_ARGS=(--log-interval "$([ "$MODEL_SIZE" = tiny ] && echo 5 || echo 100)" --log-throughput
                       --eval-interval 1000 --eval-iters 10)
if [ -n "$CHECKPOINT_PATH" ]; then
  EVAL_AND_LOGGING_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 10000 --exit-signal-handler)
fi
if [ -n "$TENSORBOARD_LOGS_PATH" ]; then EVAL_AND_LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_LOGS_PATH"); fi

FLAGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
       "${EVAL_AND_LOGGING_ARGS[@]}" $EXTRA_ARGS)
COMMAND=(torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" "${FLAGS[@]}")
echo "${COMMAND[*]}"
if [ "${DRY_RUN:-0}" = 1 ]; then exit 0; fi
# The flags, data files and memory, checked for all processes in one process before torchrun starts.
WORLD_SIZE=$((NPROC * NNODES)) LOCAL_WORLD_SIZE=$NPROC ${PYTHON:-python} "$ROOT/pretrain_gpt.py" "${FLAGS[@]}" --dry-run
mkdir -p "$LOG_DIR"
"${COMMAND[@]}" 2>&1 | tee "$LOG_DIR/train_gpt3_${MODEL_SIZE}_tp${TP}_pp${PP}_$(date +%Y%m%d_%H%M%S).log"
