"""GPTDatasetConfig and build_gpt_datasets: from `--data-path` / `--split` to train/valid/test datasets."""
import math
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset, normalize
from megatron.core.datasets.gpt_dataset import GPTDataset, SampleOptions
from megatron.core.datasets.index_cache import resolve_cache_dir
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.mock_dataset import MockGPTDataset
from megatron.core.datasets.tokenizer_record import check_record

SPLIT_NAMES = ("train", "valid", "test")
# Each blended component builds this fraction more samples than it contributes (Megatron's mid-level surplus).
MID_LEVEL_DATASET_SURPLUS = 0.005
VOCAB_CHECK_TOKENS = 1 << 20


@dataclass
class GPTDatasetConfig:
    """Everything the GPT datasets need; field names match Megatron's flags."""

    seq_length: int
    """Tokens per sample (each sample reads seq_length + 1 tokens: inputs and shifted labels)."""
    seed: int
    """Seed of the document and sample shuffles; the same seed gives the same order on any number of ranks."""
    data_path: Optional[List[str]]
    """`--data-path`: ["prefix"], weighted ["0.3", "a", "0.7", "b"], or bare ["a", "b"] (weighted by size, each
    used once); split into train/valid/test by `split`."""
    split: str = "969,30,1"
    """`--split`: relative sizes of train, valid, test, by sequences (e.g. "969,30,1" or "98,2,0")."""
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
    mmap_bin_files: bool = True
    """Memory-map the .bin files (`--no-mmap-bin-files`: read each whole into memory instead)."""
    create_attention_mask: bool = True
    """`--no-create-attention-mask-in-dataloader`: samples carry no attention mask (causal attention),
    even with reset_attention_mask."""
    tokenizer_record: Optional[dict] = None
    """The run's tokenizer (`tokenizer_record.tokenizer_record`): datasets that record another one are an error."""

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


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's blend list: ["a"] -> (["a"], None); ["0.3", "a", "0.7", "b"] -> (["a", "b"], [0.3, 0.7]);
    bare prefixes ["a", "b"] -> (["a", "b"], None), which blends them in proportion to their sizes."""
    data_path = [str(item).strip() for item in data_path]
    if not data_path:
        raise ValueError(f"{flag} is empty: give 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...'")
    if not _is_number(data_path[0]):
        if any(_is_number(item) for item in data_path):
            raise ValueError(f"{flag} {' '.join(data_path)}: mixes weights and prefixes; use 'W1 PREFIX1 W2 PREFIX2 ...'")
        return data_path, None
    if len(data_path) % 2:
        raise ValueError(f"{flag} {' '.join(data_path)}: weighted form needs pairs 'W1 PREFIX1 W2 PREFIX2 ...'")
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        if not _is_number(weight) or not float(weight) > 0 or not math.isfinite(float(weight)):
            raise ValueError(f"{flag}: weight {weight!r} before {prefix} must be a positive number")
        if _is_number(prefix):
            raise ValueError(f"{flag}: {prefix!r} after weight {weight} is a number, not a dataset prefix; "
                             "use 'W1 PREFIX1 W2 PREFIX2 ...'")
        weights.append(float(weight))
        prefixes.append(prefix)
    return prefixes, weights


def parse_split(split: str) -> List[float]:
    """'969,30,1' (or '969/30/1', or fewer numbers, padded with 0) -> [train, valid, test], normalized as Megatron does."""
    # Megatron-LM's example scripts pass the value with its quotes ("--split '99,1,0'" split by the shell).
    parts = [part.strip() for part in split.strip().strip("'\"").replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"[0-9]*\.?[0-9]+|[0-9]+\.", part) for part in parts) \
            or sum(float(part) for part in parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    values = [float(part) for part in parts] + [0.0] * (3 - len(parts))
    return normalize(values)


def split_matrix(split_vector: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Megatron's book-ends: cumulative sums of the normalized split, None for a split of weight 0."""
    ends = [0]
    for weight in split_vector:
        ends.append(ends[-1] + weight)
    return [(begin, end) if end > begin else None for begin, end in zip(ends[:-1], ends[1:])]


def split_range(bookend: Tuple[float, float], num_elements: int) -> Tuple[int, int]:
    """Megatron's rounding: each book-end times the number of sequences, rounded (half to even)."""
    return int(round(bookend[0] * float(num_elements))), int(round(bookend[1] * float(num_elements)))


def split_boundaries(split_vector: Sequence[float], num_elements: int) -> List[Optional[Tuple[int, int]]]:
    """[begin, end) of each split's sequences, or None for a split of weight 0."""
    return [split_range(bookend, num_elements) if bookend else None for bookend in split_matrix(split_vector)]


def blend_sizes(weights: Sequence[float], num_samples: int) -> Tuple[List[int], List[int]]:
    """Megatron's per-dataset sample counts: (used, built), built with the 0.5% surplus."""
    used = [int(math.ceil(num_samples * weight)) for weight in weights]
    built = [int(math.ceil(count * (1 + MID_LEVEL_DATASET_SURPLUS))) for count in used]
    return used, built


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
                         config.eod_mask_loss, config.create_attention_mask)


