"""BlendedDataset: `--data-path 0.3 a 0.7 b`, mixing datasets in fixed proportions.

Megatron-Core's rule: the weights are normalized, and sample i comes from the dataset whose error
weight * max(i, 1) - count is largest (the first one on ties), so after any prefix of n samples
each dataset's share is within about 1/n of its weight. The two arrays (which dataset, which of
its samples) are cached like GPTDataset's.
"""
from typing import Dict, List, Sequence

import numpy as np

from megatron.core.datasets.helpers import build_blending_indices
from megatron.core.datasets.index_cache import IndexCache

INDEX_NAMES = ("dataset_index", "dataset_sample_index")


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum, in float64 exactly as Megatron-Core computes them."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


class BlendedDataset:
    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, *, cache_dir: str,
                 build_indices: bool = True):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        self.datasets: List = list(datasets)
        self.weights = np.asarray(normalize(weights), dtype=np.float64)
        self.size = int(size)
        self.split_name = self.datasets[0].split_name
        description = {
            "class": "BlendedDataset",
            "datasets": [dataset.cache.description for dataset in datasets],
            "split": self.split_name,
            "weights": self.weights.tolist(),
            "size": self.size,
        }
        self.cache = IndexCache(cache_dir, f"BlendedDataset-{self.split_name}", description)
        if build_indices and not self.cache.exists(INDEX_NAMES):
            self.cache.prepare()
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
            self._check_sizes(dataset_index)
            self.cache.save({"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index})
        indices = self.cache.load(INDEX_NAMES)
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]

    def _check_sizes(self, dataset_index: np.ndarray) -> None:
        counts = np.bincount(dataset_index.astype(np.int64), minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, counts):
            if count > len(dataset):
                raise ValueError(f"blending needs {count} samples from {dataset.indexed_dataset.path_prefix} "
                                 f"({dataset.split_name}) but it has {len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for a blend of {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]
