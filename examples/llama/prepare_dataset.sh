#!/usr/bin/env bash
# Download (or take a local) corpus, write it as JSONL and tokenize it into DATA_DIR.
#
#   DATASET=wiki DATA_DIR=data TOKENIZER_MODEL=meta-llama/Llama-3.1-8B bash examples/llama/prepare_dataset.sh
#   DATASET=local INPUT=corpus.jsonl DATA_DIR=data TOKENIZER_MODEL=tokenizer.model bash examples/llama/prepare_dataset.sh
#
# Environment (defaults in brackets):
#   DATASET          [wiki]     bookcorpus | fineweb | wiki (need the `datasets` package and a reachable hub) | local
#   INPUT            []         DATASET=local: .jsonl / .jsonl.gz / text file or directory to tokenize
#   DATA_DIR         [data]     output directory; the dataset is ${DATA_DIR}/${DATASET}_text_document
#   TOKENIZER_MODEL  (required) a SentencePiece tokenizer.model (Llama 2) or a Hugging Face dir/tokenizer.json/hub name (Llama 3)
#   TOKENIZER_TYPE   [auto]     Llama2Tokenizer for *.model files, else HuggingFaceTokenizer
#   NUM_DOCS         [0]        download at most this many documents (0: all)
#   WORKERS          [nproc]    preprocessing processes
#   JSON_KEY         [text]     key holding the text
#   PYTHON           [python]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATASET=${DATASET:-wiki}
INPUT=${INPUT:-}
DATA_DIR=${DATA_DIR:-data}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a tokenizer.model, a Hugging Face tokenizer directory or hub name}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-auto}
NUM_DOCS=${NUM_DOCS:-0}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 2)}
JSON_KEY=${JSON_KEY:-text}
PYTHON=${PYTHON:-python}

if [[ "$TOKENIZER_TYPE" == auto ]]; then
    if [[ "$TOKENIZER_MODEL" == *.model ]]; then TOKENIZER_TYPE=Llama2Tokenizer; else TOKENIZER_TYPE=HuggingFaceTokenizer; fi
fi
mkdir -p "$DATA_DIR"

case "$DATASET" in
    local)
        [[ -n "$INPUT" ]] || { echo "DATASET=local needs INPUT=<file or directory>" >&2; exit 1; }
        [[ -e "$INPUT" ]] || { echo "INPUT=$INPUT does not exist" >&2; exit 1; }
        RAW="$INPUT"
        ;;
    bookcorpus | fineweb | wiki)
        RAW="$DATA_DIR/${DATASET}.jsonl"
        if [[ ! -f "$RAW" ]]; then
            "$PYTHON" - "$DATASET" "$RAW" "$NUM_DOCS" "$JSON_KEY" <<'PY'
import json, os, sys
name, output, limit, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sources = {  # (hub dataset, config, text column)
    "bookcorpus": ("bookcorpus/bookcorpus", None, "text"),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", "text"),
    "wiki": ("wikimedia/wikipedia", "20231101.en", "text"),
}
try:
    import datasets
except ImportError:
    sys.exit("DATASET=%s needs the datasets package (pip install datasets); or use DATASET=local INPUT=..." % name)
repo, config, column = sources[name]
try:
    stream = datasets.load_dataset(repo, config, split="train", streaming=True)
except Exception as error:
    sys.exit("could not download %s from the Hugging Face hub (%s); use DATASET=local INPUT=<jsonl>" % (repo, error))
temporary = output + ".tmp"
with open(temporary, "w", encoding="utf-8") as handle:
    for count, row in enumerate(stream):
        if limit and count >= limit:
            break
        handle.write(json.dumps({key: row[column]}) + "\n")
os.replace(temporary, output)
print("wrote", output)
PY
        fi
        ;;
    *)
        echo "DATASET must be bookcorpus, fineweb, wiki or local, got '$DATASET'" >&2
        exit 1
        ;;
esac

TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
PREPROCESS_ARGS=(--input "$RAW" --output-prefix "$DATA_DIR/$DATASET" --json-keys "$JSON_KEY" --append-eod --workers "$WORKERS")
"$PYTHON" "$ROOT/tools/preprocess_data.py" "${PREPROCESS_ARGS[@]}" "${TOKENIZER_ARGS[@]}"
echo "DATA_PATH=$DATA_DIR/${DATASET}_${JSON_KEY}_document"
