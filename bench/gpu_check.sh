#!/usr/bin/env bash
# One command for whoever has a GPU: install, the benchmark presets in bf16 and FP8, each
# optimization's off-switch as an A/B, the GPU test lane, and one Markdown report.
#
#   bash bench/gpu_check.sh [--dry-run] [--tunableop] [--dense-ab] [REPORT.md]   # or GPU_CHECK_REPORT=REPORT.md
#     --dry-run    print the plan (each run with its predicted duration on one H100) and exit
#     --tunableop  also measure bf16 llama3-8b-8layers with PyTorch TunableOp (GEMMs tuned at start)
#     --dense-ab   also llama3.2-1b in bf16, llama3-8b-8layers in FP8 and two off-switch A/Bs on it
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh  # CPU smoke run of every step (tiny presets, no install)
#   GPU_CHECK_BUDGET (seconds, default 570), GPU_CHECK_MAX_RUNS (default all), PYTHON (default python3)
#   GPU_CHECK_ONLY (a bash regular expression): only the runs whose "name preset" matches, e.g.
#     GPU_CHECK_ONLY='^[^ ]+ (mixtral|qwen3|deepseek)' for the MoE runs alone
#
# Needs: a CUDA GPU with PyTorch (and Triton) installed; no internet (the project installs with
# --no-deps --no-build-isolation, or runs from the source tree if that fails). Steps, in order, each
# with a time limit so the whole run fits one 10-minute command (GPU_CHECK_BUDGET, default 570 s):
#   1. pip install --no-build-isolation --no-deps -e .
#   2. bench_pretrain.py, in the order of bench/gpu_plan.py: llama3-8b-8layers in bf16 [and, with
#      --dense-ab, llama3.2-1b, and llama3-8b-8layers in FP8 (hybrid, delayed)], the MoE presets
#      mixtral-8x7b-2layers, qwen3-30b-a3b-4layers and deepseek-v3-4layers in bf16, Mixtral's again
#      with --moe-grouped-wgrad per-expert, Qwen3-MoE's with --moe-permute-fusion --moe-router-fusion,
#      mixtral-8x7b-2layers in FP8 (hybrid tensorwise with the gradient GEMMs grouped and with
#      --moe-grouped-wgrad per-expert, then e4m3), each MoE run with one more step under
#      torch.profiler (--profile: its top kernels
#      and CPU/GPU time ratio go to the run's log and the report), [--tunableop: bf16 with TunableOp,]
#      [--dense-ab: the --no-torch-compile and --no-gradient-accumulation-fusion A/Bs on the 8B preset].
#      Each run is limited to 1.5x its predicted duration (at least +30 s); a run that no longer fits
#      is skipped and logged.
#   3. pytest -m gpu (tests/gpu; a small built-in runner if pytest is not installed) with the time left
#   4. bench/gpu_report.py writes the report: device, versions, the test lane's outcome and, per
#      run, TFLOP/s/GPU, MFU, tokens/s/GPU, peak memory and the fast paths that ran; each run with
#      flags as a speed-up over its preset's plain bf16 run (the A/Bs); per MoE run the profiled
#      step's top kernels and CPU-time / GPU-time ratio.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PLAN_ONLY=0
PLAN_ARGS=()
REPORT_ARG=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) PLAN_ONLY=1 ;;
    --tunableop) PLAN_ARGS+=(--tunableop) ;;
    --dense-ab) PLAN_ARGS+=(--dense-ab) ;;
    -*) echo "bench/gpu_check.sh: unknown option $arg (options: --dry-run, --tunableop, then REPORT.md)" >&2; exit 2 ;;
    *) REPORT_ARG=$arg ;;
  esac
done
REPORT=${REPORT_ARG:-${GPU_CHECK_REPORT:-$ROOT/gpu_check_report.md}}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET:-570}
MAX_RUNS=${GPU_CHECK_MAX_RUNS:-99}   # benchmark runs to do at most (the smoke test does one)
ONLY=${GPU_CHECK_ONLY:-}             # a regular expression over "name preset": the runs to do
LANE_MIN=60                          # seconds the test lane needs at least
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # collectives issued before the GEMMs they overlap

if [ "$PLAN_ONLY" = 1 ]; then
  exec "$PYTHON" bench/gpu_plan.py --budget "$BUDGET" "${PLAN_ARGS[@]}"
