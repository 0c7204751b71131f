# Shared by train_llama2.sh and train_llama3.sh (sourced, not run): env defaults, the flag arrays
# that do not depend on the model, the flag check, the torchrun launch and the end-of-run summary.

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  HAS_GPU=1; GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
elif [ -e /dev/kfd ] && GPUS_PER_NODE=$(${PYTHON:-python} -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) \
     && [ "$GPUS_PER_NODE" -gt 0 ]; then
  HAS_GPU=1  # ROCm: PyTorch's HIP build counts the GPUs
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
EP=${EP:-1}    # expert-parallel size (mixture-of-experts scripts)
ETP=${ETP:-}   # expert-tensor-parallel size [TP]
MBS=${MBS:-$([ "$IS_TINY" = 1 ] && echo 8 || echo 1)}
SEQ_LENGTH=${SEQ_LENGTH:-$([ "$IS_TINY" = 1 ] && echo 128 || echo "${DEFAULT_SEQ_LENGTH:-8192}")}
TOTAL_ITERS=${TOTAL_ITERS:-$([ "$IS_TINY" = 1 ] && echo 100 || echo 10)}
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
RDZV_ID=${RDZV_ID:-megatron-lite}
LOCAL_ADDR=${LOCAL_ADDR:-}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-}
QUICKSTART_DIR=${QUICKSTART_DIR:-$ROOT/quickstart_work}
LOG_DIR=${LOG_DIR:-$ROOT/logs}
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

gemm_tuning() {
  # PyTorch TunableOp picks the fastest GEMM of the vendor libraries (cuBLAS/cuBLASLt on CUDA,
  # rocBLAS/hipBLASLt on ROCm) for every shape it meets, and records the choice in a file per GPU
  # that later runs with GEMM_TUNING=1 read back instead of tuning again.
  if [ "$GEMM_TUNING" != 1 ]; then return 0; fi
  if [ "$HAS_GPU" != 1 ]; then
    echo "GEMM_TUNING=1: TunableOp tunes GPU GEMMs (CUDA or ROCm); this machine has no GPU, so nothing is tuned"
    return 0
  fi
  mkdir -p "$LOG_DIR"
  export PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=${PYTORCH_TUNABLEOP_TUNING:-1}
  export PYTORCH_TUNABLEOP_FILENAME=${PYTORCH_TUNABLEOP_FILENAME:-$LOG_DIR/tunableop_results%d.csv}
  echo "GEMM_TUNING=1: PyTorch TunableOp on; GEMM choices are kept in $PYTORCH_TUNABLEOP_FILENAME (%d = GPU)"
}

data_args() {
  # DATA_PATH (with TOKENIZER_MODEL); else, for the tiny model, the quickstart corpus when it has
  # been built; else mock data.
  if [ -n "$DATA_PATH" ]; then
    if [ -z "$TOKENIZER_MODEL" ]; then echo "DATA_PATH needs TOKENIZER_MODEL" >&2; exit 2; fi
    DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
  elif [ "$IS_TINY" = 1 ] && [ -f "$QUICKSTART_DIR/stdlib_text_document.idx" ]; then
    echo "data: the quickstart corpus in $QUICKSTART_DIR (Python standard library sources, BPE tokenizer)"
    DATA_ARGS=(--data-path "$QUICKSTART_DIR/stdlib_text_document" --split 99,1,0 --tokenizer-type GPT2BPETokenizer
               --vocab-file "$QUICKSTART_DIR/tokenizer/vocab.json" --merge-file "$QUICKSTART_DIR/tokenizer/merges.txt")
  else
    echo "data: mock (random tokens, so the loss stays near ln($VOCAB) = $(awk -v v="$VOCAB" 'BEGIN{printf "%.2f", log(v)}');" \
         "set DATA_PATH and TOKENIZER_MODEL, or build the quickstart corpus: bash examples/quickstart/prepare.sh)"
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
  fi
  if [ -n "$DATA_CACHE_PATH" ]; then DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH"); fi
}

launcher() {
  # One node: static rendezvous on localhost. Several nodes: c10d rendezvous hosted by NODE_RANK 0
  # at MASTER_ADDR:MASTER_PORT (is_host tells the node that runs the store: MASTER_ADDR may be an
  # address the host does not know as its own name). GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when
  # set, pass to the workers unchanged and choose the network interface.
  LAUNCH=(torchrun --nproc_per_node "$NPROC" --nnodes "$NNODES")
  if [ "$NNODES" -gt 1 ]; then
    LAUNCH+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
             --rdzv-conf "is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
    # The address other nodes reach this one at (default: its host name)
    if [ -n "$LOCAL_ADDR" ]; then LAUNCH+=(--local-addr "$LOCAL_ADDR"); fi
  else
    LAUNCH+=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
  fi
  for variable in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
    if [ -n "${!variable:-}" ]; then echo "$variable=${!variable}"; export "${variable?}"; fi
  done
  if [ -n "$CKPT_DIR" ] && torchrun --help 2>/dev/null | grep -q -- "--signals-to-handle"; then
    # torchrun forwards these to the workers and gives them SHUTDOWN_TIMEOUT seconds to save.
    LAUNCH+=(--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT")
    trap '' USR1  # this shell and tee outlive the signal; torchrun installs its own handler
  fi
}

# The GPU the dry run's plan is for (a tools/plan.py preset): this machine's kind, else H100 80GB.
dry_run_gpu() {
  local name=""
  if [ "$HAS_GPU" = 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  fi
  case "$name" in
    *H200*) echo h200 ;;
    *A100*) echo a100-80gb ;;
    *) if [ "$HAS_GPU" = 1 ] && [ -e /dev/kfd ]; then echo mi300x; else echo h100-80gb; fi ;;
  esac
}

