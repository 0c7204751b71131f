"""Weights-only checkpoints in this framework's format, written from and read into the *logical*
state ({global parameter name: {part: full tensor}}) that the Hugging Face and Megatron-LM mappings
produce: library code, used by tools/checkpoint/convert.py and tools/verify_correctness.py (one
process, no torch.distributed).

A converted checkpoint is an ordinary one at iteration 0 without optimizer or RNG state: load it
with `--load DIR --finetune` (add `--use-checkpoint-args` to take the model flags from it), or read
it back with `read_weights`.
"""
import dataclasses
import os
from typing import Optional

import torch

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.checkpointing.architecture import check_trainable, config_of_checkpoint, record, saved_args
from megatron.core.checkpointing.directory import (
    COMMON_FILE,
    FORMAT,
    FORMAT_VERSION,
    TRACKER_FILE,
    checkpoint_dir,
    read_common,
    tracked_iteration,
    write_json_atomically,
    write_text_atomically,
)
from megatron.core.checkpointing.sharded import Boxes, ShardedState, split_tensor_key, tensor_key
from megatron.core.checkpointing.state import MODEL
from megatron.core.models.gpt.model import WORD_EMBEDDINGS
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe.experts import split_experts, stack_experts


def write_weights(root: str, logical: dict, config: TransformerConfig, vocab_size: int, *,
                  make_vocab_size_divisible_by: int = 128, iteration: int = 0) -> str:
    """Writes `logical` as the checkpoint of `iteration` in `root` (atomically, tracker last);
    returns the checkpoint directory. `vocab_size` is the unpadded vocabulary."""
    from megatron.core.checkpointing import checksums
    from megatron.core.checkpointing.storage import save_state

    check_trainable(config)

    state = ShardedState()
    for name, parts in split_experts(logical).items():
        for part, tensor in parts.items():
            tensor = tensor.detach().contiguous()
            state.sharded[tensor_key(MODEL, name, part)] = Boxes(tuple(tensor.shape), tensor.dtype, [((0,) * tensor.dim(), tensor)])
    os.makedirs(root, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    incomplete = final + ".incomplete"
    save_state(state, incomplete)
    config = dataclasses.replace(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    common = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": iteration,
              "train_state": {"iteration": iteration}, "optimizer": None, "rng_layout": None,
              "model": record(config, vocab_size), "args": {"model": saved_args(config)},
              "checksums": checksums.of_directory(incomplete)}
    write_json_atomically(os.path.join(incomplete, COMMON_FILE), common)
    if os.path.exists(final):
        raise FileExistsError(f"{final} already exists; choose an empty --target")
    os.rename(incomplete, final)
    write_text_atomically(os.path.join(root, TRACKER_FILE), str(iteration))
    return final


def read_weights(path: str, iteration: Optional[int] = None) -> tuple:
    """(logical state, TransformerConfig, unpadded vocab size, common.json) of the checkpoint in
    `path`: a save directory (its latest, or `iteration`) or one iter_NNNNNNN directory."""
    from megatron.core.checkpointing.storage import read_full_tensors, saved_shapes

    directory = path
    if not os.path.isfile(os.path.join(path, COMMON_FILE)):
        iteration = tracked_iteration(path) if iteration is None else iteration
        if iteration is None:
            raise CheckpointFormatError(f"{path}: no checkpoint found (no {TRACKER_FILE})")
        directory = checkpoint_dir(path, iteration)
        if not os.path.isdir(directory):
            raise CheckpointFormatError(f"{directory} does not exist: no checkpoint of iteration {iteration} in {path}")
    common = read_common(directory)
    keys = [key for key in saved_shapes(directory) if key.startswith(MODEL + "/")]
    logical = {}
    for key, tensor in read_full_tensors(directory, keys).items():
        name, part = split_tensor_key(key, MODEL)
        logical.setdefault(name, {})[part] = tensor
    logical = stack_experts(logical)  # one entry per global expert on disk, stacked [E, ...] in the model
    config = config_of_checkpoint(common, padded_vocab_size=logical[WORD_EMBEDDINGS][""].shape[0])
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)  # weights to convert or evaluate
    return logical, config, common["model"]["vocab_size"], common



# ---------------------------------------------------------------------------------------------
# Hugging Face directories (local only: never a hub download, never remote code)
# ---------------------------------------------------------------------------------------------
SAFETENSORS_SHARD_BYTES = 5 * 1024 ** 3


def read_hf(path: str) -> tuple:
    """(transformers config, state dict) of a local Hugging Face model directory: config.json and
    *.safetensors (or pytorch_model*.bin, read with weights_only=True)."""
    import glob

    import transformers
    from safetensors import safe_open

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointFormatError(f"{path} is not a local Hugging Face model directory (no config.json); "
                                    "download the model first, e.g. with `huggingface-cli download`")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    state = {}
    if files:
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    state[key] = handle.get_tensor(key)
        return config, state
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise CheckpointFormatError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        state.update(torch.load(file, map_location="cpu", weights_only=True))
    return config, state


def write_hf(path: str, config, state: dict) -> None:
    """config.json plus safetensors files (sharded at 5 GiB, with the index transformers reads)."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    shards, current, size = [], {}, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SAFETENSORS_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor.contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=1)
