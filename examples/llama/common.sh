# Shared by train_llama2.sh and train_llama3.sh (sourced, not run): env defaults, the flag arrays
# that do not depend on the model, the torchrun launch and the end-of-run summary.

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  HAS_GPU=1; GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
else
  HAS_GPU=0; GPUS_PER_NODE=0
fi
if [ "$HAS_GPU" = 1 ]; then
  MODEL_SIZE=${MODEL_SIZE:-${DEFAULT_GPU_MODEL_SIZE:-8}}
else
  MODEL_SIZE=${MODEL_SIZE:-tiny}
fi
IS_TINY=$([ "$MODEL_SIZE" = tiny ] && echo 1 || echo 0)
TP=${TP:-1}
PP=${PP:-1}
VPP=${VPP:-1}
CP=${CP:-1}
MBS=${MBS:-$([ "$IS_TINY" = 1 ] && echo 4 || echo 1)}
SEQ_LENGTH=${SEQ_LENGTH:-$([ "$IS_TINY" = 1 ] && echo 128 || echo "${DEFAULT_SEQ_LENGTH:-8192}")}
TOTAL_ITERS=${TOTAL_ITERS:-$([ "$IS_TINY" = 1 ] && echo 60 || echo 10)}
RECOMPUTE=${RECOMPUTE:-0}
FSDP=${FSDP:-0}
USE_FLASH_ATTN=${USE_FLASH_ATTN:-0}
TE_FP8=${TE_FP8:-0}
NO_TORCH_COMPILE=${NO_TORCH_COMPILE:-0}
GEMM_TUNING=${GEMM_TUNING:-0}
ENABLE_PROFILING=${ENABLE_PROFILING:-0}
TEE_OUTPUT=${TEE_OUTPUT:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-}
CKPT_DIR=${CKPT_DIR:-}
LOAD_DIR=${LOAD_DIR:-$CKPT_DIR}
SAVE_INTERVAL=${SAVE_INTERVAL:-}
ASYNC_SAVE=${ASYNC_SAVE:-0}
CKPT_KEEP=${CKPT_KEEP:-}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
EXTRA_ARGS=${EXTRA_ARGS:-}
if [ "$HAS_GPU" = 1 ]; then
  NPROC=${NPROC:-$GPUS_PER_NODE}; BACKEND=nccl; PRECISION=(--bf16)
else
  NPROC=${NPROC:-2}; BACKEND=gloo; PRECISION=()
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
WORLD=$((NPROC * NNODES))

# Tensor-parallel collectives are issued before the GEMMs they overlap only with one CUDA queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

