import multiprocessing

import torch

from megatron.core.distributed import comm
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.harness import run_distributed
from tests.threaded_ranks import run_ranks


def _layout(rank, world_size, tp, pp):
    groups = initialize_model_parallel(tp, pp)
    x = torch.tensor([float(rank)])
    comm.all_reduce(x, groups.tp)
    return dict(tp_rank=groups.tp_rank, dp_rank=groups.dp_rank, pp_rank=groups.pp_rank,
                tp_sum=x.item(), pp_ranks=groups.pp_global_ranks, dp_size=groups.dp_size)


def test_rank_order_is_tp_cp_dp_pp():
    # Bookkeeping and one all-reduce: eight ranks as threads of this process (tests/threaded_ranks.py)
    # rather than eight spawned processes, each importing torch.
    results = run_ranks(8, _layout, 2, 2)
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


# ---------------------------------------------------------------------------------------------
# The harness itself: a hang or a dead rank fails the test quickly, with the stuck ranks' stacks.

def _wait_for_each_other(rank, world_size):
    """Both ranks receive from the other and neither sends: a deadlock."""
    peer = 1 - rank
    comm.wait_all(comm.batch_send_recv([("recv", torch.empty(4), peer, None)]))


def _one_rank_dies(rank, world_size):
    import os
    import time

    if rank == 1:
        os._exit(3)
    time.sleep(600)  # stuck (in compute, say), so only the harness can end it


def test_deadlocked_ranks_fail_within_the_timeout_with_both_stacks():
    import time

    import pytest

    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(2, _wait_for_each_other, timeout=8)
    report = str(failure.value)
    assert "did not finish within 8 s of starting" in report
    startup = float(report.split("start-up took ")[1].split(" s")[0])
    assert time.monotonic() - start - startup < 30
    assert not multiprocessing.active_children()
    for rank in (0, 1):
        stack = report.split(f"rank {rank} was still running; its stack:\n")[1]
        assert "_wait_for_each_other" in stack.split("rank ")[0], report


def test_a_dead_rank_fails_the_run_and_ends_the_waiting_one():
    import pytest

    with pytest.raises(AssertionError) as failure:
        run_distributed(2, _one_rank_dies, timeout=60)
    report = str(failure.value)
    assert "a rank failed while others were still running" in report
    assert not multiprocessing.active_children()
    assert "rank 1 exited with code 3" in report
    assert "_one_rank_dies" in report.split("rank 0 was still running; its stack:\n")[1]
