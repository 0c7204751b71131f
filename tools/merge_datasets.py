"""Merge several `.bin/.idx` datasets into one, in the order given.

    python tools/merge_datasets.py --input data/part0_text_document data/part1_text_document \
        --output-prefix data/all_text_document

`--input` takes dataset prefixes, or one directory whose every `*.idx` pair is merged in sorted
name order (Megatron's form). All inputs must share a dtype (the same tokenizer), and the
tokenizer recorded beside them (`<prefix>.tokenizer.json`, when they have one), which the merged
dataset then records too.
"""
import argparse
import os
import sys
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, get_bin_path,  # noqa: E402
                                                    get_idx_path)
from megatron.core.datasets.tokenizer_record import read_record, record_path, write_record  # noqa: E402


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
    record = common_record(prefixes)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=first.dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    if record is not None:
        write_record(output_prefix, record)
    return IndexedDataset(output_prefix)


def common_record(prefixes: Sequence[str]) -> Optional[dict]:
    """The tokenizer all inputs record (None when some record none); an error when two differ."""
    records = [read_record(prefix) for prefix in prefixes]
    if any(record is None for record in records):
        return None
    for prefix, record in zip(prefixes[1:], records[1:]):
        if record != records[0]:
            raise ValueError(f"{prefixes[0]} and {prefix} were written with different tokenizers "
                             f"({record_path(prefixes[0])} vs {record_path(prefix)}); merge datasets of one tokenizer only")
    return records[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="dataset prefixes, or one directory of them")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    args = parser.parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix)
    except (ValueError, FileNotFoundError) as error:
        from megatron.training.arguments import as_flags  # the library names config fields
        sys.stderr.write(f"error: {as_flags(str(error))}\n")
        return 1
    print(f"merged {len(prefixes)} datasets: {len(merged.document_indices) - 1} documents, {merged.num_tokens} tokens "
          f"-> {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
