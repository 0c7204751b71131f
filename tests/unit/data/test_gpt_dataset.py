"""GPTDataset, BlendedDataset, the index builders (C++ and numpy) and build_gpt_datasets."""
import os
import threading

import numpy as np
import pytest

from megatron.core.datasets import (BlendedDataset, GPTDatasetConfig, IndexedDatasetBuilder, MockGPTDataset,
                                    build_gpt_datasets, check_data_inputs, parse_split)
from megatron.core.datasets import gpt_dataset, helpers, index_cache
from megatron.core.datasets.gpt_dataset_builder import split_boundaries

SEQ = 16


def write_unique_token_dataset(prefix, num_documents=300, seed=0, dtype=np.int32):
    """Documents whose tokens are their global positions, so every token is unique and traceable."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=num_documents)
    sizes[::17] = 0  # some empty documents
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    documents, start = [], 0
    for size in sizes:
        tokens = list(range(start, start + int(size)))
        start += int(size)
        builder.add_item(tokens)
        builder.end_document()
        documents.append(tokens)
    builder.finalize(prefix + ".idx")
    return documents


@pytest.fixture
def unique_data(tmp_path):
    prefix = str(tmp_path / "unique")
    return prefix, write_unique_token_dataset(prefix)


def config(data_path, tmp_path, **overrides):
    values = dict(seq_length=SEQ, seed=1234, data_path=data_path, split="969,30,1",
                  data_cache_path=str(tmp_path / "cache"))
    values.update(overrides)
    return GPTDatasetConfig(**values)


def stream_of(dataset, documents):
    """The token stream the dataset should cut, rebuilt from the raw documents (not from our reader)."""
    return [token for d in dataset.document_index for token in documents[d]]


def test_epochs_documents_and_windows(unique_data, tmp_path):
    prefix, documents = unique_data
    (begin, end), _, _ = split_boundaries(parse_split("969,30,1"), len(documents))
    train_documents = list(range(begin, end))
    split_tokens = sum(len(documents[d]) for d in train_documents)
    requested = (2 * split_tokens - 1) // SEQ + (split_tokens // SEQ) // 10  # two epochs and 10% of a third
    train, _, _ = build_gpt_datasets(config([prefix], tmp_path), num_samples=(requested, 0, 0))
    assert train.num_epochs == 3 and len(train) == (3 * split_tokens - 1) // SEQ
    # Every document of the split appears once per epoch; the last epoch, less than 80% used, is shuffled apart.
    assert sorted(train.document_index.tolist()) == sorted(train_documents * train.num_epochs)
    assert sorted(train.document_index[-len(train_documents):].tolist()) == train_documents
    stream = stream_of(train, documents)
    # Sample k is the window [k * SEQ, k * SEQ + SEQ] of the stream; the windows cover it without gaps.
    for sample in range(len(train)):
        assert train.window(sample).tolist() == stream[sample * SEQ: sample * SEQ + SEQ + 1]
    covered = (len(train)) * SEQ + 1
    assert covered <= len(stream) < covered + SEQ
    # Items follow the shuffle index, labels are tokens shifted by one.
    for index in range(0, len(train), 37):
        item = train[index]
        window = stream[int(train.shuffle_index[index]) * SEQ:][:SEQ + 1]
        assert item["tokens"].tolist() == window[:-1] and item["labels"].tolist() == window[1:]
        assert item["tokens"].dtype == np.int64 and item["labels"].dtype == np.int64
        assert item["loss_mask"].dtype == np.float32 and item["position_ids"].tolist() == list(range(SEQ))
    # The first epochs' samples come first, in a permutation of their own.
    before_final = ((train.num_epochs - 1) * split_tokens - 1) // SEQ
    assert sorted(train.shuffle_index[:before_final].tolist()) == list(range(before_final))
    assert sorted(train.shuffle_index.tolist()) == list(range(len(train)))


def test_same_seed_same_order_any_number_of_ranks(unique_data, tmp_path):
    prefix, _ = unique_data
    reference = build_gpt_datasets(config([prefix], tmp_path / "single"), (500, 20, 5))
    for world_size in (2, 4):
        barrier = threading.Barrier(world_size)
        results = [None] * world_size

        def rank(index):
            results[index] = build_gpt_datasets(config([prefix], tmp_path / f"world{world_size}"), (500, 20, 5),
                                                is_builder_rank=index == 0, barrier=barrier.wait)

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for datasets in results:
            for ours, theirs in zip(datasets, reference):
                if theirs is None:  # 300 documents leave the 1/1000 test split empty
                    assert ours is None
                    continue
                for name in ("document_index", "sample_index", "shuffle_index"):
                    np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name))
                np.testing.assert_array_equal(ours[3]["tokens"], theirs[3]["tokens"])
    other_seed = build_gpt_datasets(config([prefix], tmp_path / "seed", seed=99), (500, 20, 5))[0]
    assert not np.array_equal(other_seed.shuffle_index, reference[0].shuffle_index)


def test_cache_is_reused_and_written_atomically(unique_data, tmp_path):
    prefix, _ = unique_data
    build_gpt_datasets(config([prefix], tmp_path), (200, 10, 0))
    cache = tmp_path / "cache"
    files = sorted(os.listdir(cache))
    assert files and all(".tmp" not in name for name in files)
    assert any(name.endswith("-GPTDataset-train-shuffle_index.npy") for name in files)
    stamps = {name: os.stat(cache / name).st_mtime_ns for name in files}
    again = build_gpt_datasets(config([prefix], tmp_path), (200, 10, 0), is_builder_rank=False)
    assert {name: os.stat(cache / name).st_mtime_ns for name in os.listdir(cache)} == stamps
    assert len(again[0]) >= 200
    # A different setting is a different hash: a non-builder rank cannot find it and says where it looked.
    with pytest.raises(FileNotFoundError, match="cache"):
        build_gpt_datasets(config([prefix], tmp_path, seq_length=SEQ + 1), (200, 10, 0), is_builder_rank=False)


def test_cache_written_under_other_rules_is_not_read(unique_data, tmp_path, monkeypatch):
    """The hash covers the format version of the index rules: caches from older rules are never reused."""
    prefix, _ = unique_data
    build_gpt_datasets(config([prefix], tmp_path), (200, 10, 0))
    monkeypatch.setattr(index_cache, "CACHE_FORMAT_VERSION", index_cache.CACHE_FORMAT_VERSION + 1)
    with pytest.raises(FileNotFoundError, match="cache"):
        build_gpt_datasets(config([prefix], tmp_path), (200, 10, 0), is_builder_rank=False)


def test_default_cache_beside_the_data(unique_data, tmp_path):
    prefix, _ = unique_data
    build_gpt_datasets(config([prefix], tmp_path, data_cache_path=None), (50, 0, 0))
    assert any(name.endswith(".npy") for name in os.listdir(os.path.join(os.path.dirname(prefix), "cache")))


@pytest.mark.skipif(not helpers.cpp_available(), reason="C++ helper not built: python setup.py build_ext --inplace")
def test_cpp_and_numpy_index_builders_are_identical():
    rng = np.random.default_rng(0)
    for trial in range(30):
        sizes = rng.integers(0, 60, size=rng.integers(1, 200)).astype(np.int32)
        sizes[rng.integers(0, sizes.size)] = max(1, sizes.max())
        document_index = np.concatenate([rng.permutation(sizes.size) for _ in range(rng.integers(1, 4))]).astype(np.int32)
        total = int(sizes[document_index].sum())
        seq_length = int(rng.integers(1, 50))
        num_samples = (total - 1) // seq_length
        cpp = helpers._cpp.build_sample_idx(sizes, document_index, seq_length, num_samples)
        numpy_twin = helpers.build_sample_idx_numpy(sizes, document_index, seq_length, num_samples)
        assert cpp.dtype == numpy_twin.dtype == np.int64
        np.testing.assert_array_equal(cpp, numpy_twin)
        assert cpp[0].tolist() == [0, 0]  # Megatron's first row, even when the stream starts with empty documents
    for trial in range(30):
        weights = rng.random(rng.integers(1, 6))
        weights /= weights.sum()
        size = int(rng.integers(0, 3000))
        cpp = helpers._cpp.build_blending_indices(weights, size)
        numpy_twin = helpers.build_blending_indices_numpy(weights, size)
        for ours, theirs in zip(cpp, numpy_twin):
            assert ours.dtype == theirs.dtype
            np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(IndexError):
        helpers.build_sample_idx(np.array([3], np.int32), np.array([0], np.int32), 4, 1)


def test_numpy_fallback_warns_and_matches(unique_data, tmp_path, monkeypatch):
    prefix, _ = unique_data
    expected = build_gpt_datasets(config([prefix], tmp_path / "a"), (300, 0, 0))[0]
    monkeypatch.setattr(helpers, "_cpp", None)
    monkeypatch.setattr(helpers, "_warned", False)
    with pytest.warns(RuntimeWarning, match="numpy"):
        fallback = build_gpt_datasets(config([prefix], tmp_path / "b"), (300, 0, 0))[0]
    np.testing.assert_array_equal(fallback.sample_index, expected.sample_index)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.25], [0.01, 0.99], [0.2, 0.2, 0.2, 0.2, 0.2]])
def test_blending_hits_weights_within_one_over_n(weights):
    size = 5000
    dataset_index, dataset_sample_index = helpers.build_blending_indices(np.array(weights), size)
    one_hot = np.eye(len(weights), dtype=np.int64)[dataset_index]
    counts = np.cumsum(one_hot, axis=0)  # counts[n - 1, d]: samples from d among the first n
    n = np.arange(1, size + 1)[:, None]
    assert np.all(np.abs(counts / n - np.array(weights)[None]) <= 1.0 / n + 1e-12)
    for d in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert dataset_sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


def test_blended_data_path(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_unique_token_dataset(a, seed=1)
    write_unique_token_dataset(b, num_documents=100, seed=2)
    train, valid, test = build_gpt_datasets(config(["0.3", a, "0.7", b], tmp_path), (1000, 40, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and test is None
    shares = np.bincount(train.dataset_index, minlength=2) / 1000
    assert abs(shares[0] - 0.3) <= 1 / 1000 and abs(shares[1] - 0.7) <= 1 / 1000
    assert train[0].keys() == {"tokens", "labels", "loss_mask", "position_ids"}
    assert len(valid) == 40


def test_separate_split_paths_and_empty_splits(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    documents_a = write_unique_token_dataset(a, seed=1)
    write_unique_token_dataset(b, seed=2)
    train, valid, test = build_gpt_datasets(config(None, tmp_path, train_data_path=[a], valid_data_path=[b]), (100, 10, 5))
    assert test is None
    assert sorted(train.document_index[:len(documents_a)].tolist()) == list(range(len(documents_a)))
    train, valid, test = build_gpt_datasets(config([a], tmp_path, split="100,0,0"), (100, 10, 10))
    assert train is not None and valid is None and test is None


def test_masks_and_position_resets(tmp_path):
    prefix = str(tmp_path / "eod")
    eod = 0
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in ([5, 6, 7, eod], [8, 9, eod], [10, 11, 12, 13, 14, 15, eod]):
        builder.add_item(document)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    cfg = config([prefix], tmp_path, seq_length=8, split="1,0,0", eod_token=eod, reset_position_ids=True,
                 reset_attention_mask=True, eod_mask_loss=True)
    train, _, _ = build_gpt_datasets(cfg, (1, 0, 0))
    item = train[0]
    tokens = item["tokens"].tolist()
    eods = [i for i, token in enumerate(tokens) if token == eod]
    assert item["loss_mask"].tolist() == [0.0 if i in eods else 1.0 for i in range(8)]
    expected_positions, position = [], 0
    for token in tokens:
        expected_positions.append(position)
        position = 0 if token == eod else position + 1
    assert item["position_ids"].tolist() == expected_positions
    assert "attention_mask" not in item  # no s x s mask in the data pipeline
    segment = np.cumsum([0] + [1 if t == eod else 0 for t in tokens[:-1]])
    np.testing.assert_array_equal(item["document_ids"], segment)
    # The model's mask from those ids is Megatron's reset attention mask.
    import torch

    from megatron.core.transformer.attention import document_attention_mask

    mask = document_attention_mask(torch.from_numpy(item["document_ids"])[None])
    expected = np.array([[j <= i and segment[i] == segment[j] for j in range(8)] for i in range(8)])
    np.testing.assert_array_equal(mask[0, 0].numpy(), expected)


def test_mock_data():
    train, valid, test = build_gpt_datasets(GPTDatasetConfig(seq_length=8, seed=3, data_path=None, mock=True, vocab_size=50),
                                            (10, 2, 0))
    assert isinstance(train, MockGPTDataset) and len(train) == 10 and len(valid) == 2 and test is None


def test_input_errors_name_the_file_or_flag(unique_data, tmp_path):
    prefix, _ = unique_data
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_gpt_datasets(config([str(tmp_path / "does-not-exist")], tmp_path), (10, 0, 0))
    with pytest.raises(ValueError, match=r"unique\.bin contains token id .* >= vocab size 50"):
        build_gpt_datasets(config([prefix], tmp_path, vocab_size=50), (10, 0, 0))
    small = str(tmp_path / "small")
    write_unique_token_dataset(small, num_documents=20, dtype=np.uint16)
    with pytest.raises(ValueError, match=r"small\.bin stores uint16"):
        build_gpt_datasets(config([small], tmp_path, vocab_size=128256), (10, 0, 0))
    with pytest.raises(ValueError, match="--split"):
        build_gpt_datasets(config([prefix], tmp_path, split="a,b"), (10, 0, 0))
    with pytest.raises(ValueError, match="--data-path"):
        build_gpt_datasets(config(["0.5", prefix, "0.5"], tmp_path), (10, 0, 0))
    with pytest.raises(ValueError, match="eod_token"):
        config([prefix], tmp_path, eod_mask_loss=True)
    with pytest.raises(ValueError, match="--data-path"):
        GPTDatasetConfig(seq_length=8, seed=1, data_path=None)


def one_line_error(error_type, match, build):
    """`build()` raises error_type with a one-line message matching `match`; returns the message."""
    with pytest.raises(error_type, match=match) as raised:
        build()
    assert "\n" not in str(raised.value), str(raised.value)
    return str(raised.value)


@pytest.mark.parametrize("data_path, match", [
    (["0.5", "A", "0.5"], "--data-path .*needs pairs"),
    (["-1", "A", "2", "B"], "--data-path: weight '-1' before .*unique must be a positive number"),
    (["nan", "A", "1", "B"], "--data-path: weight 'nan' before .*unique must be a positive number"),
    (["inf", "A", "1", "B"], "--data-path: weight 'inf' before .*unique must be a positive number"),
    (["0.3", "A", "B", "0.7"], "--data-path: weight '.*unique' before 0.7 must be a positive number"),
    (["A", "0.5", "B", "0.5"], "--data-path .*mixes weights and prefixes"),
    (["0.5", "A", "0.5", "0.7"], "--data-path: '0.7' after weight 0.5 is a number"),
])
def test_blend_weights_that_do_not_parse(unique_data, tmp_path, data_path, match):
    prefix, _ = unique_data
    data_path = [prefix if item in ("A", "B") else item for item in data_path]
    one_line_error(ValueError, match, lambda: build_gpt_datasets(config(data_path, tmp_path), (10, 0, 0)))


def test_missing_blend_file_fails_before_any_index_is_built(unique_data, tmp_path):
    prefix, _ = unique_data
    missing = str(tmp_path / "missing_text_document")
    message = one_line_error(FileNotFoundError, "--data-path: .*missing_text_document",
                             lambda: build_gpt_datasets(config(["0.5", prefix, "0.5", missing], tmp_path), (100, 10, 0)))
    assert "missing_text_document.bin" in message and "missing_text_document.idx" in message
    assert not os.path.exists(tmp_path / "cache"), "indices of the first dataset were built before the error"
    one_line_error(FileNotFoundError, "--valid-data-path: .*missing_text_document",
                   lambda: build_gpt_datasets(config(None, tmp_path, train_data_path=[prefix], valid_data_path=[missing]),
                                              (100, 10, 0)))
    assert not os.path.exists(tmp_path / "cache")
    one_line_error(FileNotFoundError, "--data-path: .*missing_text_document",
                   lambda: check_data_inputs(config(["0.5", prefix, "0.5", missing], tmp_path)))
    one_line_error(ValueError, "--split", lambda: check_data_inputs(config([prefix], tmp_path, split="1,x")))
    check_data_inputs(config([prefix], tmp_path))
    assert not os.path.exists(tmp_path / "cache")


def test_unwritable_cache_directory(unique_data, tmp_path, monkeypatch):
    prefix, _ = unique_data
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")

    def no_index_building(*args, **kwargs):
        raise AssertionError("indices built before the cache directory was checked")

    with monkeypatch.context() as patch:
        patch.setattr(gpt_dataset, "build_sample_idx", no_index_building)
        one_line_error(ValueError, r"cannot write the dataset index cache in .*a-file.*set --data-cache-path",
                       lambda: build_gpt_datasets(config([prefix], tmp_path, data_cache_path=str(blocker / "cache")), (10, 0, 0)))
    if os.geteuid() != 0:  # root writes anywhere
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
        one_line_error(ValueError, "cannot write the dataset index cache in .*read-only",
                       lambda: build_gpt_datasets(config([prefix], tmp_path, data_cache_path=str(read_only)), (10, 0, 0)))
    # A complete cache in a read-only place is fine: nothing needs writing.
    build_gpt_datasets(config([prefix], tmp_path, data_cache_path=str(tmp_path / "built")), (10, 0, 0))
    os.chmod(tmp_path / "built", 0o500)
    try:
        assert len(build_gpt_datasets(config([prefix], tmp_path, data_cache_path=str(tmp_path / "built")), (10, 0, 0))[0]) >= 10
    finally:
        os.chmod(tmp_path / "built", 0o700)


def test_unweighted_blend_uses_each_dataset_once_in_proportion_to_its_size(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_unique_token_dataset(a, seed=1)
    write_unique_token_dataset(b, num_documents=100, seed=2)
    train, _, _ = build_gpt_datasets(config([a, b], tmp_path, split="1,0,0"), (300, 0, 0))
    lengths = [len(part) for part in train.datasets]
    assert [part.num_epochs for part in train.datasets] == [1, 1] and len(train) == 300
    np.testing.assert_allclose(train.weights, np.array(lengths) / sum(lengths))
    one_line_error(ValueError, r"--data-path without weights uses each dataset's train split once.*\d+ samples, fewer than "
                   r"the 100000 training needs", lambda: build_gpt_datasets(config([a, b], tmp_path, split="1,0,0"), (100000, 0, 0)))


def test_empty_train_split_is_an_error(tmp_path):
    tiny = str(tmp_path / "tiny")
    write_unique_token_dataset(tiny, num_documents=3)
    one_line_error(ValueError, r"--split 0,50,50 gives the train split no share, but training needs 10 samples",
                   lambda: build_gpt_datasets(config([tiny], tmp_path, split="0,50,50"), (10, 0, 0)))
    # round(0.1 * 3) == 0: the train range is empty.
    one_line_error(ValueError, r"--data-path: the train split of .*tiny \(3 sequences\) is empty with --split 10,90",
                   lambda: build_gpt_datasets(config([tiny], tmp_path, split="10,90"), (10, 0, 0)))
    assert build_gpt_datasets(config([tiny], tmp_path, split="0,50,50"), (0, 5, 5))[0] is None
