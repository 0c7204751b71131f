"""Micro-batch loading: which samples each data-parallel rank reads, in which order.

Samples are consumed in index order (the dataset itself is shuffled). Each step of
`micro_batch_size x dp` consecutive samples is split so that data-parallel rank r takes the r-th
slice, as Megatron's pretraining sampler does. Resuming at `consumed_samples` continues the exact
sequence, independent of the number of ranks.
"""
import numpy as np
import torch


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self):
        step = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(first + start, first + start + self.micro_batch_size))


def collate(samples: list) -> dict:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def build_loader(dataset, consumed_samples: int, micro_batch_size: int, groups, num_workers: int):
    if dataset is None or len(dataset) == 0:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, groups.dp_rank, groups.dp_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate, pin_memory=groups.device.type == "cuda",
                                       persistent_workers=num_workers > 0)


def cyclic(loader):
    """Iterates a loader forever (evaluation passes restart from its beginning)."""
    while True:
        yield from loader
