"""Megatron-Core's memory-mapped indexed dataset: a `.bin` of token ids plus an `.idx` index (MMIDIDX).

`.idx` layout, all little-endian, byte for byte as Megatron-Core writes it:

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          <Q        1
    dtype code       <B        see DTYPE_CODES (uint16 = 8, int32 = 4, ...)
    sequence count   <Q        S
    document count   <Q        D (number of documents + 1: the document index starts with 0)
    sequence lengths int32[S]  tokens per sequence
    sequence pointers int64[S] byte offset of each sequence in the .bin
    document indices int64[D]  sequence index where each document starts, then S

A sequence is a document, or a sentence with `--split-sentences`. The `.bin` is the sequences'
tokens back to back in the dtype named by the index.
"""
import array
import os
import struct
from typing import Iterable, Optional, Sequence, Type, Union

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_TO_CODE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: Optional[int]) -> Type[np.number]:
    """Megatron's choice: uint16 when every id fits with room to spare (vocab < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _temporary_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class _Index:
    """The parsed `.idx`: dtype and the three arrays, memory-mapped (read-only)."""

    def __init__(self, idx_path: str):
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"index file {idx_path} does not exist; pass the dataset prefix without .bin/.idx "
                                    "(e.g. `data_path` my-corpus_text_document) and check it was preprocessed")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as handle:
            header = handle.read(HEADER_SIZE)
        if len(header) < len(INDEX_MAGIC) or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron MMIDIDX index (magic {header[:9]!r}, expected {INDEX_MAGIC!r}); "
                             "re-create it with tools/preprocess_data.py")
        if len(header) < HEADER_SIZE:
            raise ValueError(f"{idx_path} is truncated ({file_size} bytes, the header alone is {HEADER_SIZE}); re-run preprocessing")
        version, code, self.sequence_count, self.document_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} is supported")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unknown dtype code {code}; known codes: {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        arrays_size = 12 * self.sequence_count + 8 * self.document_count
        # Megatron-Core's multimodal variant appends one int8 mode per sequence; it is accepted and ignored.
        if file_size not in (HEADER_SIZE + arrays_size, HEADER_SIZE + arrays_size + self.sequence_count):
            raise ValueError(f"{idx_path} is {file_size} bytes but its header ({self.sequence_count} sequences, "
                             f"{self.document_count} document indices) needs {HEADER_SIZE + arrays_size}; the file is "
                             "truncated or corrupt, re-run preprocessing")
        buffer = np.memmap(idx_path, mode="r", dtype=np.uint8) if file_size > 0 else np.zeros(0, np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buffer, dtype=np.int32, count=self.sequence_count, offset=offset)
        offset += 4 * self.sequence_count
        self.sequence_pointers = np.frombuffer(buffer, dtype=np.int64, count=self.sequence_count, offset=offset)
        offset += 8 * self.sequence_count
        self.document_indices = np.frombuffer(buffer, dtype=np.int64, count=self.document_count, offset=offset)
        if self.document_count == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != self.sequence_count:
            raise ValueError(f"{idx_path}: document indices must run from 0 to the sequence count {self.sequence_count}; "
                             "the index is corrupt, re-run preprocessing")


class IndexedDataset:
    """Read-only view of `{path_prefix}.bin/.idx`; item i is sequence i as a numpy array."""

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = path_prefix
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        if not os.path.isfile(bin_path) and not os.path.isfile(idx_path):
            raise FileNotFoundError(f"dataset {path_prefix}: neither {bin_path} nor {idx_path} exists; pass the prefix "
                                    "that tools/preprocess_data.py printed (it ends in _text_document)")
        self.index = _Index(idx_path)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"data file {bin_path} does not exist (its index {idx_path} does)")
        self.dtype = self.index.dtype
        itemsize = np.dtype(self.dtype).itemsize
        expected = 0
        if self.index.sequence_count:
            expected = int(self.index.sequence_pointers[-1]) + int(self.index.sequence_lengths[-1]) * itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            problem = "is truncated" if actual < expected else "is larger than its index says"
            raise ValueError(f"{bin_path} {problem}: {actual} bytes, but {idx_path} describes {expected} bytes "
                             f"({np.dtype(self.dtype).name}); the pair does not belong together or a write was interrupted, "
                             "re-run preprocessing")
        if actual == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        elif mmap:
            self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype)
        else:
            self._bin = np.fromfile(bin_path, dtype=self.dtype)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_tokens(self) -> int:
        return int(self.index.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.index.sequence_count

    def _start(self, index: int) -> int:
        return int(self.index.sequence_pointers[index]) // np.dtype(self.dtype).itemsize

    def __getitem__(self, index: Union[int, np.integer, slice]) -> Union[np.ndarray, list]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.get(int(index))

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `index` (to its end when length is None)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {self.path_prefix} ({len(self)} sequences)")
        index %= max(len(self), 1)
        size = int(self.index.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {index} of length {size}")
        start = self._start(index) + offset
        return np.asarray(self._bin[start:start + length])


class IndexedDatasetBuilder:
    """Writes `.bin` + `.idx`. Nothing appears under the final names until `finalize`.

    Tokens go to a temporary `.bin` name; `finalize(idx_path)` writes the index under a temporary
    name, removes any old index, renames the `.bin`, then the `.idx`. An interrupted build leaves
    only `*.tmp-PID` files, never a dataset that looks complete.
    """

    def __init__(self, bin_path: str, dtype: Type[np.number] = np.int32):
        if np.dtype(dtype) not in DTYPE_TO_CODE:
            raise ValueError(f"dtype {dtype} cannot be stored in an MMIDIDX dataset; use one of {sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self._temporary_bin = _temporary_path(bin_path)
        self._file = open(self._temporary_bin, "wb")
        # array('q') rather than lists: ten million documents cost 80 MB, not 360 MB of Python ints.
        self.sequence_lengths = array.array("q")
        self.document_indices = array.array("q", [0])

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Union[Sequence[int], np.ndarray], lengths: Iterable[int]) -> None:
        """Append one document given as its flat tokens and the lengths of its sequences."""
        array = np.asarray(tokens, dtype=self.dtype)
        lengths = [int(length) for length in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths sum to {sum(lengths)} but the document has {array.size} tokens")
        self._file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray, document_ends: np.ndarray) -> None:
        """Append many documents at once: flat tokens, all their sequence lengths, and for each
        document the number of sequences (counted within this call) at its end."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.asarray(sequence_lengths, dtype=np.int64).tobytes())
        self.document_indices.frombytes((np.asarray(document_ends, dtype=np.int64) + base).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Append every document of an existing dataset (same dtype), as `tools/merge_datasets.py` does."""
        other = IndexedDataset(path_prefix)
        if np.dtype(other.dtype) != self.dtype:
            raise ValueError(f"{get_idx_path(path_prefix)} stores {np.dtype(other.dtype).name} but this merge writes "
                             f"{self.dtype.name}; datasets from tokenizers with different vocab sizes cannot be merged")
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(other.sequence_lengths.astype(np.int64).tobytes())
        self.document_indices.frombytes((other.document_indices[1:] + base).tobytes())
        with open(get_bin_path(path_prefix), "rb") as source:
            while True:
                chunk = source.read(64 << 20)
                if not chunk:
                    break
                self._file.write(chunk)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files to their final names."""
        self._file.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {lengths.max()} tokens does not fit the index's int32 lengths")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self.document_indices, dtype=np.int64)
        temporary_idx = _temporary_path(idx_path)
        with open(temporary_idx, "wb") as handle:
            handle.write(INDEX_MAGIC)
            handle.write(struct.pack("<Q", INDEX_VERSION))
            handle.write(struct.pack("<B", DTYPE_TO_CODE[self.dtype]))
            handle.write(struct.pack("<Q", lengths.size))
            handle.write(struct.pack("<Q", documents.size))
            handle.write(lengths.astype(np.int32).tobytes(order="C"))
            handle.write(pointers.tobytes(order="C"))
            handle.write(documents.tobytes(order="C"))
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._temporary_bin, self.bin_path)
        os.replace(temporary_idx, idx_path)

    def abort(self) -> None:
        """Drop everything written so far (used when preprocessing fails or is interrupted)."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._temporary_bin):
            os.remove(self._temporary_bin)
