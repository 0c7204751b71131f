"""Tokenize JSONL conversations once for `pretrain_gpt.py --sft` (the sibling of preprocess_data.py).

    python tools/preprocess_sft.py --input data/chat.jsonl --output-prefix data/chat \
        --tokenizer-model hf/Llama-3.2-1B-Instruct --sft-tokenizer-prompt-format chat-template

writes two of Megatron's `.bin/.idx` datasets (MMIDIDX), one sequence and one document per
conversation, and the tokenizer record beside the first:

- `data/chat_messages_document.bin/.idx`: the tokens (uint16 below 65500 ids, else int32);
- `data/chat_messages_document_assistant.bin/.idx`: the assistant mask, uint8 (1: the token is an
  assistant token, trained on as a label), with exactly the same sequence lengths.

Train with `--sft --data-path data/chat_messages_document` (the mask is found beside it): nothing is
re-tokenized at start-up. The conversations are read, checked and rendered exactly as the JSONL
path does (docs/finetuning.md); a bad line stops the tool with its file and line, or with
--sft-skip-bad-lines is skipped and counted.
"""
import argparse
import os
import sys
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, optimal_dtype  # noqa: E402
from megatron.core.datasets.sft import (PROMPT_FORMATS, SFTDatasetConfig, check_chat_tokenizer,  # noqa: E402
                                        load_tokenized, mask_prefix)
from megatron.core.datasets.tokenizer_record import tokenizer_record, write_record  # noqa: E402
from megatron.core.tokenizers import build_tokenizer  # noqa: E402


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="JSONL files of conversations (Megatron-LM's "
                        "\"messages\" format)")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_messages_document.bin/.idx and "
                        "{prefix}_messages_document_assistant.bin/.idx")
    parser.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=["HuggingFaceTokenizer"])
    parser.add_argument("--tokenizer-model", required=True, help="a local Hugging Face tokenizer directory")
    parser.add_argument("--sft-tokenizer-prompt-format", default="chat-template", choices=PROMPT_FORMATS,
                        help="as pretrain_gpt.py's flag: chat-template (or default) or identity")
    parser.add_argument("--sft-skip-bad-lines", action="store_true", help="skip unusable lines and count them")
    return parser.parse_args(argv)


def write_conversations(paths: Sequence[str], tokenizer, config, tokens, masks) -> int:
    """Each conversation of the files as one sequence and one document of both builders; returns the count."""
    count = 0
    for path in paths:
        for conversation in load_tokenized(path, tokenizer, config, log=lambda line: print(line, file=sys.stderr)):
            tokens.add_item(conversation.tokens)
            tokens.end_document()
            masks.add_item(conversation.assistant.astype(np.uint8))
            masks.end_document()
            count += 1
    return count


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    check_chat_tokenizer(tokenizer, args.sft_tokenizer_prompt_format)
    config = SFTDatasetConfig(seq_length=1, seed=0, prompt_format=args.sft_tokenizer_prompt_format,
                              skip_bad_lines=args.sft_skip_bad_lines)
    prefix = f"{args.output_prefix}_messages_document"
    tokens = IndexedDatasetBuilder(prefix + ".bin", dtype=optimal_dtype(tokenizer.vocab_size))
    masks = IndexedDatasetBuilder(mask_prefix(prefix) + ".bin", dtype=np.uint8)
    try:
        count = write_conversations(args.input, tokenizer, config, tokens, masks)
    except BaseException:  # a bad line or an interrupt: no half-written files left behind
        tokens.abort()
        masks.abort()
        raise
    tokens.finalize(prefix + ".idx")
    masks.finalize(mask_prefix(prefix) + ".idx")
    write_record(prefix, tokenizer_record(tokenizer, args.tokenizer_type, tokenizer_model=args.tokenizer_model))
    print(f"> {count} conversations written to {prefix}.bin/.idx (tokens) and {mask_prefix(prefix)}.bin/.idx "
          "(assistant mask)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as error:
        from megatron.training.arguments import as_flags  # the library names config fields
        print(f"error: {as_flags(str(error))}", file=sys.stderr)
        sys.exit(2)
