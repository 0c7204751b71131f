"""GPTDataset: fixed-length training samples cut from the documents of an IndexedDataset.

The rules are Megatron-Core's (`GPTDataset._build_document_sample_shuffle_indices`), so the same
files, split, seq_length, sample count and seed give Megatron-Core's samples in its order:

* Epochs: the fewest E with E * tokens_per_epoch >= num_samples * seq_length + 1 (one epoch when
  num_samples is None).
* Document index: the split's sequence ids repeated E times and shuffled all together by
  `numpy.random.RandomState(seed)`, so a document can appear twice before another appears once.
  With E > 1 and fewer than 80% of an epoch's samples needed from the last epoch, the first E - 1
  epochs are shuffled together and the last epoch on its own ("separate final epoch").
* Sample index: the documents laid end to end in that order and cut into windows of
  seq_length + 1 tokens that overlap by one token (the last input token's label is the next
  window's first token); the last partial window is dropped.
* Shuffle index: a permutation of the samples drawn from the same random state, or with a
  separate final epoch a permutation of the first E - 1 epochs' samples followed by one of the rest.

Three cached arrays describe it all (dtypes as Megatron-Core's):

    document_index  int32 [E * documents]          sequence ids in stream order
    sample_index    int32 or int64 [samples + 1, 2] (position in document_index, token offset) of
                                                   stream position k * seq_length; row 0 is (0, 0)
    shuffle_index   uint32 or int64 [samples]      the order samples are served in
"""
import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from megatron.core.datasets.helpers import build_sample_idx
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.indexed_dataset import IndexedDataset

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
# Megatron's rule: with more than one epoch, shuffle the last epoch's samples on their own when
# fewer than this fraction of it is used, so a partial epoch does not skew the early order.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True)
class SampleOptions:
    """How a token window becomes a training sample."""

    seq_length: int
    eod_token: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True  # False: no mask in the sample, even with reset_attention_mask (as Megatron)


