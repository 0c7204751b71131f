"""Pretrain a GPT / Llama model.

    torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron-LM flags)
    python pretrain_gpt.py ...                                                    (one process)

This file only says what a GPT step is (batch -> model -> masked token loss) and where the data
comes from; `megatron.training` does the rest.
"""
import sys
from functools import partial

import torch

from megatron.core.context_parallel import slice_batch
from megatron.core.distributed import comm
from megatron.core.transformer.multi_token_prediction import mtp_loss
from megatron.training.arguments import parse_args
from megatron.training.config import Config
from megatron.training.data import build_tokenizer
from megatron.training.startup import dry_run
from megatron.training.training import pretrain, print_rank_0
from megatron.training.validation import implied_tokenizer_type


def get_batch(data_iterator, groups, fields=None) -> dict:
    """The next micro-batch with `fields` (all when None) moved to this rank's device; with context
    parallelism, this rank's two chunks of the sequence (chunks r and 2C-1-r of 2C, position ids
    kept global)."""
    batch = next(data_iterator)
    batch = {key: value.to(groups.device, non_blocking=True) for key, value in batch.items()
             if fields is None or key in fields}
    return slice_batch(batch, groups.cp_size, groups.cp_rank)


def stage_fields(model) -> set:
    """The batch fields a model chunk reads: tokens on the first pipeline stage (and on the last
    with multi-token prediction, which embeds them), labels and the loss mask on the last,
    positions (rotary embeddings) and document ids (packed-document attention) on every stage."""
    model = getattr(model, "module", model)
    fields = {"position_ids", "document_ids"}
    if model.pre_process or getattr(model, "mtp_process", False):
        fields.add("tokens")
    if model.post_process:
        fields.update(("labels", "loss_mask"))
    return fields


def loss_func(loss_mask: torch.Tensor, cp_group, calculate_per_token_loss: bool, token_losses,
              mtp_loss_scaling_factor: float = 0.1):
    """Mean loss over the micro-batch's unmasked tokens; reports [sum, count] so averages weight
    tokens equally. With multi-token prediction (`token_losses` then the model's pair of main and
    MTP per-token losses) the MTP term is added and each depth's loss reported (mtp_loss).

    With context parallelism a rank holds part of the sequence: its sum is divided by the count
    over all CP ranks, and multiplied by the CP size because gradients are averaged over the data x
    context ranks, so the gradients equal those of the whole micro-batch's mean.

    With --calculate-per-token-loss the loss is the sum itself: training divides the gradients by
    the token count of the whole global batch."""
    if isinstance(token_losses, tuple):
        token_losses, mtp_token_losses = token_losses
        loss, reported = loss_func(loss_mask, cp_group, calculate_per_token_loss, token_losses)
        extra, mtp_reported = mtp_loss(mtp_token_losses, loss_mask, mtp_loss_scaling_factor, calculate_per_token_loss)
        return loss + extra, reported | mtp_reported
    loss_mask = loss_mask.float()
    total = (token_losses.float() * loss_mask).sum()
    count = loss_mask.sum()
    if calculate_per_token_loss:
        return total, {"lm loss": torch.stack([total.detach(), count])}
    micro_batch_count = count.clone()
    comm.all_reduce(micro_batch_count, cp_group)
    loss = total * comm.size(cp_group) / micro_batch_count.clamp(min=1.0)
    return loss, {"lm loss": torch.stack([total.detach(), count])}


def forward_step(data_iterator, model, calculate_per_token_loss: bool = False):
    groups = model.groups  # the model chunk's (and its data-parallel wrapper's) parallel layout
    batch = get_batch(data_iterator, groups, stage_fields(model))
    output = model(batch.get("tokens"), batch["position_ids"], labels=batch.get("labels"),
                   document_ids=batch.get("document_ids"))
    config = getattr(model, "module", model).config
    return output, partial(loss_func, batch.get("loss_mask"), groups.cp, calculate_per_token_loss,
                           mtp_loss_scaling_factor=config.mtp_loss_scaling_factor)


def _tokenizer_record(config: Config, tokenizer):
    from megatron.core.datasets.tokenizer_record import tokenizer_record

    d = config.data
    if tokenizer is None:
        return None
    return tokenizer_record(tokenizer, implied_tokenizer_type(d), vocab_file=d.vocab_file, merge_file=d.merge_file,
                            tokenizer_model=d.tokenizer_model)


def gpt_dataset_config(config: Config, tokenizer=None, vocab_size: int = 0):
    from megatron.core.datasets import GPTDatasetConfig

    d, t = config.data, config.training
    return GPTDatasetConfig(
        seq_length=t.seq_length, seed=t.seed, data_path=d.data_path or None, split=d.split,
        train_data_path=d.train_data_path or None, valid_data_path=d.valid_data_path or None,
        test_data_path=d.test_data_path or None, data_cache_path=d.data_cache_path, mock=d.mock_data,
        vocab_size=vocab_size, eod_token=tokenizer.eod if tokenizer is not None else None,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss, mmap_bin_files=d.mmap_bin_files,
        create_attention_mask=d.create_attention_mask_in_dataloader,
        tokenizer_record=_tokenizer_record(config, tokenizer))


def check_inputs(config: Config, tokenizer=None, vocab_size: int = 0) -> None:
    """The data files and blends, opened and checked before the model is built."""
    from megatron.core.datasets import check_data_inputs

    if config.data.sft:
        from megatron.training.data import check_sft_inputs

        check_sft_inputs(config, tokenizer)
        return

    check_data_inputs(gpt_dataset_config(config, tokenizer, vocab_size))


def datasets_provider(config: Config, groups, num_samples: tuple, tokenizer=None, vocab_size: int = 0):
    from megatron.core.datasets import build_gpt_datasets

    if config.data.sft:  # conversations: packed, assistant-only loss mask, document ids (docs/finetuning.md)
        from megatron.core.datasets.sft import build_sft_datasets
        from megatron.training.data import sft_dataset_config

        return build_sft_datasets(sft_dataset_config(config), tokenizer, num_samples, log=print_rank_0)

    return build_gpt_datasets(gpt_dataset_config(config, tokenizer, vocab_size), num_samples=num_samples,
                              is_builder_rank=groups.global_rank == 0, barrier=comm.barrier)


def main(argv=None):
    config = parse_args(argv)
    tokenizer = build_tokenizer(config)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else config.data.vocab_size
    if vocab_size is None:
        raise SystemExit("error: no vocabulary size: pass --tokenizer-type (with its files) or --vocab-size N")
    if config.training.dry_run:
        dry_run(config, vocab_size, partial(check_inputs, tokenizer=tokenizer, vocab_size=vocab_size))
        return
    provider = partial(datasets_provider, tokenizer=tokenizer, vocab_size=vocab_size)
    step = partial(forward_step, calculate_per_token_loss=config.training.calculate_per_token_loss)
    state = pretrain(config, forward_step_func=step, datasets_provider=provider, vocab_size=vocab_size,
                     check_inputs=partial(check_inputs, tokenizer=tokenizer, vocab_size=vocab_size))
    reason = f" ({state.exit_reason})" if state.exit_reason else ""
    print_rank_0(f"> training finished after {state.iteration} iterations{reason}")


if __name__ == "__main__":
    from megatron.training.reliability.exits import exit_on_error

    exit_on_error(main, sys.argv[1:])