run_training() {
  DP=$((WORLD / (TP * PP * CP)))
  if [ "$DP" -lt 1 ] || [ $((DP * TP * PP * CP)) -ne "$WORLD" ]; then
    echo "TP=$TP x PP=$PP x CP=$CP does not divide the $WORLD processes (NPROC=$NPROC x NNODES=$NNODES)" >&2
    if [ "$MODEL_SIZE" = 70 ]; then
      echo "MODEL_SIZE=70 defaults to TP=8 x PP=4 (32 GPUs: NNODES=4 with 8 GPUs each); set TP/PP to change it" >&2
    fi
    exit 2
  fi
  BS=${BS:-$((8 * MBS * DP))}
  PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                 --context-parallel-size "$CP" --distributed-backend "$BACKEND")
  if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
  if [ "$VPP" -gt 1 ]; then PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
  if [ "$FSDP" = 1 ]; then PARALLEL_ARGS+=(--use-torch-fsdp2); elif [ "$DP" -gt 1 ]; then
    PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce); fi
  if [ "$RECOMPUTE" = 1 ]; then PARALLEL_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1); fi
  if [ "$USE_FLASH_ATTN" = 1 ]; then PARALLEL_ARGS+=(--use-flash-attn); fi
  if [ "$NO_TORCH_COMPILE" = 1 ]; then PARALLEL_ARGS+=(--no-torch-compile); fi
  if [ "$TE_FP8" = 1 ]; then
    # FP8 as the ROCm/Megatron scripts ask for it; without Transformer Engine the native FP8 GEMMs run.
    if [ "$HAS_GPU" = 0 ]; then PRECISION=(--bf16); fi
    PARALLEL_ARGS+=(--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed
                    --fp8-margin 0 --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
  fi

  TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$BS" --seq-length "$SEQ_LENGTH"
                 --train-iters "$TOTAL_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
                 --lr-warmup-iters "$((TOTAL_ITERS / 10))" --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
                 --clip-grad 1.0 "${PRECISION[@]}" --seed 1234)
  if [ -n "$DATA_PATH" ]; then
    if [ -z "$TOKENIZER_MODEL" ]; then echo "DATA_PATH needs TOKENIZER_MODEL" >&2; exit 2; fi
    DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
    if [ -n "$DATA_CACHE_PATH" ]; then DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH"); fi
  else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
  fi
  LOGGING_ARGS=(--log-interval 1 --log-throughput --eval-interval "$TOTAL_ITERS" --eval-iters 2)
  if [ "$ENABLE_PROFILING" = 1 ]; then
    # One step in the middle of the run, after warm-up, on rank 0: a Chrome trace under logs/.
    LOGGING_ARGS+=(--profile --use-pytorch-profiler --profile-step-start "$((TOTAL_ITERS / 2))"
                   --profile-step-end "$((TOTAL_ITERS / 2 + 1))" --profile-dir "$ROOT/logs/profiles")
  fi

  CKPT_ARGS=()
  if [ -n "$CKPT_DIR" ]; then
    # SIGTERM / SIGUSR1 (Slurm's --signal): finish the iteration, save, exit 0.
    CKPT_ARGS+=(--save "$CKPT_DIR" --exit-signal-handler)
    if [ -n "$SAVE_INTERVAL" ]; then CKPT_ARGS+=(--save-interval "$SAVE_INTERVAL"); fi
    if [ "$ASYNC_SAVE" = 1 ]; then CKPT_ARGS+=(--async-save); fi
    if [ -n "$CKPT_KEEP" ]; then CKPT_ARGS+=(--ckpt-keep-latest "$CKPT_KEEP"); fi
  fi
  if [ -n "$LOAD_DIR" ]; then CKPT_ARGS+=(--load "$LOAD_DIR"); fi

  LAUNCH=(torchrun --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
  if [ -n "$CKPT_DIR" ] && torchrun --help 2>/dev/null | grep -q -- "--signals-to-handle"; then
    # torchrun forwards these to the workers and gives them SHUTDOWN_TIMEOUT seconds to save.
    LAUNCH+=(--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT")
    trap '' USR1  # this shell and tee outlive the signal; torchrun installs its own handler
  fi
  mkdir -p "$ROOT/logs"
  LOG="$ROOT/logs/train_llama_${MODEL_SIZE}_tp${TP}_pp${PP}_cp${CP}_mbs${MBS}_bs${BS}_seq${SEQ_LENGTH}_$(date +%Y%m%d_%H%M%S).log"
  COMMAND=("${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
           "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CKPT_ARGS[@]}" $EXTRA_ARGS)
  echo "${COMMAND[*]}"
  if [ "${DRY_RUN:-0}" = 1 ]; then return 0; fi
  if [ "$TEE_OUTPUT" = 1 ]; then
    "${COMMAND[@]}" 2>&1 | tee "$LOG"
  else
    "${COMMAND[@]}" > "$LOG" 2>&1
  fi
  summarize "$LOG"
}

summarize() {
  # Mean over the logged iterations after the first (which includes warm-up / compilation).
  awk -F'|' '/ iteration +[0-9]+\// {
      for (i = 1; i <= NF; i++) {
        if ($i ~ /elapsed time per iteration/) { split($i, a, ":"); ms = a[2] }
        if ($i ~ /TFLOP\/s\/GPU/) { split($i, b, ":"); tf = b[2] }
        if ($i ~ /tokens\/s\/GPU/) { split($i, c, ":"); tok = c[2] }
      }
      n++; if (n > 1) { sms += ms; stf += tf; stok += tok; m++ }
    }
    END {
      if (m == 0) { print "no iterations logged (see the log above)"; exit 1 }
      printf "mean elapsed time per iteration (ms): %.1f\n", sms / m
      printf "mean throughput per GPU (TFLOP/s/GPU): %.2f\n", stf / m
      printf "mean tokens per GPU (tokens/s/GPU): %.1f\n", stok / m
    }' "$1"
}
