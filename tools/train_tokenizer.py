"""Train a tokenizer on JSONL or text files.

    # GPT-2 style byte-level BPE: writes vocab.json, merges.txt (for GPT2BPETokenizer) and
    # tokenizer.json + tokenizer_config.json (for HuggingFaceTokenizer)
    python tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --type bpe --vocab-size 8192

    # Llama 3 style: the same, with Llama 3's pre-tokenization regex (use HuggingFaceTokenizer on it)
    python tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --type bpe --pattern llama3

    # Llama 2 style SentencePiece BPE with byte fallback: writes tokenizer.model
    python tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --type sentencepiece --vocab-size 8192

Progress goes to stderr: a line every --log-interval documents read, then one per training stage.
"""
import argparse
import json
import os
import sys
import time
from itertools import chain
from typing import Iterator, List, Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.document_reader import TextStats, expand_inputs, iter_texts  # noqa: E402

EOD_TOKEN = "<|endoftext|>"
LLAMA3_BOS = "<|begin_of_text|>"
# Llama 3's split: contractions, letters with one optional leading non-letter, 1-3 digits, punctuation, whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_byte_level_bpe(texts: Iterator[str], output_dir: str, vocab_size: int, pattern: str, min_frequency: int) -> List[str]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if pattern == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        special_tokens = [EOD_TOKEN]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        special_tokens = [EOD_TOKEN, LLAMA3_BOS]
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=sys.stderr.isatty())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
    written = tokenizer.model.save(output_dir)  # vocab.json, merges.txt
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "model_max_length": 1 << 30}
    if pattern == "llama3":
        config["bos_token"] = LLAMA3_BOS
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return [os.path.join(output_dir, "tokenizer.json"), *written, os.path.join(output_dir, "tokenizer_config.json")]


def train_sentencepiece(texts: Iterator[str], output_dir: str, vocab_size: int, threads: int) -> List[str]:
    import sentencepiece

    def lines() -> Iterator[str]:
        # SentencePiece trains on sentences of bounded length; feed it the documents' non-empty lines.
        for text in texts:
            for line in text.split("\n"):
                if line.strip():
                    yield line

    prefix = os.path.join(output_dir, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines(), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        # Llama 2's choices: byte fallback instead of <unk> for unseen characters, digits split,
        # whitespace kept verbatim, <unk>=0 <s>=1 </s>=2 and no padding piece.
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.99995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=1 << 16, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        num_threads=threads, minloglevel=2)
    return [prefix + ".model", prefix + ".vocab"]


class ReadProgress:
    """Wraps the texts: a line to stderr every `log_interval` documents, and one when the input is exhausted."""

    def __init__(self, texts: Iterator[str], log_interval: int, stream=sys.stderr):
        self.texts, self.log_interval, self.stream = texts, log_interval, stream
        self.documents, self.bytes, self.start = 0, 0, time.perf_counter()

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            self.documents += 1
            self.bytes += len(text)
            if self.documents % self.log_interval == 0:
                self.log(f"Read {self.documents} documents ({self.rates()}).")
            yield text
        if self.documents:
            self.log(f"Read all {self.documents} documents ({self.rates()}); training the tokenizer...")

    def rates(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return f"{self.bytes / 1e6:.2f} MB of text, {self.documents / elapsed:.1f} docs/s"

    def log(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def check_sentencepiece() -> None:
    try:
        import sentencepiece  # noqa: F401
    except ImportError as error:
        raise ImportError("--type sentencepiece needs the sentencepiece package: pip install sentencepiece "
                          "(or the extra: pip install -e '.[hf]')") from error


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="JSONL (.jsonl/.jsonl.gz) or text files, or directories")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys holding the text in JSONL input (every key's value is a training text)")
    parser.add_argument("--output-dir", required=True, help="directory for the tokenizer files (created if missing)")
    parser.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe",
                        help="bpe: byte-level BPE (GPT-2 / Llama 3); sentencepiece: SentencePiece BPE (Llama 2)")
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    parser.add_argument("--pattern", choices=("gpt2", "llama3"), default="gpt2",
                        help="bpe only: pre-tokenization regex; vocab.json/merges.txt match GPT2BPETokenizer only with gpt2")
    parser.add_argument("--min-frequency", type=int, default=2, help="bpe only: least count for a merge")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="sentencepiece only: trainer threads")
    parser.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = parser.parse_args(argv)
    minimum = 260 if args.type == "sentencepiece" else 258
    if args.vocab_size < minimum:
        parser.error(f"--vocab-size {args.vocab_size} is too small for --type {args.type}: at least {minimum} "
                     "(256 byte tokens plus the special tokens)")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    return args


def read_texts(args: argparse.Namespace) -> Iterator[str]:
    """The input's texts, with progress; an input with no text under --json-keys is an error naming the keys found."""
    files = expand_inputs(args.input)
    stats = TextStats()
    texts = iter(ReadProgress(iter_texts(files, args.json_keys, stats), args.log_interval))
    first = next(texts, None)
    if first is None:
        raise ValueError(stats.describe_missing(args.json_keys, args.input))
    return chain([first], texts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    start = time.perf_counter()
    try:
        if args.type == "sentencepiece":
            check_sentencepiece()
        texts = read_texts(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    os.makedirs(args.output_dir, exist_ok=True)
    if args.type == "bpe":
        written = train_byte_level_bpe(texts, args.output_dir, args.vocab_size, args.pattern, args.min_frequency)
    else:
        written = train_sentencepiece(texts, args.output_dir, args.vocab_size, args.threads)
    sys.stderr.write(f"Trained a {args.vocab_size}-token {args.type} tokenizer in {time.perf_counter() - start:.1f} s.\n")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
