"""Run by test_megatron_core_samples.py in a subprocess with only Megatron-Core on PYTHONPATH.

    python megatron_core_samples.py SPEC.json

For every scenario of the spec, Megatron-Core's own BlendedMegatronDatasetBuilder + GPTDataset
(+ BlendedDataset) build the train/valid/test datasets; their indices and the tokens of every
sample, in order, go to SPEC's output .npz, and a summary to its output .json. It also writes
the split boundaries Megatron-Core computes for many corpus sizes. Nothing of ours is imported.
"""
import json
import os
import sys
import warnings

warnings.simplefilter("ignore")

import numpy  # noqa: E402
import torch  # noqa: E402
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_config import (  # noqa: E402
    convert_split_vector_to_split_matrix, parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402

SPLITS = ("train", "valid", "test")


class MinimalTokenizer:
    """What GPTDatasetConfig and GPTDataset read from a tokenizer: vocab_size, eod and an identity for the cache hash."""

    vocab_size = 1 << 16
    eod = 0
    unique_identifiers = {"class": "MinimalTokenizer"}


def boundaries(splits, sizes):
    """Megatron-Core's split matrix, rounded as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits does."""
    table = {}
    for split in splits:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        table[split] = [[None if bookend is None else [int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n)))]
                         for bookend in matrix] for n in sizes]
    return table


def record_gpt(arrays, key, dataset):
    arrays[f"{key}/document_index"] = numpy.asarray(dataset.document_index)
    arrays[f"{key}/sample_index"] = numpy.asarray(dataset.sample_index)
    arrays[f"{key}/shuffle_index"] = numpy.asarray(dataset.shuffle_index)
    return {"kind": "gpt", "len": len(dataset)}


def record(arrays, key, dataset):
    if dataset is None:
        return {"kind": None}
    if isinstance(dataset, BlendedDataset):
        summary = {"kind": "blended", "len": len(dataset),
                   "parts": [record_gpt(arrays, f"{key}/part{j}", part) for j, part in enumerate(dataset.datasets)]}
        arrays[f"{key}/dataset_index"] = numpy.asarray(dataset.dataset_index)
        arrays[f"{key}/dataset_sample_index"] = numpy.asarray(dataset.dataset_sample_index)
    else:
        summary = record_gpt(arrays, key, dataset)
    windows = []
    for index in range(len(dataset)):
        item = dataset[index]
        windows.append(torch.cat([item["tokens"], item["labels"][-1:]]).numpy())
    arrays[f"{key}/tokens"] = numpy.stack(windows) if windows else numpy.zeros((0, 0), numpy.int64)
    return summary


def build(scenario, cache):
    per_split = scenario.get("per_split")
    config = GPTDatasetConfig(
        random_seed=scenario["seed"], sequence_length=scenario["seq_length"],
        blend=get_blend_from_list(scenario["data_path"]) if scenario.get("data_path") else None,
        blend_per_split=[get_blend_from_list(path) if path else None for path in per_split] if per_split else None,
        split=scenario.get("split"), path_to_cache=os.path.join(cache, scenario["name"]), tokenizer=MinimalTokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, scenario["sizes"], lambda: True, config).build()


def main(spec_path):
    assert BlendedDataset.__module__ == "megatron.core.datasets.blended_dataset"
    assert sys.modules[BlendedDataset.__module__].__file__.startswith(os.environ["PYTHONPATH"]), "not Megatron-Core's code"
    with open(spec_path) as handle:
        spec = json.load(handle)
    torch.distributed.init_process_group("gloo", init_method=f"file://{spec['cache']}/store", rank=0, world_size=1)
    arrays, summary = {}, {"boundaries": boundaries(spec["boundary_splits"], spec["boundary_sizes"]), "scenarios": {}}
    for scenario in spec["scenarios"]:
        datasets = build(scenario, spec["cache"])
        summary["scenarios"][scenario["name"]] = [record(arrays, f"{scenario['name']}/{split}", dataset)
                                                  for split, dataset in zip(SPLITS, datasets)]
    numpy.savez(spec["output"] + ".npz", **arrays)
    with open(spec["output"] + ".json", "w") as handle:
        json.dump(summary, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
