"""Tokenize raw documents into Megatron's `.bin/.idx` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx` (one pair per `--json-keys` key; `_sentence` instead
of `_document` with `--split-sentences`), and beside them `.tokenizer.json`, which records the
tokenizer so that training with another one is an error. Inputs: `.jsonl`, `.jsonl.gz`, plain text files (one
document each) or directories of them. Lines that are not a JSON object with a string value for
every key are skipped, counted and listed at the end (`--strict` stops at the first one).
"""
import argparse
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from itertools import chain
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.document_reader import (RawBatch, describe_missing_keys, expand_inputs,  # noqa: E402
                                                    read_batches, split_spans)
from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, get_bin_path, get_idx_path,  # noqa: E402
                                                    optimal_dtype)
from megatron.core.datasets.tokenizer_record import record_path, tokenizer_record, write_record  # noqa: E402
from megatron.core.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

# A sentence ends at . ! or ? (optionally followed by closing quotes/brackets) before whitespace.
SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")
MAX_LISTED_PROBLEMS = 50
RESULT_POLL_SECONDS = 0.2  # how often the main process, waiting for a worker, looks for a Ctrl-C


class Interrupted:
    """Ctrl-C (SIGINT) and SIGTERM, handled at fixed points of the main process.

    The handler only records the signal; `check()` raises KeyboardInterrupt where the tool can stop
    cleanly (between batches, between partitions, around finalizing). A KeyboardInterrupt raised
    by Python's default handler can land in a finalizer, where Python prints and drops it, and a
    process started with SIGINT ignored (a background job of a non-interactive shell, `nohup`)
    never sees Ctrl-C at all: both let the tool run to the end. A second signal stops at once.
    A forked worker inherits the handler until its initializer runs: there SIGINT is ignored (the
    main process stops the pool) and SIGTERM ends it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: Optional[str] = None
        self.previous = {}
        self.owner = os.getpid()

    def __enter__(self) -> "Interrupted":
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _record(self, signum, _frame) -> None:
        if os.getpid() != self.owner:  # a forked worker
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt


_NO_INTERRUPTS = Interrupted()  # never entered: check() never raises (library use of run())


def split_sentences(text: str) -> List[str]:
    """A dependency-free sentence splitter (Megatron uses NLTK punkt; boundaries may differ)."""
    return [sentence for sentence in SENTENCE_BOUNDARY.split(text) if sentence]


@dataclass
class EncodedBatch:
    """What a worker returns for one RawBatch."""

    path: str
    bytes_read: int
    documents: int = 0
    empty_documents: int = 0
    blank_lines: int = 0
    problems: List[Tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    keys_found: Dict[str, int] = field(default_factory=dict)  # keys of the lines that lack a --json-keys key
    tokens: Dict[str, np.ndarray] = field(default_factory=dict)
    sequence_lengths: Dict[str, np.ndarray] = field(default_factory=dict)
    document_ends: Dict[str, np.ndarray] = field(default_factory=dict)


class Encoder:
    """Turns raw records into token arrays; one instance lives in each worker process."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tokenizer = None

    def initialize(self) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the worker pool is the parallelism
        self.tokenizer = build_tokenizer_from_args(self.args)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)

    def parse(self, batch: RawBatch, result: EncodedBatch) -> Tuple[List[Dict[str, str]], List[int]]:
        """The batch's documents and their line numbers; bad lines go to `result.problems`."""
        documents, lines = [], []
        keys = self.args.json_keys
        for offset, record in enumerate(batch.records):
            line = batch.first_line + offset if batch.jsonl else 0
            if not batch.jsonl:
                try:
                    text = record.decode("utf-8")
                except UnicodeDecodeError as error:
                    result.problems.append((line, f"not UTF-8 text ({error})"))
                    continue
                documents.append({key: text for key in keys})
                lines.append(line)
                continue
            if not record.strip():
                result.blank_lines += 1
                continue
            try:
                obj = json.loads(record)
            except ValueError as error:
                result.problems.append((line, f"invalid JSON ({error})"))
                continue
            if not isinstance(obj, dict):
                result.problems.append((line, f"expected a JSON object, got {type(obj).__name__}"))
                continue
            missing = [key for key in keys if key not in obj]
            if missing:
                result.problems.append((line, f"missing key {missing[0]!r}"))
                for key in obj:
                    result.keys_found[key] = result.keys_found.get(key, 0) + 1
                continue
            wrong = [key for key in keys if not isinstance(obj[key], str)]
            if wrong:
                result.problems.append((line, f"key {wrong[0]!r} is {type(obj[wrong[0]]).__name__}, not a string"))
                continue
            documents.append({key: obj[key] for key in keys})
            lines.append(line)
        return documents, lines

    def encode(self, batch: RawBatch) -> EncodedBatch:
        if self.tokenizer is None:
            self.initialize()
        result = EncodedBatch(batch.path, batch.bytes_read)
        documents, lines = self.parse(batch, result)
        keys = self.args.json_keys
        try:
            encoded = {key: self._tokenize([document[key] for document in documents]) for key in keys}
        except ValueError:
            # Some text the tokenizer rejects (e.g. words given to NullTokenizer): find it document by document.
            encoded = {key: [] for key in keys}
            for document, line in zip(documents, lines):
                try:
                    one = {key: self._tokenize([document[key]])[0] for key in keys}
                except ValueError as error:
                    result.problems.append((line, f"tokenizer rejected the text: {error}"))
                    continue
                for key in keys:
                    encoded[key].append(one[key])
        result.documents = len(encoded[keys[0]])
        result.empty_documents = sum(1 for sequences in encoded[keys[0]] if not sequences)
        for key in keys:
            self._pack(key, encoded[key], result)
        return result

    def _tokenize(self, texts: List[str]) -> List[List[List[int]]]:
        """For each text, its non-empty sequences (one, or one per sentence), EOD appended to the last."""
        if not texts:
            return []
        if self.args.split_sentences:
            sentences = [split_sentences(text) for text in texts]
            flat = self.tokenizer.tokenize_batch(list(chain.from_iterable(sentences)))
            counts = [len(s) for s in sentences]
        else:
            flat = self.tokenizer.tokenize_batch(texts)
            counts = [1] * len(texts)
        documents, position = [], 0
        for count in counts:
            sequences = [ids for ids in flat[position:position + count] if len(ids) > 0]
            position += count
            if sequences and self.args.append_eod:
                sequences[-1] = list(sequences[-1]) + [self.tokenizer.eod]
            documents.append(sequences)
        return documents

    def _pack(self, key: str, documents: List[List[List[int]]], result: EncodedBatch) -> None:
        sequences = list(chain.from_iterable(documents))
        lengths = np.fromiter((len(ids) for ids in sequences), dtype=np.int64, count=len(sequences))
        result.tokens[key] = np.fromiter(chain.from_iterable(sequences), dtype=self.dtype, count=int(lengths.sum()))
        result.sequence_lengths[key] = lengths
        result.document_ends[key] = np.cumsum([len(document) for document in documents], dtype=np.int64)