run_training() {
  DP=$((WORLD / (TP * PP * CP)))
  if [ "$DP" -lt 1 ] || [ $((DP * TP * PP * CP)) -ne "$WORLD" ]; then
    echo "TP=$TP x PP=$PP x CP=$CP does not divide the $WORLD processes (NPROC=$NPROC x NNODES=$NNODES)" >&2
    if [ "$MODEL_SIZE" = 70 ]; then
      echo "MODEL_SIZE=70 defaults to TP=8 x PP=4 (32 GPUs: NNODES=4 with 8 GPUs each); set TP/PP to change it" >&2
    fi
    exit 2
  fi
  BS=${BS:-$([ "$IS_TINY" = 1 ] && echo $((MBS * DP)) || echo $((8 * MBS * DP)))}
  LR=${LR:-$([ "$IS_TINY" = 1 ] && echo 2e-3 || echo 3e-4)}
  PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                 --context-parallel-size "$CP" --distributed-backend "$BACKEND")
  if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
  if [ "$EP" -gt 1 ]; then PARALLEL_ARGS+=(--expert-model-parallel-size "$EP"); fi
  if [ -n "$ETP" ]; then PARALLEL_ARGS+=(--expert-tensor-parallel-size "$ETP"); fi
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
                 --train-iters "$TOTAL_ITERS" --lr "$LR" --min-lr "$(awk -v lr="$LR" 'BEGIN{print lr / 10}')"
                 --lr-decay-style cosine --lr-warmup-iters "$((TOTAL_ITERS / 10))" --weight-decay 0.1
                 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 "${PRECISION[@]}" --seed 1234)
  data_args
  LOGGING_ARGS=(--log-interval "$([ "$IS_TINY" = 1 ] && echo 10 || echo 1)" --log-throughput
                --eval-interval "$TOTAL_ITERS" --eval-iters 2)
  if [ "$ENABLE_PROFILING" = 1 ]; then
    # One step in the middle of the run, after warm-up, on rank 0: a Chrome trace under LOG_DIR.
    LOGGING_ARGS+=(--profile --use-pytorch-profiler --profile-step-start "$((TOTAL_ITERS / 2))"
                   --profile-step-end "$((TOTAL_ITERS / 2 + 1))" --profile-dir "$LOG_DIR/profiles")
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

  launcher
  FLAGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
         "${CKPT_ARGS[@]}" $EXTRA_ARGS)
  COMMAND=("${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${FLAGS[@]}")
  echo "${COMMAND[*]}"
  if [ "${DRY_RUN:-0}" = 1 ]; then return 0; fi
  # The flags, data files and memory, checked for all WORLD processes in one process first: a
  # mistake is one message, not one per rank under torchrun.
  if ! WORLD_SIZE=$WORLD LOCAL_WORLD_SIZE=$NPROC ${PYTHON:-python} "$ROOT/pretrain_gpt.py" "${FLAGS[@]}" --dry-run \
       --dry-run-gpu "${DRY_RUN_GPU:-$(dry_run_gpu)}"; then
    echo "stopped before starting torchrun (the check above failed)" >&2
    exit 2
  fi
  gemm_tuning
  mkdir -p "$LOG_DIR"
  LOG="$LOG_DIR/train_llama_${MODEL_SIZE}_tp${TP}_pp${PP}_cp${CP}_mbs${MBS}_bs${BS}_seq${SEQ_LENGTH}_$(date +%Y%m%d_%H%M%S).log"
  if [ "$TEE_OUTPUT" = 1 ]; then
    "${COMMAND[@]}" 2>&1 | tee "$LOG"
  else
    "${COMMAND[@]}" > "$LOG" 2>&1
  fi
  summarize "$LOG"
}

summarize() {
  # Mean over the logged iterations after the first (which includes warm-up / compilation), or the
  # one line when only one was logged.
  awk -F'|' '/ iteration +[0-9]+\// {
      for (i = 1; i <= NF; i++) {
        if ($i ~ /elapsed time per iteration/) { split($i, a, ":"); ms = a[2] }
        if ($i ~ /TFLOP\/s\/GPU/) { split($i, b, ":"); tf = b[2] }
        if ($i ~ /tokens\/s\/GPU/) { split($i, c, ":"); tok = c[2] }
      }
      n++; if (n == 1) { fms = ms; ftf = tf; ftok = tok } else { sms += ms; stf += tf; stok += tok; m++ }
    }
    END {
      if (n == 0) { print "no iteration lines in this node'"'"'s log (global rank 0 prints them, on another node)"; exit }
      if (m == 0) { sms = fms; stf = ftf; stok = ftok; m = 1 }
      printf "mean elapsed time per iteration (ms): %.1f\n", sms / m
      printf "mean throughput per GPU (TFLOP/s/GPU): %.2f\n", stf / m
      printf "mean tokens per GPU (tokens/s/GPU): %.1f\n", stok / m
    }' "$1"
}
