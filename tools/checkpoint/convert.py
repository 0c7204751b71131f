"""Convert checkpoints between this framework, Hugging Face and Megatron-LM.

    # Hugging Face (local directory: config.json + safetensors) -> this framework
    python tools/checkpoint/convert.py --source-format hf --source ./Llama-3.2-1B --target ./checkpoints/llama1b
    # this framework (latest checkpoint, or --iteration N) -> Hugging Face
    python tools/checkpoint/convert.py --source-format torch_dist --source ./checkpoints/run1 --target-format hf --target ./run1-hf
    # Megatron-LM / Megatron-Core (torch_dist or legacy mp_rank_XX) -> this framework
    python tools/checkpoint/convert.py --source-format megatron --source ./megatron_ckpt --target ./checkpoints/imported

The format of this framework is layout-independent, so there is no target parallel size: the
converted checkpoint loads at any --tensor-model-parallel-size / --pipeline-model-parallel-size /
data-parallel layout. Train from it with `--load DIR --finetune --use-checkpoint-args`.
Hugging Face models of the families in megatron/core/models/gpt/families (Llama 2/3/3.1, Qwen3,
Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-2, Falcon, DeepSeek-V3 with dense layers; docs/models.md)
convert; nothing is downloaded and no remote code runs. Hugging Face formats need the `hf` extra: pip install -e ".[hf]".
An export to Hugging Face also writes the run's tokenizer (GPT2BPETokenizer, Llama2Tokenizer,
HuggingFaceTokenizer; from the files the run was given) and puts its bos/eos/pad ids in config.json
and generation_config.json.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import torch  # noqa: E402

from megatron.core.models.gpt import hf_mapping  # noqa: E402
from megatron.core.checkpointing import conversion  # noqa: E402
from megatron.core.tokenizers import hf_export  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--source-format", required=True, choices=["hf", "torch_dist", "megatron"],
                        help="hf: a local Hugging Face directory; torch_dist: this framework's --save directory; "
                             "megatron: a Megatron-LM/Megatron-Core save directory (torch_dist or legacy format)")
    parser.add_argument("--source", required=True, help="the checkpoint to read")
    parser.add_argument("--target-format", choices=["torch_dist", "hf"], default="torch_dist",
                        help="torch_dist: this framework's format (default); hf: a Hugging Face directory")
    parser.add_argument("--target", required=True, help="the directory to write (must not hold a checkpoint)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="with --source-format torch_dist or megatron: the iteration to read (default: latest)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this in this framework's format (Megatron's default)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast the weights (default: keep the source's dtype)")
    return parser.parse_args(argv)


def read(args) -> tuple:
    """(logical state, TransformerConfig, unpadded vocabulary size, the run's data arguments or
    None) of the source."""
    if args.source_format == "hf":
        hf_config, state = conversion.read_hf(args.source)
        config = hf_mapping.hf_config_to_transformer_config(
            hf_config, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        arch = hf_mapping.architecture_of(hf_config)
        return hf_mapping.hf_to_logical(state, config, arch), config, hf_config.vocab_size, None
    if args.source_format == "torch_dist":
        logical, config, vocab_size, common = conversion.read_weights(args.source, args.iteration)
        return logical, config, vocab_size, common["args"].get("data")
    from megatron.core.checkpointing.megatron_lm import read_megatron_checkpoint

    checkpoint = read_megatron_checkpoint(args.source, args.iteration)
    return checkpoint.logical, checkpoint.config, megatron_vocab_size(checkpoint.args), None


def megatron_vocab_size(megatron_args: dict):
    """The unpadded vocabulary of a Megatron-LM run when its arguments tell it (NullTokenizer: N ids
    plus EOD), else None: Megatron saves only the padded size, and the vocabulary check on --load is
    then skipped."""
    if megatron_args.get("tokenizer_type") == "NullTokenizer" and megatron_args.get("vocab_size"):
        return int(megatron_args["vocab_size"]) + 1
    print("note: the checkpoint records only the padded vocabulary size; its rows past the tokenizer's "
          "vocabulary are kept")
    return None


def convert(argv=None) -> str:
    args = parse(argv)
    if os.path.exists(args.target) and os.listdir(args.target):
        raise SystemExit(f"error: --target {args.target} is not empty; choose a new directory")
    logical, config, vocab_size, data_args = read(args)
    if args.dtype is not None:
        logical = {name: {part: t.to(DTYPES[args.dtype]) for part, t in parts.items()} for name, parts in logical.items()}
    if args.target_format == "torch_dist":
        directory = conversion.write_weights(args.target, logical, config, vocab_size,
                                             make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        print(f"wrote {directory}: load it with --load {args.target} --finetune --use-checkpoint-args")
        return directory
    arch = hf_mapping.architecture_for_hf(config)
    vocab_size = vocab_size or config.padded_vocab_size  # unknown: keep the padded rows
    state = hf_mapping.logical_to_hf(logical, config, arch, vocab_size=vocab_size)
    hf_config = hf_mapping.hf_config_from_transformer_config(config, vocab_size)
    ids, note = (hf_export.export_tokenizer(data_args, args.target) if data_args
                 else (None, "no tokenizer written: the source records no tokenizer"))
    if ids is not None:
        hf_export.set_special_ids(hf_config, ids)
    conversion.write_hf(args.target, hf_config, state)
    if ids is not None:
        hf_export.write_generation_config(args.target, ids)
    print(f"wrote {args.target} ({arch}, {len(state)} tensors); {note}")
    return args.target


def missing_package(error: ImportError) -> str:
    return (f"error: this conversion needs the `hf` extra, which is not installed ({error}): "
            'pip install -e ".[hf]" (transformers, safetensors, tokenizers, sentencepiece)')


if __name__ == "__main__":
    try:
        convert()
    except (ValueError, KeyError) as error:
        from megatron.training.arguments import as_flags  # the library names config fields
        raise SystemExit(f"error: {as_flags(str(error))}") from None
    except ImportError as error:
        raise SystemExit(missing_package(error)) from None