_WORKER_ENCODER: Optional[Encoder] = None


def _worker_init(args: argparse.Namespace) -> None:
    global _WORKER_ENCODER
    # Ctrl-C reaches the whole process group; only the main process handles it (and stops the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER_ENCODER = Encoder(args)
    _WORKER_ENCODER.initialize()


def _worker_encode(batch: RawBatch) -> EncodedBatch:
    return _WORKER_ENCODER.encode(batch)


def _wait(future, interrupted: Interrupted):
    """A worker's result; a Ctrl-C while waiting for it stops the wait within RESULT_POLL_SECONDS."""
    while not future.done():
        interrupted.check()
        wait_for_futures([future], timeout=RESULT_POLL_SECONDS)
    return future.result()


def ordered_results(pool, batches, max_pending: int, interrupted: Interrupted):
    """Encode batches in the pool, yielding results in input order with at most `max_pending`
    batches in flight (a pool's map would read the whole input into memory ahead of the workers)."""
    pending = deque()
    for batch in batches:
        interrupted.check()
        pending.append(pool.submit(_worker_encode, batch))
        if len(pending) >= max_pending:
            yield _wait(pending.popleft(), interrupted)
    while pending:
        yield _wait(pending.popleft(), interrupted)


def build_tokenizer_from_args(args: argparse.Namespace):
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           vocab_extra_ids=args.vocab_extra_ids)