fi
WORK=$(mktemp -d)
export PYTORCH_TUNABLEOP_FILENAME="$WORK/tunableop_results%d.csv"   # read only by the --tunableop run
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
log() { echo "[gpu_check $((SECONDS - START))s] $*" | tee -a "$WORK/steps.log"; }

# 1. install
if [ "$DRY_RUN" = 1 ]; then
  log "dry run: install skipped (running from the source tree)"
elif "$PYTHON" -m pip install --no-build-isolation --no-deps -q -e . > "$WORK/install.log" 2>&1; then
  log "installed: pip install --no-build-isolation --no-deps -e ."
else
  log "pip install failed (see below); running from the source tree via PYTHONPATH"
  tail -5 "$WORK/install.log" | tee -a "$WORK/steps.log"
fi

# 2. benchmarks: name | preset | flags | warm-up steps | timed steps | predicted seconds | environment
if [ "$DRY_RUN" = 1 ]; then
  BENCH_ARGS=(--device cpu); PRECISION=(--bf16); PLAN_ARGS+=(--smoke)
else
  BENCH_ARGS=(); PRECISION=()
fi
mapfile -t RUNS < <(cd bench && "$PYTHON" gpu_plan.py --lines "${PLAN_ARGS[@]}")
index=0
for run in "${RUNS[@]}"; do
  IFS='|' read -r name preset flags warmup steps estimate env <<< "$run"
  index=$((index + 1))
  if [ "$index" -gt "$MAX_RUNS" ]; then break; fi
  if [ -n "$ONLY" ] && ! [[ "$name $preset" =~ $ONLY ]]; then continue; fi
  limit=$(( estimate * 3 / 2 > estimate + 30 ? estimate * 3 / 2 : estimate + 30 ))
  if [ "$DRY_RUN" != 1 ] && [ $(( $(left) - LANE_MIN )) -lt "$limit" ]; then
    log "skipped $name $preset: needs up to ${limit}s, $(( $(left) - LANE_MIN ))s left before the test lane"
    continue
  fi
  micro=()
  if [ "$DRY_RUN" = 1 ]; then micro=(--micro-batches 2); fi
  profile=()   # the MoE presets profile one more step: top kernels and CPU/GPU time, in the report
  case "$preset" in mixtral-*|qwen3-*|deepseek-*|tiny-moe) profile=(--profile) ;; esac
  # shellcheck disable=SC2086
  env $env timeout "$limit" "$PYTHON" bench/bench_pretrain.py --preset "$preset" \
      "${BENCH_ARGS[@]}" "${micro[@]}" "${profile[@]}" --warmup "$warmup" --steps "$steps" --json "$WORK/run$index.json" \
      -- "${PRECISION[@]}" $flags > "$WORK/run$index.log" 2>&1
  status=$?
  log "bench $name $preset: exit status $status (limit ${limit}s, predicted ${estimate}s)"
  echo "$index|$name|$preset|$flags|$status" >> "$WORK/runs.txt"
done

# 3. the GPU test lane, with the time left
LANE_LIMIT=$(left)
if [ "$DRY_RUN" != 1 ] && [ "$LANE_LIMIT" -lt "$LANE_MIN" ]; then
  log "GPU test lane skipped: ${LANE_LIMIT}s left (needs ${LANE_MIN}s)"
  echo "skipped: ${LANE_LIMIT}s of the budget left" > "$WORK/lane.log"
else
  LANE_LIMIT=$(( LANE_LIMIT < LANE_MIN ? LANE_MIN : LANE_LIMIT ))
  if "$PYTHON" -c "import pytest" 2>/dev/null; then
    # -v: each test's outcome as it ends, so a lane cut short by its time limit still reports them
    # The MoE tests first (the kernels the benchmarks above just timed), the compile-heavy layer last.
    timeout "$LANE_LIMIT" "$PYTHON" -m pytest -v -m gpu -rA tests/gpu/test_moe_gpu.py tests/gpu \
        > "$WORK/lane.log" 2>&1
  else
    timeout "$LANE_LIMIT" "$PYTHON" bench/run_gpu_lane.py > "$WORK/lane.log" 2>&1
  fi
  log "GPU test lane exit status $? (limit ${LANE_LIMIT}s)"
fi

# 4. the report
"$PYTHON" bench/gpu_report.py --work "$WORK" --report "$REPORT" --dry-run "$DRY_RUN"
log "report written to $REPORT (logs in $WORK)"
