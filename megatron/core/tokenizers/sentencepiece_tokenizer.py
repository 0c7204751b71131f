"""SentencePiece models (`--tokenizer-model tokenizer.model`): the generic Megatron tokenizer and Llama 2's."""
from typing import Dict, Iterable, List, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, require_file


def _load_processor(model_file: str, tokenizer_type: str):
    try:
        import sentencepiece
    except ImportError as error:
        raise ImportError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece package: pip install sentencepiece") from error
    require_file(model_file, "--tokenizer-model", tokenizer_type)
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"`tokenizer_model` {model_file} is not a SentencePiece model ({error})") from error
    return processor


class Llama2Tokenizer(MegatronTokenizer):
    """Llama 2's SentencePiece tokenizer, as Megatron uses it.

    `tokenize` prepends BOS to every text (Megatron's `_Llama2Tokenizer.tokenize(s, bos=True)`),
    so each preprocessed document starts with BOS; `eod` is the model's EOS.
    """

    def __init__(self, model_file: str):
        self.processor = _load_processor(model_file, "Llama2Tokenizer")
        if self.processor.bos_id() < 0 or self.processor.eos_id() < 0:
            raise ValueError(f"`tokenizer_model` {model_file} defines no BOS/EOS piece; Llama2Tokenizer needs both "
                             "(use SentencePieceTokenizer for models without them)")

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    @property
    def bos(self) -> int:
        return self.processor.bos_id()

    @property
    def eos(self) -> int:
        return self.processor.eos_id()

    @property
    def eod(self) -> int:
        return self.processor.eos_id()

    @property
    def pad(self) -> int:
        return self.processor.pad_id()

    def tokenize(self, text: str) -> List[int]:
        return [self.bos] + self.processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        bos = self.bos
        return [[bos] + ids for ids in self.processor.encode(list(texts), num_threads=1)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


class SentencePieceTokenizer(MegatronTokenizer):
    """Any SentencePiece model plus Megatron's special tokens.

    Megatron appends `<CLS> <SEP> <EOD> <MASK>` (and `<PAD> <BOS> <EOS>` when the model has no
    such piece) after the model's own pieces, then `vocab_extra_ids` tokens `<extra_id_N>`;
    `vocab_size` counts them. Occurrences of these special strings in the text encode to their ids.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        self.processor = _load_processor(model_file, "SentencePieceTokenizer")
        self.vocab: Dict[str, int] = {self.processor.id_to_piece(i): i for i in range(self.processor.vocab_size())}
        self.special_tokens: Dict[str, int] = {}
        for name in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(name)
        self._pad = self._add_model_special(self.processor.pad_id(), "<PAD>")
        self._bos = self._add_model_special(self.processor.bos_id(), "<BOS>")
        self._eos = self._add_model_special(self.processor.eos_id(), "<EOS>")
        for index in range(vocab_extra_ids):
            self._add_special(f"<extra_id_{index}>")
        self._eod = self.vocab["<EOD>"]
        # Longest first, so that no special token is matched as the prefix of a longer one.
        self._specials_by_length = sorted(self.special_tokens, key=len, reverse=True)
        self._decoder = {index: piece for piece, index in self.vocab.items()}

    def _add_special(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.vocab)
        self.special_tokens[piece] = self.vocab[piece]
        return self.vocab[piece]

    def _add_model_special(self, model_id: int, fallback_piece: str) -> int:
        if model_id >= 0:
            piece = self.processor.id_to_piece(model_id)
            self.special_tokens[piece] = model_id
            return model_id
        return self._add_special(fallback_piece)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> List[int]:
        if not any(special in text for special in self._specials_by_length):
            return self.processor.encode(text)
        ids, start = [], 0
        while start < len(text):
            found = [(text.find(s, start), s) for s in self._specials_by_length]
            found = [(position, s) for position, s in found if position >= 0]
            if not found:
                break
            position, special = min(found, key=lambda item: (item[0], -len(item[1])))
            ids.extend(self.processor.encode(text[start:position]))
            ids.append(self.special_tokens[special])
            start = position + len(special)
        ids.extend(self.processor.encode(text[start:]))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text, run = "", []
        for index in (int(i) for i in ids):
            if index < self.processor.vocab_size():
                run.append(index)
                continue
            text += self.processor.decode(run) + self._decoder.get(index, "")
            run = []
        return text + self.processor.decode(run)

