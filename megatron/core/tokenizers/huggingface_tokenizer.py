"""Any Hugging Face tokenizer (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`).

PATH is a local directory (tokenizer.json / tokenizer_config.json, as `save_pretrained` writes
it), a single `tokenizer.json` file, or a hub name, which needs a reachable hub.
"""
import os
from typing import Iterable, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer

# Tried, in order, when the tokenizer declares no EOS token (e.g. a bare tokenizer.json).
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def _looks_like_local_path(name: str) -> bool:
    """Hub names are `name` or `org/name`; anything else that does not exist is a missing local path."""
    return name.startswith((".", "/", "~")) or name.endswith(".json") or name.count("/") > 1


def load_hf_tokenizer(name_or_path: str):
    try:
        import transformers
    except ImportError as error:
        raise ImportError("--tokenizer-type HuggingFaceTokenizer needs the transformers package: pip install transformers") from error
    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path):
        if not path.endswith(".json"):
            raise ValueError(f"`tokenizer_model` {name_or_path}: a file must be a tokenizer.json; "
                             "for a SentencePiece .model use `tokenizer_type` Llama2Tokenizer or SentencePieceTokenizer")
        return transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    if os.path.isdir(path):
        return transformers.AutoTokenizer.from_pretrained(path)
    if _looks_like_local_path(name_or_path):
        raise FileNotFoundError(f"`tokenizer_model` {name_or_path}: no such file or directory")
    try:
        return transformers.AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # hub unreachable, unknown repo, gated model, ...
        raise ValueError(f"`tokenizer_model` {name_or_path}: not a local path and could not be loaded from the Hugging Face "
                         f"hub ({type(error).__name__}: {error}). Download it elsewhere (tokenizer.save_pretrained(DIR)) "
                         "and pass the local directory or its tokenizer.json to `tokenizer_model`") from error


class HuggingFaceTokenizer(MegatronTokenizer):
    """Wraps `transformers`; `tokenize` is `tokenizer(text).input_ids`, special tokens included (as Megatron)."""

    def __init__(self, name_or_path: str):
        if not name_or_path:
            raise ValueError("`tokenizer_type` HuggingFaceTokenizer needs `tokenizer_model` (a directory, tokenizer.json or hub name)")
        self.name_or_path = name_or_path
        self.tokenizer = load_hf_tokenizer(name_or_path)
        self._vocab_size = len(self.tokenizer)
        vocab = self.tokenizer.get_vocab()
        self._eod = self.tokenizer.eos_token_id
        if self._eod is None:
            self._eod = next((vocab[token] for token in EOD_CANDIDATES if token in vocab), None)
        if self._eod is None:
            raise ValueError(f"`tokenizer_model` {name_or_path} declares no EOS token and has none of {EOD_CANDIDATES}; "
                             "set eos_token in its tokenizer_config.json")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        return self.tokenizer.bos_token_id

    @property
    def eos(self) -> Optional[int]:
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self._eod

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer(text).input_ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.tokenizer(list(texts)).input_ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    # Conversations (--sft): the tokenizer's own chat template, rendered as `transformers` renders it.
    @property
    def chat_template(self) -> Optional[str]:
        return self.tokenizer.chat_template

    @property
    def pad(self) -> Optional[int]:
        return self.tokenizer.pad_token_id

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The chat template's text for `messages` (and the assistant header when add_generation_prompt)."""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode_text(self, text: str) -> List[int]:
        """Token ids of `text` with no special tokens added (a chat template writes its own)."""
        return self.tokenizer(text, add_special_tokens=False).input_ids
