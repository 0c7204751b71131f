"""Weights-only checkpoints in this framework's format, written from and read into the *logical*
state ({global parameter name: {part: full tensor}}) that the Hugging Face and Megatron-LM mappings
produce. Used by tools/checkpoint/convert.py and tools/verify_correctness.py (one process, no
torch.distributed).

A converted checkpoint is an ordinary one at iteration 0 without optimizer or RNG state: load it
with `--load DIR --finetune` (add `--use-checkpoint-args` to take the model flags from it), or read
it back with `read_weights`.
"""
import os
from typing import Optional

import torch

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.checkpointing.sharded import Boxes, ShardedState, split_tensor_key, tensor_key
from megatron.core.checkpointing.state import MODEL
from megatron.core.transformer.config import TransformerConfig
from megatron.training.checkpointing import (
    COMMON_FILE,
    FORMAT,
    FORMAT_VERSION,
    TRACKER_FILE,
    write_json_atomically,
    write_text_atomically,
    architecture,
    checkpoint_dir,
    locate,
    read_common,
)


def model_args(config: TransformerConfig, make_vocab_size_divisible_by: int) -> dict:
    """The Megatron model flags (as config field names) that build `config`."""
    return {
        "num_layers": config.num_layers, "hidden_size": config.hidden_size, "ffn_hidden_size": config.ffn_hidden_size,
        "num_attention_heads": config.num_attention_heads, "kv_channels": config.kv_channels,
        "group_query_attention": config.num_query_groups != config.num_attention_heads,
        "num_query_groups": config.num_query_groups, "max_position_embeddings": config.max_position_embeddings,
        "position_embedding_type": config.position_embedding_type, "rotary_base": config.rotary_base,
        "rotary_percent": config.rotary_percent, "use_rope_scaling": config.rope_scaling,
        "rope_scaling_factor": config.rope_scaling_factor, "normalization": config.normalization,
        "norm_epsilon": config.norm_epsilon, "swiglu": config.gated_linear_unit,
        "openai_gelu": config.activation == "gelu_tanh",
        "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
        "add_bias_linear": config.add_bias_linear, "add_qkv_bias": config.add_qkv_bias,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
        "apply_layernorm_1p": config.layernorm_zero_centered_gamma, "qk_layernorm": config.qk_layernorm,
        "rotary_interleaved": config.rotary_interleaved,
    }


def transformer_config(args: dict, padded_vocab_size: int) -> TransformerConfig:
    """The TransformerConfig of a checkpoint's model flags (the inverse of `model_args`)."""
    gated = args["swiglu"]
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=args["num_attention_heads"],
        vocab_size=padded_vocab_size, ffn_hidden_size=args["ffn_hidden_size"], kv_channels=args["kv_channels"],
        num_query_groups=args["num_query_groups"] if args["group_query_attention"] else None,
        max_position_embeddings=args["max_position_embeddings"], normalization=args["normalization"],
        norm_epsilon=args["norm_epsilon"], gated_linear_unit=gated,
        activation="silu" if gated else ("gelu_tanh" if args["openai_gelu"] else "gelu"),
        add_bias_linear=args["add_bias_linear"], add_qkv_bias=args["add_qkv_bias"],
        position_embedding_type=args["position_embedding_type"], rotary_base=float(args["rotary_base"]),
        rotary_percent=args["rotary_percent"], rope_scaling=args["use_rope_scaling"],
        rope_scaling_factor=args["rope_scaling_factor"],
        untie_embeddings_and_output_weights=args["untie_embeddings_and_output_weights"],
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_zero_centered_gamma=args.get("apply_layernorm_1p", False),
        qk_layernorm=args.get("qk_layernorm", False), rotary_interleaved=args.get("rotary_interleaved", False))


def check_expressible(config: TransformerConfig) -> None:
    """Raises when `config` uses a setting the training flags cannot express (the checkpoint would
    train as another model)."""
    standard = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8)
    for name in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings"):
        if config.rope_scaling and getattr(config, name) != getattr(standard, name):
            raise ValueError(f"Llama 3.1 RoPE scaling with {name} = {getattr(config, name)} cannot be trained here: "
                             f"--use-rope-scaling uses {getattr(standard, name)} (as Megatron-LM does)")


def write_weights(root: str, logical: dict, config: TransformerConfig, vocab_size: int, *,
                  make_vocab_size_divisible_by: int = 128, iteration: int = 0) -> str:
    """Writes `logical` as the checkpoint of `iteration` in `root` (atomically, tracker last);
    returns the checkpoint directory. `vocab_size` is the unpadded vocabulary."""
    from megatron.core.checkpointing import checksums
    from megatron.core.checkpointing.storage import save_state

    check_expressible(config)

    state = ShardedState()
    for name, parts in logical.items():
        for part, tensor in parts.items():
            tensor = tensor.detach().contiguous()
            state.sharded[tensor_key(MODEL, name, part)] = Boxes(tuple(tensor.shape), tensor.dtype, [((0,) * tensor.dim(), tensor)])
    os.makedirs(root, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    incomplete = final + ".incomplete"
    save_state(state, incomplete)
    args = model_args(config, make_vocab_size_divisible_by)
    common = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": iteration,
              "train_state": {"iteration": iteration}, "optimizer": None, "rng_layout": None,
              "model": architecture(config, vocab_size), "args": {"model": args},
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
        directory, note = locate(path, iteration)
        if directory is None:
            raise CheckpointFormatError(note)
    common = read_common(directory)
    keys = [key for key in saved_shapes(directory) if key.startswith(MODEL + "/")]
    logical = {}
    for key, tensor in read_full_tensors(directory, keys).items():
        name, part = split_tensor_key(key, MODEL)
        logical.setdefault(name, {})[part] = tensor
    args = dict(common["args"]["model"])
    if args.get("max_position_embeddings") is None:  # a training run's default: its sequence length
        args["max_position_embeddings"] = common["args"]["training"]["seq_length"]
    resolved = common["model"]
    for name in ("ffn_hidden_size", "kv_channels", "num_query_groups"):
        args[name] = resolved[name]
    args["group_query_attention"] = True
    padded = logical["embedding.word_embeddings.weight"][""].shape[0]
    return logical, transformer_config(args, padded), resolved["vocab_size"], common



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
