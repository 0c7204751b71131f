"""GPTDatasetConfig and build_gpt_datasets: from `--data-path` / `--split` to train/valid/test datasets."""
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, SampleOptions
from megatron.core.datasets.index_cache import resolve_cache_dir
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.mock_dataset import MockGPTDataset

SPLIT_NAMES = ("train", "valid", "test")
# Each blended component gets this much more than its share, so that rounding never runs it dry (Megatron's margin).
BLEND_MARGIN = 1.005
VOCAB_CHECK_TOKENS = 1 << 20


@dataclass
class GPTDatasetConfig:
    """Everything the GPT datasets need; field names match Megatron's flags."""

    seq_length: int
    """Tokens per sample (each sample reads seq_length + 1 tokens: inputs and shifted labels)."""
    seed: int
    """Seed of the document and sample shuffles; the same seed gives the same order on any number of ranks."""
    data_path: Optional[List[str]]
    """`--data-path`: ["prefix"] or weighted ["0.3", "a", "0.7", "b"]; split into train/valid/test by `split`."""
    split: str = "969,30,1"
    """`--split`: relative sizes of train, valid, test, by documents (e.g. "969,30,1" or "98,2,0")."""
    train_data_path: Optional[List[str]] = None
    """`--train-data-path`: used whole for training (instead of data_path + split)."""
    valid_data_path: Optional[List[str]] = None
    """`--valid-data-path`: used whole for validation."""
    test_data_path: Optional[List[str]] = None
    """`--test-data-path`: used whole for testing."""
    data_cache_path: Optional[str] = None
    """`--data-cache-path`: where index `.npy` files are cached (default: a cache/ dir beside each dataset)."""
    mock: bool = False
    """`--mock-data`: random tokens, no files."""
    vocab_size: Optional[int] = None
    """Tokenizer vocabulary size: required for mock data; for real data, token ids are checked against it."""
    eod_token: Optional[int] = None
    """End-of-document id: needed by reset_position_ids, reset_attention_mask and eod_mask_loss."""
    reset_position_ids: bool = False
    """Restart position ids after every EOD token."""
    reset_attention_mask: bool = False
    """Stop attention across EOD tokens; samples then carry document_ids [s] (each token's document)."""
    eod_mask_loss: bool = False
    """Zero the loss mask at EOD tokens."""

    def __post_init__(self):
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        uses_eod = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if uses_eod and self.eod_token is None:
            raise ValueError("reset_position_ids, reset_attention_mask and eod_mask_loss need eod_token (the tokenizer's eod)")
        if self.mock:
            return
        separate = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if self.data_path and any(separate):
            raise ValueError("give either --data-path (with --split) or --train-data-path/--valid-data-path/--test-data-path, not both")
        if not self.data_path and not any(separate):
            raise ValueError("no data: pass --data-path PREFIX (or --train-data-path ...), or --mock-data")


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> Tuple[List[str], Optional[List[float]]]:
    """["a"] -> (["a"], None); ["0.3", "a", "0.7", "b"] -> (["a", "b"], [0.3, 0.7]); a bare list of prefixes is evenly weighted."""
    data_path = [str(item) for item in data_path]
    if len(data_path) == 1:
        return data_path, None

    def is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if not is_number(data_path[0]):
        if any(is_number(item) for item in data_path):
            raise ValueError(f"{flag} {' '.join(data_path)}: mixes weights and prefixes; use 'W1 PREFIX1 W2 PREFIX2 ...'")
        return data_path, [1.0] * len(data_path)
    if len(data_path) % 2:
        raise ValueError(f"{flag} {' '.join(data_path)}: weighted form needs pairs 'W1 PREFIX1 W2 PREFIX2 ...'")
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        if not is_number(weight) or float(weight) <= 0 or not math.isfinite(float(weight)):
            raise ValueError(f"{flag}: weight {weight!r} before {prefix} must be a positive number")
        weights.append(float(weight))
        prefixes.append(prefix)
    return prefixes, weights


def parse_split(split: str) -> List[float]:
    """'969,30,1' (or '969/30/1', or fewer numbers, padded with 0) -> normalized [train, valid, test]."""
    text = split.replace("/", ",")
    try:
        parts = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(part < 0 for part in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [part / total for part in parts]


def split_boundaries(weights: Sequence[float], num_elements: int) -> List[int]:
    """Megatron's rounding: cumulative rounded shares, shifted so that the last boundary is num_elements."""
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight * float(num_elements))))
    excess = boundaries[-1] - num_elements
    return [0] + [boundary - excess for boundary in boundaries[1:]]


