"""The MMIDIDX format: our reader and builder, an independent reader written from the spec, bad files."""
import os
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def read_by_spec(prefix):
    """A second reader written from the format description, sharing no code with ours."""
    with open(prefix + ".idx", "rb") as handle:
        data = handle.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack_from("<QBQQ", data, 9)
    assert version == 1
    offset = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from(f"<{sequences}i", data, offset)
    offset += 4 * sequences
    pointers = struct.unpack_from(f"<{sequences}q", data, offset)
    offset += 8 * sequences
    document_indices = struct.unpack_from(f"<{documents}q", data, offset)
    assert offset + 8 * documents == len(data)
    dtype = np.dtype(SPEC_DTYPES[code])
    with open(prefix + ".bin", "rb") as handle:
        payload = handle.read()
    tokens = [np.frombuffer(payload[p:p + n * dtype.itemsize], dtype=dtype).tolist() for p, n in zip(pointers, lengths)]
    return {"dtype": dtype, "sequences": tokens, "document_indices": list(document_indices), "pointers": list(pointers)}


def build(prefix, documents, dtype=np.uint16):
    """documents: list of documents, each a list of sequences (lists of ids)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(prefix + ".idx")


DOCUMENTS = [[[1, 2, 3]], [[4], [5, 6, 7]], [[]], [[8, 9] * 50], [[65000, 0, 1]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip_and_spec_reader(tmp_path, dtype):
    prefix = str(tmp_path / "data")
    documents = DOCUMENTS if dtype != np.uint8 else [[[1, 2, 3]], [[4], [5, 255]]]
    build(prefix, documents, dtype)
    flat = [sequence for document in documents for sequence in document]
    ours = IndexedDataset(prefix)
    spec = read_by_spec(prefix)
    assert spec["dtype"] == np.dtype(dtype) == np.dtype(ours.dtype)
    assert spec["sequences"] == [ours[i].tolist() for i in range(len(ours))] == flat
    expected_documents = [0]
    for document in documents:
        expected_documents.append(expected_documents[-1] + len(document))
    assert spec["document_indices"] == ours.document_indices.tolist() == expected_documents
    assert ours.get(1 if len(flat) > 1 else 0, offset=0, length=1).tolist() == flat[1][:1]
    assert ours.num_tokens == sum(len(s) for s in flat)


def test_header_bytes_exactly(tmp_path):
    prefix = str(tmp_path / "data")
    build(prefix, [[[7, 8]], [[9]]], np.uint16)
    data = open(prefix + ".idx", "rb").read()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 2) + struct.pack("<Q", 3)
                + np.array([2, 1], "<i4").tobytes() + np.array([0, 4], "<i8").tobytes() + np.array([0, 1, 2], "<i8").tobytes())
    assert data == expected
    assert open(prefix + ".bin", "rb").read() == np.array([7, 8, 9], "<u2").tobytes()


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_builder_is_atomic(tmp_path):
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_add_index_merges(tmp_path):
    build(str(tmp_path / "a"), DOCUMENTS[:2])
    build(str(tmp_path / "b"), DOCUMENTS[2:])
    builder = IndexedDatasetBuilder(str(tmp_path / "ab.bin"), dtype=np.uint16)
    builder.add_index(str(tmp_path / "a"))
    builder.add_index(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "ab.idx"))
    build(str(tmp_path / "whole"), DOCUMENTS)
    for suffix in (".bin", ".idx"):
        assert open(tmp_path / f"ab{suffix}", "rb").read() == open(tmp_path / f"whole{suffix}", "rb").read()


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "data")
    build(prefix, DOCUMENTS)
    return prefix


def test_missing_dataset_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        IndexedDataset(str(tmp_path / "nowhere"))


def test_missing_bin(good):
    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match="data.bin"):
        IndexedDataset(good)


def test_missing_idx(good):
    os.remove(good + ".idx")
    with pytest.raises(FileNotFoundError, match=r"index file .*data\.idx does not exist") as raised:
        IndexedDataset(good)
    assert "\n" not in str(raised.value)


def test_unknown_dtype_code(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[17] = 9
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"data\.idx has unknown dtype code 9; known codes: \[1, 2, 3, 4, 5, 6, 7, 8\]") as raised:
        IndexedDataset(good)
    assert "\n" not in str(raised.value)


def test_wrong_magic(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[:7] = b"NOTIDX!"
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"data\.idx.*MMIDIDX"):
        IndexedDataset(good)


def test_wrong_version(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[9:17] = struct.pack("<Q", 2)
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"data\.idx has index version 2"):
        IndexedDataset(good)


def test_empty_idx(good):
    open(good + ".idx", "wb").close()
    with pytest.raises(ValueError, match=r"data\.idx"):
        IndexedDataset(good)


def test_idx_truncated_inside_its_header(good):
    data = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(data[:20])
    with pytest.raises(ValueError, match=r"data\.idx is truncated \(20 bytes, the header alone is 34\)") as raised:
        IndexedDataset(good)
    assert "\n" not in str(raised.value)


def test_document_indices_that_do_not_end_at_the_sequence_count(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[-8:] = struct.pack("<q", 3)  # the last document index should be the sequence count, 6
    open(good + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"data\.idx: document indices must run from 0 to the sequence count 6") as raised:
        IndexedDataset(good)
    assert "\n" not in str(raised.value)


def test_truncated_idx(good):
    data = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(data[:-5])
    with pytest.raises(ValueError, match=r"data\.idx.*truncated or corrupt"):
        IndexedDataset(good)


def test_truncated_bin(good):
    data = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(data[:-4])
    with pytest.raises(ValueError, match=r"data\.bin is truncated"):
        IndexedDataset(good)


def test_bin_larger_than_index(good):
    with open(good + ".bin", "ab") as handle:
        handle.write(b"\x00\x00")
    with pytest.raises(ValueError, match=r"data\.bin is larger than its index"):
        IndexedDataset(good)


def test_get_out_of_range(good):
    dataset = IndexedDataset(good)
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=5)
    with pytest.raises(IndexError):
        dataset[len(dataset)]
