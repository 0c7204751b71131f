#!/usr/bin/env bash
# Quickstart data: a code corpus from the Python standard library, a byte-level BPE tokenizer
# trained on it, and the tokenized .bin/.idx dataset, all under WORK_DIR. Under a minute on 2 cores.
#
#   WORK_DIR=quickstart_work bash examples/quickstart/prepare.sh
#
# Environment (defaults in brackets):
#   WORK_DIR    [quickstart_work]  where everything is written
#   MAX_MB      [8]                corpus size cap in MB
#   VOCAB_SIZE  [8192]             BPE vocabulary size, special tokens included
#   WORKERS     [number of CPUs]   preprocessing processes
#   PYTHON      [python]           interpreter to use
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK_DIR=${WORK_DIR:-quickstart_work}
MAX_MB=${MAX_MB:-8}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 2)}
PYTHON=${PYTHON:-python}

mkdir -p "$WORK_DIR"
CORPUS="$WORK_DIR/corpus.jsonl"
TOKENIZER_DIR="$WORK_DIR/tokenizer"
PREFIX="$WORK_DIR/stdlib"

"$PYTHON" "$ROOT/examples/quickstart/build_corpus.py" --output "$CORPUS" --max-mb "$MAX_MB"

TRAIN_ARGS=(--input "$CORPUS" --output-dir "$TOKENIZER_DIR" --type bpe --vocab-size "$VOCAB_SIZE")
"$PYTHON" "$ROOT/tools/train_tokenizer.py" "${TRAIN_ARGS[@]}"

TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json" --merge-file "$TOKENIZER_DIR/merges.txt")
PREPROCESS_ARGS=(--input "$CORPUS" --output-prefix "$PREFIX" --json-keys text --append-eod --workers "$WORKERS" --log-interval 2000)
"$PYTHON" "$ROOT/tools/preprocess_data.py" "${PREPROCESS_ARGS[@]}" "${TOKENIZER_ARGS[@]}"

echo "DATA_PATH=$PREFIX"_text_document
echo "TOKENIZER_ARGS=${TOKENIZER_ARGS[*]}"
echo "Train with: --data-path ${PREFIX}_text_document ${TOKENIZER_ARGS[*]}"
