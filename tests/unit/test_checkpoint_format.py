"""The checkpoint format's pieces, in one process: cutting a rank's flat range into boxes of the
logical tensors, resharding on load (other boxes, another dtype, a larger padded vocabulary),
safe reading of the index (no code from a file runs), and damaged files named in the error."""
import os
import pickle
import random

import numpy as np
import pytest
import torch

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.checkpointing import state as ckpt_state
from megatron.core.checkpointing.sharded import Boxes, ShardedState, logical_boxes, split_tensor_key
from megatron.core.checkpointing.storage import load_state, read_full_tensors, read_metadata, save_state
from megatron.core.tensor_parallel.layers import Part, TPLayout


def _param(layout: TPLayout, local_shape: tuple) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(local_shape))
    param.tp_layout = layout
    return param


def _layouts():
    """(layout, local shape, full shapes of the parts) of the kinds the model has."""
    cases = []
    for tp, rank in ((1, 0), (4, 1), (4, 3)):
        # fused q/k/v along rows: q split 4 ways; k, v (2 groups) split 2 ways and replicated twice
        parts = (Part("q", 16, tp), Part("k", 4, min(tp, 2), True), Part("v", 4, min(tp, 2), True))
        layout = TPLayout(0, parts, tp, rank)
        rows = sum(layout.local_range(p)[1] for p in parts)
        cases.append((layout, (rows, 3), {p.name: (p.full_size, 3) for p in parts}))
        # row-parallel weight: columns split
        layout = TPLayout(1, (Part("", 12, tp),), tp, rank)
        cases.append((layout, (5, 12 // tp), {"": (5, 12)}))
        # a 1-D replicated norm weight
        cases.append((TPLayout(0, (Part("", 7, 1),), tp, rank), (7,), {"": (7,)}))
    return cases


@pytest.mark.parametrize("case", range(9))
def test_boxes_of_any_flat_range_reassemble_the_rank_tensor(case):
    """Each element of [start, end) lands in exactly one box, at the element of the logical tensor
    the layout says it comes from (checked against TPLayout.full_to_local)."""
    layout, local_shape, full_shapes = _layouts()[case]
    full = {name: torch.randn(shape) for name, shape in full_shapes.items()}
    expected = layout.full_to_local(full).reshape(-1)
    param = _param(layout, local_shape)
    rng = random.Random(case)
    ranges = [(0, expected.numel())] + [tuple(sorted(rng.sample(range(expected.numel() + 1), 2))) for _ in range(20)]
    for start, end in ranges:
        got = torch.full((end - start,), float("nan"))
        for box in logical_boxes(param, start, end):
            region = full[box.part][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert torch.isnan(got[box.flat_start - start:box.flat_end - start]).all(), "boxes overlap"
            got[box.flat_start - start:box.flat_end - start] = region.reshape(-1)
        torch.testing.assert_close(got, expected[start:end], rtol=0, atol=0)


def test_tensor_keys_round_trip():
    assert split_tensor_key("model/decoder.layers.3.self_attention.linear_qkv.weight/q", "model") == (
        "decoder.layers.3.self_attention.linear_qkv.weight", "q")
    assert split_tensor_key("optimizer/exp_avg/embedding.word_embeddings.weight", "optimizer/exp_avg") == (
        "embedding.word_embeddings.weight", "")


def _saved(tmp_path) -> tuple:
    full = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    state = ShardedState()
    boxes = state.sharded["model/embedding.word_embeddings.weight"] = Boxes((8, 4), torch.float32)
    boxes.add((0, 0), full[0:1, 0:3])      # a partial first row ...
    boxes.add((0, 3), full[0:1, 3:4])
    boxes.add((1, 0), full[1:8])           # ... and whole rows
    state.add_whole("rng/0/torch_cpu", torch.arange(5, dtype=torch.uint8))
    directory = str(tmp_path / "checkpoint")
    save_state(state, directory)
    return full, directory


def test_load_reshards_casts_and_zero_fills_padding(tmp_path):
    full, directory = _saved(tmp_path)
    state = ShardedState()
    # this "run" pads the vocabulary to 12 rows and holds other boxes, in bf16
    boxes = state.sharded["model/embedding.word_embeddings.weight"] = Boxes((12, 4), torch.bfloat16)
    middle = torch.full((4, 3), 7.0, dtype=torch.bfloat16)
    tail = torch.full((6, 4), 7.0, dtype=torch.bfloat16)
    boxes.add((2, 1), middle)
    boxes.add((6, 0), tail)
    rng = torch.zeros(5, dtype=torch.uint8)
    state.add_whole("rng/0/torch_cpu", rng)
    load_state(state, directory)
    torch.testing.assert_close(middle.float(), full[2:6, 1:4])
    torch.testing.assert_close(tail[:2].float(), full[6:8])
    assert torch.equal(tail[2:], torch.zeros(4, 4, dtype=torch.bfloat16))  # padding rows past the saved 8
    assert rng.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(read_full_tensors(directory)["model/embedding.word_embeddings.weight"], full)


def test_other_shapes_are_refused_with_the_key(tmp_path):
    _, directory = _saved(tmp_path)
    state = ShardedState()
    state.sharded["model/embedding.word_embeddings.weight"] = Boxes((8, 5), torch.float32, [((0, 0), torch.zeros(8, 5))])
    with pytest.raises(CheckpointFormatError, match=r"word_embeddings.weight: the checkpoint holds shape \(8, 4\)"):
        load_state(state, directory)
    state = ShardedState()
    state.add_whole("model/missing", torch.zeros(1))
    with pytest.raises(CheckpointFormatError, match="has no tensor 'model/missing'"):
        load_state(state, directory)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_index_is_read_without_running_code(tmp_path, monkeypatch):
    _, directory = _saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        pickle.dump({"x": _Exploit()}, handle)
    with pytest.raises(CheckpointFormatError, match=r"\.metadata is corrupt or not a checkpoint index \(.*refusing to load global"):
        read_metadata(directory)
    assert not (tmp_path / "pwned").exists()


def test_truncated_and_missing_files_are_named(tmp_path):
    _, directory = _saved(tmp_path)
    shard = os.path.join(directory, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp is truncated: \d+ bytes, the checkpoint index needs"):
        read_full_tensors(directory)
    os.remove(shard)
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp is missing"):
        read_full_tensors(directory)
    os.remove(os.path.join(directory, ".metadata"))
    with pytest.raises(CheckpointFormatError, match=r"\.metadata is missing"):
        read_full_tensors(directory)


def test_rng_states_round_trip():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    saved = {name: tensor.clone() for name, tensor in ckpt_state.rng_tensors(None, torch.device("cpu")).items()}
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt_state.restore_rng(saved, None, torch.device("cpu"))
    got = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
