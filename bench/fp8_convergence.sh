#!/usr/bin/env bash
# FP8 against bf16 on real text: a ~1B Llama (h 2048, 16 layers, 16 heads, 8 groups, f 8192)
# trained 300 steps on the quickstart corpus, once in bf16 and once in FP8 (hybrid, delayed),
# same seed and data; prints both curves' last-50-step mean loss and whether FP8 is within 1%.
# About 5-10 minutes on one H100 (data preparation included).
#
#   bash bench/fp8_convergence.sh
#   FP8_CHECK_DRY_RUN=1 bash bench/fp8_convergence.sh   # CPU: tiny model, 30 steps (checks the script)
#
# Environment (defaults in brackets):
#   WORK_DIR     [fp8_convergence_work]  data, tokenizer and logs
#   TRAIN_ITERS  [300; dry run 30]       optimizer steps per run
#   FP8_FLAGS    [--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max]
#   TOLERANCE    [0.01]                  allowed relative gap of the last-50-step mean loss
#   PYTHON       [python3]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK_DIR=${WORK_DIR:-fp8_convergence_work}
DRY_RUN=${FP8_CHECK_DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
TOLERANCE=${TOLERANCE:-0.01}
FP8_FLAGS=${FP8_FLAGS:---fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$DRY_RUN" = 1 ]; then
  TRAIN_ITERS=${TRAIN_ITERS:-30}
  MODEL_ARGS=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64
              --num-query-groups 2 --micro-batch-size 4 --global-batch-size 8 --distributed-backend gloo)
else
  TRAIN_ITERS=${TRAIN_ITERS:-300}
  MODEL_ARGS=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
              --num-query-groups 8 --seq-length 1024 --micro-batch-size 4 --global-batch-size 32)
fi
if [ ! -f "$WORK_DIR/stdlib_text_document.idx" ]; then
  WORK_DIR="$WORK_DIR" PYTHON="$PYTHON" VOCAB_SIZE=4096 bash "$ROOT/examples/quickstart/prepare.sh" > "$WORK_DIR.prepare.log" 2>&1 \
    || { echo "data preparation failed (see $WORK_DIR.prepare.log)" >&2; exit 1; }
fi
COMMON=("${MODEL_ARGS[@]}" --group-query-attention --max-position-embeddings 4096
        --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
        --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16
        --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
        --lr-warmup-iters "$((TRAIN_ITERS / 10))" --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
        --data-path "$WORK_DIR/stdlib_text_document" --split 95,5,0 --data-cache-path "$WORK_DIR/cache"
        --tokenizer-type GPT2BPETokenizer --vocab-file "$WORK_DIR/tokenizer/vocab.json"
        --merge-file "$WORK_DIR/tokenizer/merges.txt" --num-workers 1 --log-interval 1 --eval-iters 0)
"$PYTHON" "$ROOT/pretrain_gpt.py" "${COMMON[@]}" > "$WORK_DIR/bf16.log" 2>&1
# shellcheck disable=SC2086
"$PYTHON" "$ROOT/pretrain_gpt.py" "${COMMON[@]}" $FP8_FLAGS > "$WORK_DIR/fp8.log" 2>&1
"$PYTHON" - "$WORK_DIR/bf16.log" "$WORK_DIR/fp8.log" "$TOLERANCE" <<'PY'
import re
import sys

curves = [[float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", open(path).read())] for path in sys.argv[1:3]]
tolerance = float(sys.argv[3])
window = min(50, len(curves[0]) // 2)
bf16, fp8 = (sum(c[-window:]) / window for c in curves)
gap = fp8 / bf16 - 1
print(f"steps: {len(curves[0])} bf16, {len(curves[1])} fp8")
print(f"first loss: bf16 {curves[0][0]:.4f}, fp8 {curves[1][0]:.4f}")
print(f"mean loss over the last {window} steps: bf16 {bf16:.4f}, fp8 {fp8:.4f} ({100 * gap:+.2f}%)")
print(f"FP8 within {100 * tolerance:.0f}% of bf16: {'yes' if abs(gap) <= tolerance else 'NO'}")
sys.exit(0 if abs(gap) <= tolerance else 1)
PY
