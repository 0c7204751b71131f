"""The interface every tokenizer here follows (Megatron's `MegatronTokenizer` surface)."""
from abc import ABC, abstractmethod
from typing import Iterable, List, Optional, Sequence


class MegatronTokenizer(ABC):
    """A tokenizer as training and preprocessing see it.

    `vocab_size` counts every id the tokenizer can emit (special tokens included), `eod` is the id
    appended after each document by `tools/preprocess_data.py --append-eod`, and `bos`/`eos` are
    None where the tokenizer defines no such token.
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    @abstractmethod
    def eod(self) -> int:
        ...

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def eos(self) -> Optional[int]:
        return None

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        ...

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        ...

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Tokenize many texts; subclasses backed by a batch-capable library override this."""
        return [self.tokenize(text) for text in texts]

    def supports_sentence_splitting(self) -> bool:
        """Whether `--split-sentences` makes sense (false for NullTokenizer's integer input)."""
        return True


def require_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    """Return `path` if it names an existing file, else raise an error that names the flag."""
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (needed by --tokenizer-type {tokenizer_type})")
    return path
