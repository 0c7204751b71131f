import torch

from megatron.core.distributed import comm
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.harness import run_distributed


def _layout(rank, world_size, tp, pp):
    groups = initialize_model_parallel(tp, pp)
    x = torch.tensor([float(rank)])
    comm.all_reduce(x, groups.tp)
    return dict(tp_rank=groups.tp_rank, dp_rank=groups.dp_rank, pp_rank=groups.pp_rank,
                tp_sum=x.item(), pp_ranks=groups.pp_global_ranks, dp_size=groups.dp_size)


def test_rank_order_is_tp_cp_dp_pp():
    results = run_distributed(8, _layout, 2, 2)
    for rank, r in enumerate(results):
        assert r["tp_rank"] == rank % 2
        assert r["dp_rank"] == (rank // 2) % 2
        assert r["pp_rank"] == rank // 4
        assert r["dp_size"] == 2
        tp_peer = rank ^ 1
        assert r["tp_sum"] == rank + tp_peer
        assert r["pp_ranks"] == (rank % 4, rank % 4 + 4)


def test_world_size_not_divisible_names_sizes():
    import pytest

    from megatron.core.parallel_state import check_sizes

    with pytest.raises(ValueError, match=r"world size \(6\).*tensor \(4\)"):
        check_sizes(6, 4, 1, 1)