class _Builder:
    """Builds (or, on non-builder ranks, loads) every dataset a config describes, as Megatron-Core's
    BlendedMegatronDatasetBuilder does."""

    def __init__(self, config: GPTDatasetConfig, build_indices: bool):
        self.config = config
        self.build_indices = build_indices
        self.indexed = {}

    def sources(self) -> List[Tuple[Sequence[str], str, List[Optional[Tuple[float, float]]]]]:
        """(blend list, its flag, split matrix) for each of train, valid, test; the blend list is None when absent."""
        config = self.config
        if config.data_path:
            matrix = split_matrix(parse_split(config.split))
            return [(config.data_path, "--data-path", matrix)] * 3
        separate = (config.train_data_path, config.valid_data_path, config.test_data_path)
        whole = [[(0.0, 1.0) if j == i else None for j in range(3)] for i in range(3)]
        return [(path, f"--{SPLIT_NAMES[i]}-data-path", whole[i]) for i, path in enumerate(separate)]

    def check_inputs(self) -> None:
        """Parse every blend and open every dataset: bad flags and files fail before any index is built."""
        for data_path, flag, _ in self.sources():
            if data_path:
                for prefix in parse_data_path(data_path, flag)[0]:
                    self.open(prefix, flag)

    def open(self, prefix: str, flag: str = "--data-path") -> IndexedDataset:
        if prefix not in self.indexed:
            try:
                dataset = IndexedDataset(prefix, mmap=self.config.mmap_bin_files)
            except FileNotFoundError as error:
                raise FileNotFoundError(f"{flag}: {error}") from None
            check_record(prefix, self.config.tokenizer_record)  # names both tokenizers: more telling, so first
            check_vocab(dataset, self.config.vocab_size)
            self.indexed[prefix] = dataset
        return self.indexed[prefix]

    def gpt(self, prefix: str, split_index: int, bookend: Tuple[float, float], num_samples: Optional[int]) -> Optional[GPTDataset]:
        dataset = self.open(prefix)
        begin, end = split_range(bookend, len(dataset))
        if begin >= end:
            return None
        documents = np.arange(begin, end, dtype=np.int32)
        return GPTDataset(dataset, documents, num_samples, SPLIT_NAMES[split_index], _options(self.config),
                          seed=self.config.seed, cache_dir=resolve_cache_dir(self.config.data_cache_path, prefix),
                          build_indices=self.build_indices)

    def split(self, data_path: Sequence[str], flag: str, split_index: int, bookend: Tuple[float, float], num_samples: int):
        prefixes, weights = parse_data_path(data_path, flag)
        if len(prefixes) == 1 and weights is None:
            dataset = self.gpt(prefixes[0], split_index, bookend, num_samples)
            if dataset is None and split_index == 0:
                raise ValueError(f"{flag}: the train split of {prefixes[0]} ({len(self.open(prefixes[0]))} sequences) is "
                                 f"empty with --split {self.config.split}; give it a larger share or use more data")
            return dataset
        if weights is None:  # Megatron: each dataset once (one epoch), blended in proportion to its size
            parts = self.parts(prefixes, flag, split_index, bookend, [None] * len(prefixes))
            weights = [len(part) for part in parts]
            size = min(num_samples, sum(weights))
            if split_index == 0 and size < num_samples:
                raise ValueError(f"{flag} without weights uses each dataset's {SPLIT_NAMES[split_index]} split once, as "
                                 f"Megatron does: {size} samples, fewer than the {num_samples} training needs; give "
                                 "weights ('W1 PREFIX1 W2 PREFIX2 ...') to repeat data, or train for fewer samples")
        else:
            weights = normalize(weights)
            used, built = blend_sizes(weights, num_samples)
            parts = self.parts(prefixes, flag, split_index, bookend, built)
            size = sum(used)
        return BlendedDataset(parts, weights, size, cache_dir=resolve_cache_dir(self.config.data_cache_path, prefixes[0]),
                              build_indices=self.build_indices)

    def parts(self, prefixes: Sequence[str], flag: str, split_index: int, bookend: Tuple[float, float],
              sizes: Sequence[Optional[int]]) -> List[GPTDataset]:
        parts = []
        for prefix, size in zip(prefixes, sizes):
            part = self.gpt(prefix, split_index, bookend, size)
            if part is None:
                raise ValueError(f"{flag}: the {SPLIT_NAMES[split_index]} split of {prefix} is empty with --split "
                                 f"{self.config.split}; every blended dataset needs sequences in each used split")
            parts.append(part)
        return parts

    def all(self, num_samples: Sequence[int]) -> List:
        results = []
        for index, ((data_path, flag, matrix), count) in enumerate(zip(self.sources(), num_samples)):
            if index == 0 and count and data_path and matrix[index] is None:
                raise ValueError(f"--split {self.config.split} gives the train split no share, but training needs "
                                 f"{count} samples; give it a positive first number, e.g. 969,30,1")
            if not count or not data_path or matrix[index] is None:
                results.append(None)
                continue
            results.append(self.split(data_path, flag, index, matrix[index], count))
        return results


def check_data_inputs(config: GPTDatasetConfig) -> None:
    """Parse `--split` and every blend and open every dataset (no index is built): for callers that
    want bad flags and files reported before anything expensive, e.g. before building the model."""
    if not config.mock:
        _Builder(config, build_indices=False).check_inputs()


def build_gpt_datasets(config: GPTDatasetConfig, num_samples: Sequence[int], is_builder_rank: bool = True,
                       barrier: Callable[[], None] = lambda: None):
    """Return (train, valid, test); each is None when its split is empty or asked for 0 samples.

    The same files, split, seq_length, seed and sample counts give exactly Megatron-Core's samples
    (BlendedMegatronDatasetBuilder + GPTDataset + BlendedDataset), in its order. The builder rank
    writes the cached indices, then every rank meets at `barrier`, then the other ranks read them.
    Every rank must call this (the barrier is collective).
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
            builder = _Builder(config, build_indices=True)
            builder.check_inputs()
            datasets = builder.all(num_samples)
        finally:
            barrier()  # release the other ranks even if building failed; they then report the missing cache
        return tuple(datasets)
    barrier()
    return tuple(_Builder(config, build_indices=False).all(num_samples))
