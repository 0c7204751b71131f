"""`--tokenizer-type NullTokenizer --vocab-size N`: text is whitespace-separated integer ids."""
from typing import Iterable, List

from megatron.core.tokenizers.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """No vocabulary files: `"5 17 3"` tokenizes to [5, 17, 3].

    As in Megatron-LM, `--vocab-size N` names the N ordinary ids 0..N-1 and the EOD token is id N,
    so the tokenizer's vocabulary has N + 1 entries.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._vocab_size = int(vocab_size) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer input must be whitespace-separated integers, got {word[:40]!r}") from None
            if not 0 <= value < self._vocab_size:
                raise ValueError(f"NullTokenizer id {value} is outside [0, {self.eod}] (--vocab-size {self.eod}, EOD {self.eod})")
            ids.append(value)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def supports_sentence_splitting(self) -> bool:
        return False
