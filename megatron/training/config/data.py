"""Data and tokenizer flags."""
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron.core.transformer.config.fields import Flag, flag_field


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)
    """Dataset prefixes, optionally weighted: 'prefix' or '0.3 a_text_document 0.7 b_text_document'."""
    split: str = "969,30,1"
    """Train/validation/test proportions of --data-path."""
    train_data_path: list = field(default_factory=list)
    """Separate training dataset prefixes (instead of --split)."""
    valid_data_path: list = field(default_factory=list)
    """Separate validation dataset prefixes."""
    test_data_path: list = field(default_factory=list)
    """Separate test dataset prefixes."""
    mock_data: bool = False
    """Train on deterministic random tokens (no files needed)."""
    data_cache_path: Optional[str] = None
    """Directory for the cached sample/shuffle indices; default beside the data."""
    num_workers: int = 2
    """Data-loader worker processes."""
    dataloader_type: Literal["single", "cyclic", "external"] = "single"
    """Sample order: single (one pass in the dataset's order, which is already shuffled) or cyclic (Megatron-LM's random sampler: a fresh permutation each epoch, seeded with the epoch number). external (Megatron-LM's pass-through of a user's own loader) is an error in pretrain_gpt.py."""
    data_sharding: bool = flag_field(True, Flag(
        "--no-data-sharding", "store_false",
        "With --dataloader-type cyclic: shuffle the whole dataset once per epoch and deal it out to the "
        "data-parallel ranks, instead of each rank shuffling its own bucket."))
    """With --dataloader-type cyclic: each data-parallel rank shuffles its own contiguous bucket of the dataset."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """Do not compute the loss on end-of-document tokens."""
    sft: bool = False
    """Supervised fine-tuning: --data-path names JSONL files of conversations ("messages": role/content turns), the loss is on assistant tokens only and conversations are packed into --seq-length sequences, each attending only to itself (docs/finetuning.md)."""
    sft_tokenizer_prompt_format: str = "chat-template"
    """With --sft, how conversations become text: chat-template (or Megatron-LM's name default) renders the Hugging Face tokenizer's own chat_template, identity the turns' text one after the other. Megatron-LM's Nemotron and Gemma formats are not built."""
    sft_skip_bad_lines: bool = False
    """With --sft, skip JSONL lines that cannot be read (not JSON, no messages, an unknown role, empty content) and count them in the log, instead of stopping at the first with its file and line."""
    sft_truncation: bool = flag_field(True, Flag(
        "--sft-no-truncation", "store_false",
        "With --sft, stop with the file and line of a conversation longer than --seq-length + 1 tokens instead "
        "of truncating it."))
    """With --sft, conversations longer than --seq-length + 1 tokens are truncated on the right (counted in the log); --sft-no-truncation makes one an error naming its file and line."""
    tokenizer_type: Optional[Literal["GPT2BPETokenizer", "SentencePieceTokenizer", "Llama2Tokenizer",
                                     "HuggingFaceTokenizer", "NullTokenizer"]] = None
    """Tokenizer: GPT2BPETokenizer, SentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, NullTokenizer."""
    tokenizer_model: Optional[str] = None
    """tokenizer.model (SentencePiece) or a local Hugging Face tokenizer directory / tokenizer.json."""
    vocab_file: Optional[str] = None
    """vocab.json of a GPT-2 BPE tokenizer."""
    merge_file: Optional[str] = None
    """merges.txt of a GPT-2 BPE tokenizer."""
    vocab_size: Optional[int] = None
    """NullTokenizer vocabulary: ids 0..N-1, plus the end-of-document token N (as Megatron-LM)."""
    create_attention_mask_in_dataloader: bool = flag_field(True, Flag(
        "--no-create-attention-mask-in-dataloader", "store_false",
        "Build no document attention in the data loader: with --reset-attention-mask, attention is then causal "
        "across documents (as in Megatron-LM)."))
    """With --reset-attention-mask, samples carry each token's document index for document-aware attention (never an s x s mask); --no-create-attention-mask-in-dataloader drops it, so attention stays causal over the whole sequence (as Megatron-LM)."""
    data_args_path: Optional[str] = None
    """A file holding the --data-path value (weights and prefixes, whitespace-separated), for blends too long for a command line."""
    per_split_data_args_path: Optional[str] = None
    """A JSON file {"train": ..., "valid": ..., "test": ...} holding the --train/--valid/--test-data-path values (lists or strings)."""
    mmap_bin_files: bool = flag_field(True, Flag(
        "--no-mmap-bin-files", "store_false", "Read each .bin file whole into memory instead of memory-mapping it."))
    """Memory-map the .bin files (off with --no-mmap-bin-files: each is read whole into memory)."""
