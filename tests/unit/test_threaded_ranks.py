"""tests/threaded_ranks.py: every rank a thread, with real collectives, and a failing rank reported
at once (its peers waiting in a collective released) rather than at the timeout."""
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import comm
from megatron.core.parallel_state import initialize_model_parallel
from tests.threaded_ranks import TIMEOUT_SECONDS, run_ranks


def _sum_over_tensor_parallel_peers(rank, world_size):
    groups = initialize_model_parallel(2, 1)
    x = torch.tensor([float(rank)])
    comm.all_reduce(x, groups.tp)
    return world_size, groups.tp_rank, x.item()


def test_results_come_back_in_rank_order_after_real_collectives():
    results = run_ranks(4, _sum_over_tensor_parallel_peers)
    assert results == [(4, rank % 2, float(rank + (rank ^ 1))) for rank in range(4)]
    assert not dist.is_initialized()


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails before the all-reduce")
    comm.all_reduce(torch.ones(1), dist.group.WORLD)  # rank 0 waits for a peer that never comes


def test_a_failing_rank_is_reported_with_its_traceback_and_releases_its_peers():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 raised:(.|\n)*ValueError: rank 1 fails before the all-reduce"):
        run_ranks(2, _rank_one_raises)
    assert time.monotonic() - start < TIMEOUT_SECONDS / 4
    assert run_ranks(4, _sum_over_tensor_parallel_peers)[3] == (4, 1, 5.0)  # the next run starts clean