def check_vocab(dataset: IndexedDataset, vocab_size: Optional[int]) -> None:
    """Catch a dataset preprocessed with another tokenizer: its dtype or its first tokens exceed the vocabulary."""
    if not vocab_size:
        return
    dtype = np.dtype(dataset.dtype)
    if dtype.kind in "ui" and np.iinfo(dtype).max + 1 < vocab_size:
        raise ValueError(f"{dataset.path_prefix}.bin stores {dtype.name} token ids, which cannot hold a vocabulary of "
                         f"{vocab_size}: it was preprocessed with a smaller tokenizer; re-run tools/preprocess_data.py "
                         "with the tokenizer you train with")
    head = dataset._bin[:VOCAB_CHECK_TOKENS]
    if head.size and int(head.max()) >= vocab_size:
        raise ValueError(f"{dataset.path_prefix}.bin contains token id {int(head.max())} >= vocab size {vocab_size}: "
                         "it was preprocessed with a different tokenizer; re-run tools/preprocess_data.py with the "
                         "tokenizer you train with")


def _options(config: GPTDatasetConfig) -> SampleOptions:
    return SampleOptions(config.seq_length, config.eod_token, config.reset_position_ids, config.reset_attention_mask,
                         config.eod_mask_loss)


class _Builder:
    """Builds (or, on non-builder ranks, loads) every dataset a config describes."""

    def __init__(self, config: GPTDatasetConfig, build_indices: bool):
        self.config = config
        self.build_indices = build_indices
        self.indexed = {}

    def open(self, prefix: str) -> IndexedDataset:
        if prefix not in self.indexed:
            dataset = IndexedDataset(prefix)
            check_vocab(dataset, self.config.vocab_size)
            self.indexed[prefix] = dataset
        return self.indexed[prefix]

    def gpt(self, prefix: str, split_index: int, split_weights: Sequence[float], num_samples: Optional[int]) -> Optional[GPTDataset]:
        dataset = self.open(prefix)
        bounds = split_boundaries(split_weights, len(dataset))
        documents = np.arange(bounds[split_index], bounds[split_index + 1], dtype=np.int32)
        if documents.size == 0:
            return None
        return GPTDataset(dataset, documents, num_samples, SPLIT_NAMES[split_index], _options(self.config),
                          seed=self.config.seed, cache_dir=resolve_cache_dir(self.config.data_cache_path, prefix),
                          build_indices=self.build_indices)

    def split(self, data_path: Sequence[str], flag: str, split_index: int, split_weights: Sequence[float], num_samples: int):
        prefixes, weights = parse_data_path(data_path, flag)
        if weights is None:
            return self.gpt(prefixes[0], split_index, split_weights, num_samples)
        total = sum(weights)
        parts = []
        for prefix, weight in zip(prefixes, weights):
            share = int(math.ceil(math.ceil(num_samples * weight / total) * BLEND_MARGIN))
            part = self.gpt(prefix, split_index, split_weights, share)
            if part is None:
                raise ValueError(f"{flag}: the {SPLIT_NAMES[split_index]} split of {prefix} is empty with --split "
                                 f"{self.config.split}; every blended dataset needs documents in each used split")
            parts.append(part)
        return BlendedDataset(parts, weights, num_samples,
                              cache_dir=resolve_cache_dir(self.config.data_cache_path, prefixes[0]),
                              build_indices=self.build_indices)

    def all(self, num_samples: Sequence[int]) -> List:
        config = self.config
        results = []
        for index, count in enumerate(num_samples):
            if not count:
                results.append(None)
                continue
            if config.data_path:
                results.append(self.split(config.data_path, "--data-path", index, parse_split(config.split), count))
                continue
            path = (config.train_data_path, config.valid_data_path, config.test_data_path)[index]
            flag = f"--{SPLIT_NAMES[index]}-data-path"
            results.append(self.split(path, flag, index, [float(i == index) for i in range(3)], count) if path else None)
        return results


def build_gpt_datasets(config: GPTDatasetConfig, num_samples: Sequence[int], is_builder_rank: bool = True,
                       barrier: Callable[[], None] = lambda: None):
    """Return (train, valid, test); each is None when its split is empty or asked for 0 samples.

    The builder rank writes the cached indices, then every rank meets at `barrier`, then the
    other ranks read them. Every rank must call this (the barrier is collective).
    """
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples}")
    if config.mock:
        if config.vocab_size is None:
            raise ValueError("mock data needs vocab_size")
        return tuple(MockGPTDataset(int(n), config.seq_length, config.vocab_size, seed=config.seed) if n else None
                     for n in num_samples)
    if is_builder_rank:
        try:
            datasets = _Builder(config, build_indices=True).all(num_samples)
        finally:
            barrier()  # release the other ranks even if building failed; they then report the missing cache
        return tuple(datasets)
    barrier()
    return tuple(_Builder(config, build_indices=False).all(num_samples))
