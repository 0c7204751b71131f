"""Micro-batch loading: which samples each data-parallel rank reads, in which order.

`--dataloader-type single` (the default): samples are consumed in index order (the dataset itself is
shuffled). Each step of `micro_batch_size x dp` consecutive samples is split so that data-parallel
rank r takes the r-th slice, as Megatron's pretraining sampler does. Resuming at `consumed_samples`
continues the exact sequence, independent of the number of ranks.

`--dataloader-type cyclic`: Megatron-LM's random sampler. The dataset is read in epochs, each a fresh
permutation drawn from a torch generator seeded with the epoch number (Megatron-LM seeds it with the
epoch alone, not --seed); with data sharding (the default, `--no-data-sharding` turns it off) each
data-parallel rank permutes its own contiguous bucket of the dataset, otherwise one permutation of
the whole dataset is dealt out rank by rank. The loader restarts for the next epoch when one ends,
and `consumed_samples` resumes mid-epoch at the same place, for the same data-parallel size.
"""
import itertools
import os

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


class CyclicSampler:
    """Megatron-LM's `MegatronPretrainingRandomSampler`: micro-batches of a random order, epoch after
    epoch. One pass over it is the rest of the current epoch; the next pass is the next epoch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 data_sharding: bool = True):
        step = micro_batch_size * dp_size
        if total_samples < step:
            raise ValueError(f"--dataloader-type cyclic: the dataset has {total_samples} samples, fewer than one step "
                             f"of --micro-batch-size ({micro_batch_size}) x data-parallel size ({dp_size}) = {step}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.data_sharding = data_sharding

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank."""
        return self.total_samples // (self.micro_batch_size * self.dp_size)

    def _epoch_order(self, epoch: int, offset: int) -> list:
        """This rank's sample indices for the rest of `epoch`, `offset` samples (all ranks) into it."""
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.data_sharding:  # each rank shuffles its own contiguous bucket
            bucket_size = self.__len__() * self.micro_batch_size
            start = self.dp_rank * bucket_size
            order = torch.randperm(bucket_size, generator=generator).tolist()
            return [start + index for index in order[offset // self.dp_size:]]
        whole = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        order = torch.randperm(whole, generator=generator).tolist()
        return order[offset:][self.dp_rank::self.dp_size]

    def __iter__(self):
        step = self.micro_batch_size * self.dp_size
        epoch_samples = self.total_samples - self.total_samples % step
        epoch, offset = divmod(self.consumed_samples, epoch_samples)
        if offset % step:
            raise ValueError(f"consumed samples ({self.consumed_samples}) is not a whole number of steps of {step} "
                             "samples: resume --dataloader-type cyclic with the micro-batch and data-parallel sizes "
                             "of the saved run")
        order = self._epoch_order(epoch, offset)
        for first in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += step
            yield order[first:first + self.micro_batch_size]


def collate(samples: list) -> dict:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def build_loader(dataset, consumed_samples: int, micro_batch_size: int, groups, num_workers: int,
                 dataloader_type: str = "single", data_sharding: bool = True):
    """The data loader of one split for this rank, or None without data. A cyclic loader is to be
    iterated with `endless`."""
    if dataset is None or len(dataset) == 0:
        return None
    if dataloader_type == "cyclic":
        sampler = CyclicSampler(len(dataset), consumed_samples, micro_batch_size, groups.dp_rank, groups.dp_size,
                                data_sharding)
    else:
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, groups.dp_rank, groups.dp_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate, pin_memory=groups.device.type == "cuda",
                                       persistent_workers=num_workers > 0)


def endless(loader):
    """The micro-batches of a cyclic loader, epoch after epoch: each pass over the loader asks its
    sampler for the next epoch (Megatron-LM's `cyclic_iter`)."""
    return itertools.chain.from_iterable(iter(loader) for _ in itertools.count())


def sft_dataset_config(config):
    """--sft: the conversation datasets' settings, from the data, training and parallel flags."""
    from megatron.core.datasets.sft import SFTDatasetConfig

    d, t = config.data, config.training
    return SFTDatasetConfig(
        seq_length=t.seq_length, seed=t.seed, data_path=d.data_path or None, split=d.split,
        train_data_path=d.train_data_path or None, valid_data_path=d.valid_data_path or None,
        test_data_path=d.test_data_path or None, prompt_format=d.sft_tokenizer_prompt_format,
        context_parallel_size=config.parallel.context_parallel_size, truncate=d.sft_truncation,
        skip_bad_lines=d.sft_skip_bad_lines)


def build_tokenizer(config):
    """The run's tokenizer from its data flags, or None when none is implied (then --vocab-size
    alone sizes the model). pretrain_gpt.py and tools/plan.py build it here, so they agree."""
    from megatron.core.tokenizers import build_tokenizer as build
    from megatron.training.validation import implied_tokenizer_type

    d = config.data
    tokenizer_type = implied_tokenizer_type(d)
    if tokenizer_type is None:
        return None
    return build(tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                 tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size)


def tokenizer_record_of(config, tokenizer) -> dict:
    from megatron.core.datasets.tokenizer_record import tokenizer_record

    d = config.data
    return tokenizer_record(tokenizer, d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                            tokenizer_model=d.tokenizer_model)


def check_sft_inputs(config, tokenizer) -> None:
    """--sft, before the model is built: the tokenizer suits the prompt format, every JSONL file
    reads (a bad line stops here with its file and line, unless --sft-skip-bad-lines), and every
    preprocessed prefix has its tokens and mask, written with this tokenizer."""
    from megatron.core.datasets.sft import (check_chat_tokenizer, is_jsonl, mask_prefix, read_conversations,
                                            split_sources)
    from megatron.core.datasets.tokenizer_record import check_record

    sft_config = sft_dataset_config(config)
    check_chat_tokenizer(tokenizer, sft_config.prompt_format)
    paths = {path for source in split_sources(sft_config) if source is not None for path in source[0]}
    for path in sorted(paths):
        if is_jsonl(path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"--sft data file {path} does not exist")
            read_conversations(path, sft_config.skip_bad_lines)
            continue
        for prefix in (path, mask_prefix(path)):
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise FileNotFoundError(f"--sft: {prefix}{suffix} does not exist (--data-path names JSONL files "
                                            "or the prefix tools/preprocess_sft.py wrote, {prefix}_messages_document)")
        check_record(path, tokenizer_record_of(config, tokenizer))
