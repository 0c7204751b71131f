"""Reading raw documents for preprocessing and tokenizer training.

Inputs are JSONL files (`.jsonl`, `.json`, `.ndjson`, optionally `.gz`), one JSON object per line,
or any other file, read as plain UTF-8 text that is one document. A directory stands for every
file under it, in sorted order. Files are read as bytes; JSON parsing happens in the workers.
"""
import gzip
import io
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
MAX_KEYS_LISTED = 10


def is_jsonl(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith(JSONL_SUFFIXES)


def expand_inputs(inputs: Sequence[str]) -> List[str]:
    """Files named by `--input`: files as given, directories walked recursively in sorted order."""
    files: List[str] = []
    for entry in inputs:
        if os.path.isdir(entry):
            found = []
            for root, directories, names in os.walk(entry):
                directories[:] = sorted(d for d in directories if not d.startswith("."))
                found.extend(os.path.join(root, name) for name in names if not name.startswith("."))
            if not found:
                raise ValueError(f"--input directory {entry} contains no files")
            files.extend(sorted(found))
        elif os.path.isfile(entry):
            files.append(entry)
        else:
            raise FileNotFoundError(f"--input {entry}: no such file or directory")
    return files


@dataclass(frozen=True)
class Span:
    """A contiguous piece of one input file: bytes [start, end) whose first line is `first_line` (1-based)."""

    path: str
    start: int = 0
    end: Optional[int] = None
    first_line: int = 1


@dataclass
class RawBatch:
    """Consecutive records of one file; for JSONL each record is a line, for text the whole file."""

    path: str
    first_line: int
    records: List[bytes]
    jsonl: bool
    bytes_read: int


def split_spans(files: Sequence[str], parts: int) -> List[List[Span]]:
    """Cut the input into `parts` contiguous groups of about equal size, for `--partitions`.

    Plain (uncompressed) JSONL files may be cut between lines; gzipped and text files stay whole.
    """
    spans: List[Span] = []
    total = sum(os.path.getsize(path) for path in files)
    target = max(1, -(-total // max(parts, 1)))
    for path in files:
        size = os.path.getsize(path)
        if parts <= 1 or path.endswith(".gz") or not is_jsonl(path) or size <= target:
            spans.append(Span(path))
            continue
        spans.extend(_cut_file(path, size, target))
    groups: List[List[Span]] = [[] for _ in range(max(parts, 1))]
    filled, group = 0, 0
    for span in spans:
        groups[group].append(span)
        filled += _span_size(span)
        if filled >= target * (group + 1) and group < len(groups) - 1:
            group += 1
    return [g for g in groups if g]


def _span_size(span: Span) -> int:
    end = os.path.getsize(span.path) if span.end is None else span.end
    return end - span.start


def _cut_file(path: str, size: int, target: int) -> List[Span]:
    spans, start, line = [], 0, 1
    with open(path, "rb") as handle:
        while start < size:
            handle.seek(min(start + target, size))
            if start + target < size:
                handle.readline()  # move to the start of the next line
            end = min(handle.tell(), size)
            handle.seek(start)
            newlines = _count_newlines(handle, end - start)
            spans.append(Span(path, start, end, line))
            start, line = end, line + newlines
    return spans


def _count_newlines(handle: io.BufferedReader, length: int) -> int:
    count = 0
    while length > 0:
        chunk = handle.read(min(length, 16 << 20))
        if not chunk:
            break
        count += chunk.count(b"\n")
        length -= len(chunk)
    return count


def read_batches(spans: Sequence[Span], max_records: int = 1024, max_bytes: int = 1 << 20) -> Iterator[RawBatch]:
    """Yield the input as batches of raw records, in order."""
    for span in spans:
        if not is_jsonl(span.path):
            opener = gzip.open if span.path.endswith(".gz") else open
            with opener(span.path, "rb") as handle:
                data = handle.read()
            yield RawBatch(span.path, 0, [data], False, os.path.getsize(span.path))
            continue
        yield from _read_jsonl_batches(span, max_records, max_bytes)


def _read_jsonl_batches(span: Span, max_records: int, max_bytes: int) -> Iterator[RawBatch]:
    with open(span.path, "rb") as raw:
        raw.seek(span.start)
        handle = gzip.GzipFile(fileobj=raw, mode="rb") if span.path.endswith(".gz") else raw
        records: List[bytes] = []
        line, size, position = span.first_line, 0, span.start
        for record in handle:
            if span.end is not None and position >= span.end:
                break
            position += len(record)
            records.append(record)
            size += len(record)
            if len(records) >= max_records or size >= max_bytes:
                yield RawBatch(span.path, line, records, True, size)
                line, records, size = line + len(records), [], 0
        if records:
            yield RawBatch(span.path, line, records, True, size)


@dataclass
class TextStats:
    """What `iter_texts` saw: texts yielded, and the keys of JSON lines that lacked every wanted key."""

    texts: int = 0
    lines_without_key: int = 0
    keys_found: Dict[str, int] = field(default_factory=dict)

    def describe_missing(self, json_keys: Sequence[str], inputs: Sequence[str]) -> str:
        return describe_missing_keys(json_keys, json_keys, inputs, self.keys_found)


def describe_missing_keys(json_keys: Sequence[str], missing: Sequence[str], inputs: Sequence[str],
                          keys_found: Dict[str, int]) -> str:
    """One line: no line of the input has the `missing` keys, and the keys that its lines do have (most common first)."""
    found = ", ".join(repr(key) for key in sorted(keys_found, key=lambda k: -keys_found[k])[:MAX_KEYS_LISTED])
    wanted = f"the key {missing[0]!r}" if len(missing) == 1 else "any of the keys " + ", ".join(repr(k) for k in missing)
    return (f"--json-keys {' '.join(json_keys)}: no line of --input {' '.join(inputs)} has {wanted} with a string value; "
            f"keys found: {found or 'none (no JSON objects)'}")


def iter_texts(files: Sequence[str], json_keys: Sequence[str] = ("text",), stats: Optional[TextStats] = None) -> Iterator[str]:
    """Every document's text (each wanted key's string value), skipping lines that have none of them."""
    import json

    json_keys = [json_keys] if isinstance(json_keys, str) else list(json_keys)
    stats = stats if stats is not None else TextStats()
    for batch in read_batches([Span(path) for path in files]):
        for record in batch.records:
            if not batch.jsonl:
                stats.texts += 1
                yield record.decode("utf-8", errors="replace")
                continue
            try:
                obj = json.loads(record)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            values = [obj[key] for key in json_keys if isinstance(obj.get(key), str)]
            if not values:
                stats.lines_without_key += 1
                if len(stats.keys_found) < 1000:
                    for key in obj:
                        stats.keys_found[key] = stats.keys_found.get(key, 0) + 1
            for value in values:
                stats.texts += 1
                yield value
