"""Preprocessing throughput versus the tokenizer library's own batch-encode speed, same text, same cores.

    python bench/bench_preprocess.py [--max-mb 16] [--workers 2] [--vocab-size 8192]

For each corpus (Python standard library code, and synthetic English-like prose), trains a
byte-level BPE, then measures
  raw       `tokenizers.Tokenizer.encode_batch` over all texts already in memory (Rust threads on
            every core): the ceiling for GPT2BPETokenizer;
  pipeline  `tools/preprocess_data.py --workers N` end to end: read JSONL, parse, tokenize,
            write .bin/.idx (its own timer: from the first batch to the finished index).
Both are reported in MB/s of document text (UTF-8), so JSON overhead counts against the pipeline.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))

import build_corpus  # noqa: E402

PROSE_WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from at which but have "
               "an they you were her she there been one all we their has would when if so no more what about its "
               "time people year government market history language science water between during because").split()


def synthetic_prose(path: str, megabytes: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    size, limit = 0, int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as handle:
        while size < limit:
            sentences = []
            for _ in range(rng.randint(5, 40)):
                words = [rng.choice(PROSE_WORDS) for _ in range(rng.randint(4, 25))]
                if rng.random() < 0.2:
                    words.append(str(rng.randint(1, 2025)))
                sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
            text = " ".join(sentences)
            handle.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode("utf-8"))


def raw_speed(tokenizer_dir: str, texts) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(os.path.join(tokenizer_dir, "vocab.json"), os.path.join(tokenizer_dir, "merges.txt")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        tokenizer.encode_batch(texts, add_special_tokens=False)
        best = max(best, megabytes / (time.perf_counter() - start))
    return best


def pipeline_speed(corpus: str, tokenizer_dir: str, prefix: str, workers: int, text_megabytes: float):
    command = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus, "--output-prefix", prefix,
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(tokenizer_dir, "vocab.json"),
               "--merge-file", os.path.join(tokenizer_dir, "merges.txt"), "--append-eod", "--workers", str(workers),
               "--log-interval", "100000000"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    elapsed = float(re.search(r" in ([0-9.]+) s \(", result.stderr).group(1))
    return text_megabytes / elapsed, text_megabytes / wall


def bench(name: str, corpus: str, work: str, args) -> None:
    tokenizer_dir = os.path.join(work, f"{name}-tokenizer")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus, "--output-dir",
                    tokenizer_dir, "--vocab-size", str(args.vocab_size)], check=True, capture_output=True)
    with open(corpus, encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    text_megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    raw = raw_speed(tokenizer_dir, texts)
    del texts
    pipeline, wall = pipeline_speed(corpus, tokenizer_dir, os.path.join(work, name), args.workers, text_megabytes)
    print(f"{name:>6}: {text_megabytes:.1f} MB text | raw encode_batch {raw:.2f} MB/s | preprocess --workers {args.workers} "
          f"{pipeline:.2f} MB/s ({100 * pipeline / raw:.0f}% of raw; {wall:.2f} MB/s counting interpreter start-up)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-mb", type=float, default=16.0, help="size of each corpus in MB of text")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, tokenizers raw speed uses all of them; preprocess uses --workers {args.workers}")
    with tempfile.TemporaryDirectory() as work:
        code = os.path.join(work, "stdlib.jsonl")
        build_corpus.build(code, args.max_mb)
        bench("code", code, work, args)
        prose = os.path.join(work, "prose.jsonl")
        synthetic_prose(prose, args.max_mb)
        bench("prose", prose, work, args)


if __name__ == "__main__":
    main()
