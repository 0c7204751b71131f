"""Merge several `.bin/.idx` datasets into one, in the order given.

    python tools/merge_datasets.py --input data/part0_text_document data/part1_text_document \
        --output-prefix data/all_text_document

`--input` takes dataset prefixes, or one directory whose every `*.idx` pair is merged in sorted
name order (Megatron's form). All inputs must share a dtype (the same tokenizer).
"""
import argparse
import os
import sys
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, get_bin_path,  # noqa: E402
                                                    get_idx_path)


def input_prefixes(inputs: Sequence[str]) -> List[str]:
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(name[:-4] for name in os.listdir(inputs[0]) if name.endswith(".idx"))
        if not names:
            raise FileNotFoundError(f"--input {inputs[0]}: directory holds no .idx files")
        return [os.path.join(inputs[0], name) for name in names]
    return [prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix for prefix in inputs]


def merge(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Write `output_prefix.bin/.idx` holding every document of `prefixes`; return it opened."""
    if not prefixes:
        raise ValueError("nothing to merge: give at least one --input")
    first = IndexedDataset(prefixes[0])
    for prefix in prefixes:
        if os.path.abspath(prefix) == os.path.abspath(output_prefix):
            raise ValueError(f"--output-prefix {output_prefix} is also an input; choose another name")
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=first.dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    return IndexedDataset(output_prefix)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="dataset prefixes, or one directory of them")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    args = parser.parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix)
    except (ValueError, FileNotFoundError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    print(f"merged {len(prefixes)} datasets: {len(merged.document_indices) - 1} documents, {merged.num_tokens} tokens "
          f"-> {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