def get_ltor_masks_and_position_ids(tokens: np.ndarray, options: SampleOptions) -> Dict[str, np.ndarray]:
    """Loss mask, position ids and (with reset_attention_mask, unless create_attention_mask is off)
    document_ids: the index, within the sample, of the document each token belongs to (an
    end-of-document token ends its document). The model turns them into document-aware causal
    attention; no s x s mask is built here. Without them attention is causal over the sample."""
    length = tokens.shape[0]
    loss_mask = np.ones(length, dtype=np.float32)
    position_ids = np.arange(length, dtype=np.int64)
    result = {"loss_mask": loss_mask, "position_ids": position_ids}
    eod_positions = np.flatnonzero(tokens == options.eod_token) if options.eod_token is not None else np.zeros(0, np.int64)
    if options.eod_mask_loss:
        loss_mask[eod_positions] = 0.0
    if options.reset_attention_mask and options.create_attention_mask:
        document_ids = np.zeros(length, dtype=np.int64)
        document_ids[eod_positions[eod_positions + 1 < length] + 1] = 1
        result["document_ids"] = np.cumsum(document_ids)  # tokens after an EOD start the next document
    if options.reset_position_ids:
        start = 0
        for position in eod_positions:
            position_ids[position + 1:] -= position + 1 - start
            start = position + 1
    return result


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool = False) -> np.ndarray:
    """The documents repeated num_epochs times, shuffled together (the last epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng)
    last = build_document_index(documents, 1, rng)
    return np.concatenate((first, last))


def build_shuffle_index(first_block: int, num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, first_block) followed by a permutation of [first_block, num_samples)."""
    dtype = np.uint32 if num_samples < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(first_block, dtype=dtype)
    rng.shuffle(first)
    if first_block == num_samples:
        return first
    rest = np.arange(first_block, num_samples, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate((first, rest))


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Fewest epochs that yield num_samples windows (one epoch when num_samples is not given)."""
    if not num_samples:
        return 1
    needed = num_samples * seq_length + 1
    return -(-needed // tokens_per_epoch)


def uses_separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_epochs: int, num_samples: Optional[int]) -> bool:
    """Megatron's rule: shuffle the last epoch apart when fewer than 80% of its samples are used."""
    if num_epochs == 1:
        return False
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - samples_before_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


class GPTDataset:
    """Samples of one split of one IndexedDataset; see the module docstring for the indices."""

    def __init__(self, indexed_dataset: IndexedDataset, documents: np.ndarray, num_samples: Optional[int],
                 split_name: str, options: SampleOptions, *, seed: int, cache_dir: str, build_indices: bool = True):
        self.indexed_dataset = indexed_dataset
        self.split_name = split_name
        self.options = options
        self.seed = seed
        sizes = indexed_dataset.sequence_lengths
        self.tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64)) if len(documents) else 0
        seq_length = options.seq_length
        if self.tokens_per_epoch < seq_length + 1 and not num_samples:
            raise ValueError(f"the {split_name} split of {indexed_dataset.path_prefix} has {self.tokens_per_epoch} tokens, "
                             f"fewer than seq_length + 1 = {seq_length + 1}; use more data, a shorter `seq_length` "
                             "or a different `split`")
        if self.tokens_per_epoch == 0:
            raise ValueError(f"the {split_name} split of {indexed_dataset.path_prefix} has no tokens; change `split`")
        self.num_epochs = plan_epochs(self.tokens_per_epoch, seq_length, num_samples)
        description = {
            "class": "GPTDataset",
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            "dataset_sequences": len(indexed_dataset),
            "dataset_tokens": indexed_dataset.num_tokens,
            "split": split_name,
            "documents": [int(documents[0]), int(documents[-1]), len(documents)] if len(documents) else [],
            "num_samples": num_samples,
            "num_epochs": self.num_epochs,
            "seq_length": seq_length,
            "seed": seed,
        }
        self.cache = IndexCache(cache_dir, f"GPTDataset-{split_name}", description)
        if build_indices and not self.cache.exists(INDEX_NAMES):
            self.cache.prepare()
            self.cache.save(self._build_indices(documents, num_samples))
        indices = self.cache.load(INDEX_NAMES)
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def _build_indices(self, documents: np.ndarray, num_samples: Optional[int]) -> Dict[str, np.ndarray]:
        seq_length, epochs, tokens = self.options.seq_length, self.num_epochs, self.tokens_per_epoch
        separate_final_epoch = uses_separate_final_epoch(tokens, seq_length, epochs, num_samples)
        total_samples = (epochs * tokens - 1) // seq_length
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(documents, epochs, rng, separate_final_epoch)
        sample_index = build_sample_idx(self.indexed_dataset.sequence_lengths, document_index, seq_length, total_samples)
        first_block = ((epochs - 1) * tokens - 1) // seq_length if separate_final_epoch else total_samples
        shuffle_index = build_shuffle_index(first_block, total_samples, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def window(self, sample: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `sample` in unshuffled (stream) order."""
        (first, start), (last, end) = self.sample_index[sample], self.sample_index[sample + 1]
        dataset = self.indexed_dataset
        if first == last:
            return dataset.get(int(self.document_index[first]), offset=int(start), length=int(end - start + 1))
        pieces = [dataset.get(int(self.document_index[first]), offset=int(start))]
        pieces.extend(dataset.get(int(self.document_index[i])) for i in range(first + 1, last))
        pieces.append(dataset.get(int(self.document_index[last]), length=int(end + 1)))
        return np.concatenate(pieces)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for the {self.split_name} split ({len(self)} samples)")
        window = self.window(int(self.shuffle_index[index])).astype(np.int64)
        tokens, labels = window[:-1], window[1:]
        sample = {"tokens": tokens, "labels": labels}
        sample.update(get_ltor_masks_and_position_ids(tokens, self.options))
        return sample
