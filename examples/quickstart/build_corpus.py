"""Build a JSONL code corpus from this Python's own standard library sources (no download needed).

    python examples/quickstart/build_corpus.py --output quickstart_work/corpus.jsonl --max-mb 8

One document per `.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), in
sorted path order, so the same Python version always gives the same corpus. Each line is
{"text": <source>, "path": <path relative to the stdlib>}.
"""
import argparse
import json
import os
import sys
import sysconfig
from typing import Iterator, Optional, Sequence, Tuple

SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(root: str) -> Iterator[Tuple[str, str]]:
    """(relative path, source) of every UTF-8 `.py` file under `root`, in sorted order."""
    paths = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        paths.extend(os.path.relpath(os.path.join(directory, name), root) for name in names if name.endswith(".py"))
    for relative in sorted(paths):
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as handle:
                yield relative, handle.read()
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8


def build(output: str, max_mb: Optional[float], root: Optional[str] = None) -> Tuple[int, int]:
    """Write the corpus; return (documents, bytes of text)."""
    root = root or sysconfig.get_paths()["stdlib"]
    limit = None if max_mb is None else int(max_mb * 1e6)
    documents = size = 0
    temporary = f"{output}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        for relative, source in stdlib_sources(root):
            length = len(source.encode("utf-8"))
            if limit is not None and size + length > limit:
                break
            handle.write(json.dumps({"text": source, "path": relative}) + "\n")
            documents += 1
            size += length
    os.replace(temporary, output)
    return documents, size


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=None, help="stop before the text exceeds this many MB (1e6 bytes)")
    args = parser.parse_args(argv)
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    documents, size = build(args.output, args.max_mb)
    if documents == 0:
        sys.stderr.write("error: no standard library sources found (or --max-mb is smaller than the first file)\n")
        return 1
    print(f"wrote {args.output}: {documents} documents, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
