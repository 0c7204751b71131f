"""GPT-2 byte-level BPE from a `vocab.json` + `merges.txt` pair (`--tokenizer-type GPT2BPETokenizer`).

Encoding is done by the Hugging Face `tokenizers` library when it is installed (byte-level
pre-tokenizer, GPT-2 regex, no special-token parsing: the text `<|endoftext|>` is ordinary text,
as in Megatron). Without it a pure-Python implementation of the same algorithm is used; the tests
check that both agree with the library token for token.
"""
import json
from functools import lru_cache
from typing import Dict, Iterable, List, Sequence, Tuple

from megatron.core.tokenizers.base import MegatronTokenizer, require_file

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenization: contractions, letter runs, digit runs, punctuation runs, whitespace.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=1)
def byte_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable latin-1 bytes map to themselves; the rest are shifted past 255 in byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    merges = []
    with open(merge_file, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.rstrip("\n")
            if not line or (line_number == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"`merge_file` {merge_file} line {line_number}: expected two space-separated symbols, got {line!r}")
            merges.append((parts[0], parts[1]))
    return merges


class _PythonByteLevelBPE:
    """Pure-Python byte-level BPE: regex pre-split, bytes -> unicode symbols, lowest-rank merges first."""

    def __init__(self, encoder: Dict[str, int], merges: List[Tuple[str, str]]):
        import regex

        self.encoder = encoder
        self.decoder = {index: token for token, index in encoder.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_map = byte_to_unicode()
        self.unicode_map = {char: byte for byte, char in self.byte_map.items()}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache: Dict[str, List[str]] = {}

    def _merge_word(self, word: str) -> List[str]:
        cached = self.cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            best = None  # (rank, pair) of the adjacent pair merged earliest in training
            for pair in zip(symbols, symbols[1:]):
                rank = self.ranks.get(pair)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, pair)
            if best is None:
                break
            first, second = best[1]
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if len(self.cache) < 100_000:
            self.cache[word] = symbols
        return symbols

    def encode(self, text: str) -> List[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[symbol] for symbol in self._merge_word(word))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.unicode_map[c] for c in text).decode("utf-8", errors="replace")


class _LibraryByteLevelBPE:
    """The same tokenizer through the Rust `tokenizers` library (fast, batch-parallel)."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 BPE; `eod` is `<|endoftext|>` (also reported as `eos`), there is no separate BOS."""

    def __init__(self, vocab_file: str, merge_file: str, *, backend: str = "auto"):
        vocab_file = require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        merge_file = require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as handle:
                self.encoder: Dict[str, int] = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"`vocab_file` {vocab_file} is not valid JSON ({error}); expected GPT-2's vocab.json") from error
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"`vocab_file` {vocab_file} has no {EOD_TOKEN} token; GPT2BPETokenizer needs it as end-of-document")
        if backend not in ("auto", "library", "python"):
            raise ValueError(f"backend must be auto, library or python, got {backend!r}")
        self.backend_name = backend
        if backend in ("auto", "library"):
            try:
                self._impl = _LibraryByteLevelBPE(vocab_file, merge_file)
                self.backend_name = "library"
            except ImportError:
                if backend == "library":
                    raise
                self.backend_name = "python"
        if self.backend_name == "python":
            self._impl = _PythonByteLevelBPE(self.encoder, read_merges(merge_file))
        self._vocab_size = max(len(self.encoder), max(self.encoder.values()) + 1)
        self._eod = self.encoder[EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._impl.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if hasattr(self._impl, "encode_batch"):
            return self._impl.encode_batch(texts)
        return [self._impl.encode(text) for text in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._impl.decode(ids)
