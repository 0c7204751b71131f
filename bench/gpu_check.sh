#!/usr/bin/env bash
# One command for whoever has a GPU: install, the GPU test lane, the benchmark presets in bf16 and
# FP8, two A/Bs, and one Markdown report.
#
#   bash bench/gpu_check.sh [REPORT.md]          # or GPU_CHECK_REPORT=REPORT.md bash bench/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh  # CPU smoke run of every step (tiny preset, no install)
#   GPU_CHECK_BUDGET (seconds, default 540), GPU_CHECK_MAX_RUNS (default all), PYTHON (default python3)
#
# Needs: a CUDA GPU with PyTorch (and Triton) installed; no internet (the project installs with
# --no-deps --no-build-isolation, or runs from the source tree if that fails). Steps, in order, each
# with a time limit so the whole run stays within GPU_CHECK_BUDGET seconds (default 540 = 9 min):
#   1. pip install --no-build-isolation --no-deps -e .
#   2. pytest -m gpu (tests/gpu; a small built-in runner if pytest is not installed)
#   3. bench_pretrain.py: llama3-8b-8layers bf16, llama3.2-1b bf16, llama3-8b-8layers FP8 (hybrid,
#      delayed and tensorwise), the --no-torch-compile and --no-gradient-accumulation-fusion A/Bs on
#      llama3-8b-8layers, then (time permitting) llama3.2-1b FP8
#   4. bench/gpu_report.py writes the report: device, versions, the test lane's outcome and, per
#      run, TFLOP/s/GPU, MFU, tokens/s/GPU, peak memory and the attention kernel that ran.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
REPORT=${1:-${GPU_CHECK_REPORT:-$ROOT/gpu_check_report.md}}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET:-540}
MAX_RUNS=${GPU_CHECK_MAX_RUNS:-99}   # benchmark runs to do at most (the smoke test does one)
WORK=$(mktemp -d)
START=$SECONDS
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # collectives issued before the GEMMs they overlap

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

# 2. the GPU test lane
LANE_LIMIT=$(( $(left) < 200 ? $(left) : 200 ))
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  timeout "$LANE_LIMIT" "$PYTHON" -m pytest -q -m gpu -rA tests/gpu > "$WORK/lane.log" 2>&1
else
  timeout "$LANE_LIMIT" "$PYTHON" bench/run_gpu_lane.py > "$WORK/lane.log" 2>&1
fi
log "GPU test lane exit status $? (limit ${LANE_LIMIT}s)"

# 3. benchmarks: name | preset | extra flags
if [ "$DRY_RUN" = 1 ]; then
  BENCH_ARGS=(--device cpu --steps 2 --warmup 1 --micro-batches 2); BIG=tiny; SMALL=tiny; PRECISION=(--bf16)
else
  BENCH_ARGS=(); BIG=llama3-8b-8layers; SMALL=llama3.2-1b; PRECISION=()
fi
RUNS=(
  "bf16|$BIG|"
  "bf16|$SMALL|"
  "fp8-delayed|$BIG|--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
  "fp8-tensorwise|$BIG|--fp8-format hybrid --fp8-recipe tensorwise"
  "bf16-no-torch-compile|$BIG|--no-torch-compile"
  "bf16-no-gradient-accumulation-fusion|$BIG|--no-gradient-accumulation-fusion"
  "fp8-delayed|$SMALL|--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
  "fp8-tensorwise|$SMALL|--fp8-format hybrid --fp8-recipe tensorwise"
)
index=0
for run in "${RUNS[@]}"; do
  IFS='|' read -r name preset flags <<< "$run"
  index=$((index + 1))
  if [ "$index" -gt "$MAX_RUNS" ]; then break; fi
  remaining=$(( $(left) - 15 ))
  if [ "$remaining" -lt 45 ]; then log "skipped $name $preset: time budget spent"; continue; fi
  limit=$(( remaining < 150 ? remaining : 150 ))
  # shellcheck disable=SC2086
  timeout "$limit" "$PYTHON" bench/bench_pretrain.py --preset "$preset" "${BENCH_ARGS[@]}" \
      --json "$WORK/run$index.json" -- "${PRECISION[@]}" $flags > "$WORK/run$index.log" 2>&1
  status=$?
  log "bench $name $preset: exit status $status (limit ${limit}s)"
  echo "$name|$preset|$flags|$status" >> "$WORK/runs.txt"
done

# 4. the report
"$PYTHON" bench/gpu_report.py --work "$WORK" --report "$REPORT" --dry-run "$DRY_RUN"
log "report written to $REPORT (logs in $WORK)"
