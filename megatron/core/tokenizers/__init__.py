"""Tokenizers chosen by `--tokenizer-type`, all behind the `MegatronTokenizer` interface."""
from typing import Optional

from megatron.core.tokenizers.base import MegatronTokenizer
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizer import Llama2Tokenizer, SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str, *, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    vocab_extra_ids: int = 0) -> MegatronTokenizer:
    """Build the tokenizer named by `--tokenizer-type` from the files its flags name."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = ["MegatronTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer",
           "NullTokenizer", "TOKENIZER_TYPES", "build_tokenizer"]