class Progress:
    """Megatron-style progress lines, plus a one-line bar when stderr is a terminal."""

    def __init__(self, total_bytes: int, log_interval: int, stream=sys.stderr):
        self.total_bytes, self.log_interval, self.stream = total_bytes, log_interval, stream
        self.start = time.perf_counter()
        self.documents, self.bytes, self.next_log = 0, 0, log_interval
        self.bar = stream.isatty()

    def update(self, documents: int, bytes_read: int) -> None:
        self.documents += documents
        self.bytes += bytes_read
        if self.bar:
            fraction = min(1.0, self.bytes / max(self.total_bytes, 1))
            filled = int(30 * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {100 * fraction:5.1f}% {self.rates()}")
            self.stream.flush()
        elif self.documents >= self.next_log:
            self.stream.write(f"Processed {self.documents} documents ({self.rates()}).\n")
            self.stream.flush()
            self.next_log = (self.documents // self.log_interval + 1) * self.log_interval

    def rates(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return f"{self.documents / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s"

    def finish(self) -> float:
        if self.bar:
            self.stream.write("\n")
        return time.perf_counter() - self.start


@dataclass
class RunSummary:
    documents: int = 0
    empty_documents: int = 0
    blank_lines: int = 0
    bytes_read: int = 0
    tokens: int = 0
    problems: List[Tuple[str, int, str]] = field(default_factory=list)
    keys_found: Dict[str, int] = field(default_factory=dict)

    def no_documents_error(self, args: argparse.Namespace) -> ValueError:
        """Why the input gave no document: the --json-keys key no line has, else the first malformed line."""
        missing = [key for key in args.json_keys if key not in self.keys_found]
        if self.keys_found and missing:
            return ValueError(describe_missing_keys(args.json_keys, missing, args.input, self.keys_found))
        first = ""
        if self.problems:
            path, line, reason = self.problems[0]
            first = f"; the first: {path}:{line}: {reason}" if line else f"; the first: {path}: {reason}"
        return ValueError(f"--input {' '.join(args.input)}: no valid documents found "
                          f"({len(self.problems)} malformed lines, {self.blank_lines} blank lines){first}")


def output_prefixes(args: argparse.Namespace, output_prefix: str) -> Dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in args.json_keys}


def process_spans(args: argparse.Namespace, spans, output_prefix: str, dtype, summary: RunSummary,
                  progress: Progress, interrupted: Interrupted = _NO_INTERRUPTS) -> None:
    """Tokenize `spans` into `{output_prefix}_{key}_{level}.bin/.idx`, atomically."""
    builders = {key: IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
                for key, prefix in output_prefixes(args, output_prefix).items()}
    pool = None
    try:
        batches = read_batches(spans, max_records=512, max_bytes=256 << 10)
        if args.workers > 1:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            # Not multiprocessing.Pool: its terminate() deadlocks when a worker waits for a task while
            # holding the task queue's lock (seen on Ctrl-C). The executor stops its workers with
            # sentinels: each finishes the batch in hand, pending batches are cancelled.
            pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context(method),
                                       initializer=_worker_init, initargs=(args,))
            results = ordered_results(pool, batches, max_pending=4 * args.workers, interrupted=interrupted)
        else:
            encoder = Encoder(args)
            results = (encoder.encode(batch) for batch in batches)
        for result in results:
            interrupted.check()
            for key, count in result.keys_found.items():
                summary.keys_found[key] = summary.keys_found.get(key, 0) + count
            for line, reason in result.problems:
                summary.problems.append((result.path, line, reason))
                if args.strict:
                    where = f"{result.path}:{line}" if line else result.path
                    raise ValueError(f"{where}: {reason} (--strict stops at the first malformed line)")
            for key, builder in builders.items():
                if key in result.tokens:
                    builder.add_documents(result.tokens[key], result.sequence_lengths[key], result.document_ends[key])
            if result.tokens:
                summary.tokens += int(result.tokens[args.json_keys[0]].size)
            summary.documents += result.documents
            summary.empty_documents += result.empty_documents
            summary.blank_lines += result.blank_lines
            summary.bytes_read += result.bytes_read
            progress.update(result.documents, result.bytes_read)
        if pool is not None:
            pool.shutdown(wait=True)
            pool = None
        interrupted.check()
        for key, prefix in output_prefixes(args, output_prefix).items():
            builders[key].finalize(get_idx_path(prefix))
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for builder in builders.values():
            builder.abort()
        raise


def merge_partitions(args: argparse.Namespace, partition_prefixes: Sequence[str], dtype,
                     interrupted: Interrupted = _NO_INTERRUPTS) -> None:
    for key, final_prefix in output_prefixes(args, args.output_prefix).items():
        builder = IndexedDatasetBuilder(get_bin_path(final_prefix), dtype=dtype)
        try:
            for partition in partition_prefixes:
                interrupted.check()
                builder.add_index(output_prefixes(args, partition)[key])
            builder.finalize(get_idx_path(final_prefix))
        except BaseException:
            builder.abort()
            raise


def remove_dataset(prefix: str) -> None:
    for path in (get_bin_path(prefix), get_idx_path(prefix)):
        if os.path.exists(path):
            os.remove(path)


def report(args: argparse.Namespace, summary: RunSummary, elapsed: float, stream=sys.stderr) -> None:
    megabytes = summary.bytes_read / 1e6
    stream.write(f"Done: {summary.documents} documents, {summary.tokens} tokens ({args.json_keys[0]!r}), "
                 f"{megabytes:.2f} MB in {elapsed:.1f} s ({summary.documents / max(elapsed, 1e-9):.1f} docs/s, "
                 f"{megabytes / max(elapsed, 1e-9):.2f} MB/s).\n")
    if summary.empty_documents:
        stream.write(f"{summary.empty_documents} documents had no tokens and hold no sequence.\n")
    if summary.blank_lines:
        stream.write(f"{summary.blank_lines} blank lines skipped.\n")
    if summary.problems:
        stream.write(f"WARNING: {len(summary.problems)} malformed lines skipped (use --strict to stop at the first):\n")
        for path, line, reason in summary.problems[:MAX_LISTED_PROBLEMS]:
            stream.write(f"  {path}:{line}: {reason}\n" if line else f"  {path}: {reason}\n")
        if len(summary.problems) > MAX_LISTED_PROBLEMS:
            listing = f"{args.output_prefix}_malformed_lines.txt"
            with open(listing, "w", encoding="utf-8") as handle:
                for path, line, reason in summary.problems:
                    handle.write(f"{path}:{line}: {reason}\n")
            stream.write(f"  ... and {len(summary.problems) - MAX_LISTED_PROBLEMS} more, all listed in {listing}\n")
    for prefix in output_prefixes(args, args.output_prefix).values():
        stream.write(f"Wrote {prefix}.bin and {prefix}.idx\n")


def run(args: argparse.Namespace, interrupted: Interrupted = _NO_INTERRUPTS) -> RunSummary:
    tokenizer = build_tokenizer_from_args(args)
    if args.split_sentences and not tokenizer.supports_sentence_splitting():
        raise ValueError(f"--split-sentences is not supported with --tokenizer-type {args.tokenizer_type}")
    dtype = optimal_dtype(tokenizer.vocab_size)
    files = expand_inputs(args.input)
    if sum(os.path.getsize(path) for path in files) == 0:
        raise ValueError(f"--input {' '.join(args.input)} is empty: no documents to preprocess")
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(output_dir):
        raise FileNotFoundError(f"--output-prefix {args.output_prefix}: directory {output_dir} does not exist")
    summary = RunSummary()
    progress = Progress(sum(os.path.getsize(path) for path in files), args.log_interval)
    groups = split_spans(files, args.partitions)
    if len(groups) == 1:
        process_spans(args, groups[0], args.output_prefix, dtype, summary, progress, interrupted)
    else:
        partition_prefixes = [f"{args.output_prefix}_partition{index}" for index in range(len(groups))]
        try:
            for spans, prefix in zip(groups, partition_prefixes):
                process_spans(args, spans, prefix, dtype, summary, progress, interrupted)
            merge_partitions(args, partition_prefixes, dtype, interrupted)
        finally:
            for prefix in partition_prefixes:
                for partial in output_prefixes(args, prefix).values():
                    remove_dataset(partial)
    elapsed = progress.finish()
    if summary.documents == 0:
        for prefix in output_prefixes(args, args.output_prefix).values():
            remove_dataset(prefix)
        raise summary.no_documents_error(args)
    record = tokenizer_record(tokenizer, args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_model=args.tokenizer_model)
    try:
        interrupted.check()  # a Ctrl-C during the finalizing above: the dataset goes too
        for prefix in output_prefixes(args, args.output_prefix).values():
            write_record(prefix, record)  # which tokenizer wrote it: training checks it against its own
        interrupted.check()
    except KeyboardInterrupt:
        for prefix in output_prefixes(args, args.output_prefix).values():
            remove_dataset(prefix)
            if os.path.exists(record_path(prefix)):
                os.remove(record_path(prefix))
        raise
    report(args, summary, elapsed)
    return summary


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, nargs="+", help="JSONL (.jsonl/.json/.jsonl.gz) or text files, or directories of them")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object")
    group.add_argument("--split-sentences", action="store_true", help="store each sentence as its own sequence")
    group.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping it")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece tokenizer.model, or a Hugging Face directory / tokenizer.json")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: N ordinary ids 0..N-1; the EOD is id N (N + 1 entries in all)")
    group.add_argument("--vocab-extra-ids", type=int, default=0, help="SentencePieceTokenizer: number of <extra_id_N> tokens")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix; files are {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1, help="process the input in this many parts, then merge them")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    args = parser.parse_args(argv)
    for name in ("workers", "partitions", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    try:
        with Interrupted() as interrupted:
            run(args, interrupted)
    except (ValueError, FileNotFoundError, ImportError) as error:
        from megatron.training.arguments import as_flags  # the library names config fields
        sys.stderr.write(f"error: {as_flags(str(error))}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: temporary output removed, no dataset written\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
