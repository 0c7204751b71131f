"""The global-norm pieces, single process: runs of one replication weight, flat pieces of a
parameter (the distributed optimizer's shards) that add up to its weighted norm, and the empty case
on the device the collectives need."""
import pytest
import torch

from megatron.core.optimizer.clip_grads import local_square_norm, square_norm, weighted_grads, weighted_runs
from megatron.core.tensor_parallel.layers import Part, TPLayout, replicated_layout


def _fused(dim: int, tp_rank: int) -> torch.nn.Parameter:
    """A fused parameter at TP=4 whose parts are replicated differently along `dim`: q on every rank
    alone, k and v shared by 2 ranks (as QKV with replicated key/value heads)."""
    layout = TPLayout(dim, (Part("q", 16, 4), Part("k", 4, 2), Part("v", 4, 2)), 4, tp_rank)
    local = 16 // 4 + 2 * (4 // 2)  # rows along dim: q 4, k 2, v 2
    shape = [3, 5]
    shape.insert(dim, local)
    param = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(dim + 10 * tp_rank)))
    param.tp_layout = layout
    return param


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_pieces_add_up_to_the_weighted_norm(dim):
    for tp_rank in range(4):
        param = _fused(dim, tp_rank)
        grad = param.detach()
        expected = param.tp_layout.unique_square_norm(grad)
        whole = local_square_norm([param], [grad], torch.device("cpu"))
        torch.testing.assert_close(whole, expected)
        # Cut the flat gradient into uneven pieces, as shards of buckets cut it.
        flat = grad.reshape(-1)
        cuts = [0, 7, 8, 31, 64, flat.numel()]
        pieces = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
        entries = weighted_grads([param] * len(pieces), pieces, cuts[:-1])
        assert all(t.data_ptr() >= flat.data_ptr() for t, _ in entries)  # views of the gradient, no copies
        torch.testing.assert_close(square_norm(entries, torch.device("cpu")), expected)


def test_uniform_weights_are_one_run_and_tied_copies_are_skipped():
    norm = torch.nn.Parameter(torch.ones(6))
    norm.tp_layout = replicated_layout((6,), 4, 1)
    assert weighted_runs(norm, 2, 4) == [(0, 4, 0.25)]
    tied = torch.nn.Parameter(torch.ones(6))
    tied.tp_layout, tied.shared_embedding = replicated_layout((6,), 1, 0), True
    assert weighted_grads([tied], [tied.detach()]) == []


def test_a_rank_without_gradients_gives_a_zero_on_its_device():
    # On a GPU run the norm is all-reduced over NCCL, which rejects a CPU tensor.
    square = local_square_norm([], [], torch.device("meta"))
    assert square.device.type == "meta" and square.dtype == torch.float32
