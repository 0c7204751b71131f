"""Run by test_cyclic_sampler.py in a subprocess, with nothing of ours on the path:

    python megatron_lm_sampler.py DATA_SAMPLERS_PY CASES.json

Takes the class `MegatronPretrainingRandomSampler` out of Megatron-LM's own
megatron/training/datasets/data_samplers.py (the module itself imports the whole of Megatron-LM, so
only that class is compiled, with `torch` beside it) and prints, as JSON, the micro-batches each
data-parallel rank reads for every case: `batches` of them, passing over the sampler again whenever a
pass ends, as Megatron-LM's `cyclic_iter` does over its data loader.
"""
import ast
import json
import sys

import torch


def megatron_sampler(path: str):
    tree = ast.parse(open(path).read())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)
               and node.name in ("RandomSeedDataset", "MegatronPretrainingRandomSampler")]
    namespace = {"torch": torch, "Dataset": torch.utils.data.Dataset}
    exec(compile(ast.Module(body=classes, type_ignores=[]), path, "exec"), namespace)
    return namespace["MegatronPretrainingRandomSampler"]


def order(sampler_class, case: dict, rank: int) -> list:
    sampler = sampler_class(None, total_samples=case["total"], consumed_samples=case["consumed"],
                            micro_batch_size=case["micro_batch_size"], data_parallel_rank=rank,
                            data_parallel_size=case["dp"], data_sharding=case["data_sharding"])
    batches = []
    while len(batches) < case["batches"]:
        batches += list(sampler)
    return batches[:case["batches"]]


def main(path: str, cases_file: str) -> None:
    sampler_class = megatron_sampler(path)
    cases = json.load(open(cases_file))
    print(json.dumps([[order(sampler_class, case, rank) for rank in range(case["dp"])] for case in cases]))


if __name__ == "__main__":
    main(*sys.argv[1:])
