"""--distributed-timeout-minutes reaches every process group: the layout's groups and the
checkpoint group carry it (PyTorch would give them 30 minutes on gloo whatever the default group
has), and a collective that a peer never joins fails within it."""
import datetime
import time
from types import SimpleNamespace

from tests.distributed.harness import run_distributed

TIMEOUT = datetime.timedelta(seconds=3)


def _group_timeouts_and_a_missing_peer(rank, world_size):
    import torch

    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.checkpointing import Checkpointer

    groups = initialize_model_parallel(2, 1, 1, timeout=TIMEOUT)  # 4 ranks: TP 2 x DP 2
    config = SimpleNamespace(checkpoint=SimpleNamespace(), parallel=SimpleNamespace(
        distributed_timeout_minutes=TIMEOUT.total_seconds() / 60))
    checkpoint_group = Checkpointer(config, groups, None, print).group
    seconds = {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
               for name, group in [("tp", groups.tp), ("dp", groups.dp), ("dp_cp", groups.dp_cp), ("mp", groups.mp),
                                   ("checkpoint", checkpoint_group)]}
    failed_after = None
    if groups.tp_rank == 0:  # the tensor-parallel peer (tp rank 1) never joins
        start = time.monotonic()
        try:
            torch.distributed.all_reduce(torch.ones(1), group=groups.tp)
        except RuntimeError:
            failed_after = time.monotonic() - start
    else:  # alive, but silent until its peer has given up
        time.sleep(TIMEOUT.total_seconds() + 3)
    return seconds, failed_after


def test_every_group_gets_the_timeout_and_a_silent_peer_fails_the_collective_within_it():
    results = run_distributed(4, _group_timeouts_and_a_missing_peer)
    for seconds, _ in results:
        assert seconds == {name: TIMEOUT.total_seconds() for name in ("tp", "dp", "dp_cp", "mp", "checkpoint")}
    for rank in (0, 2):  # tensor-parallel rank 0 of each replica
        failed_after = results[rank][1]
        assert failed_after is not None and TIMEOUT.total_seconds() - 0.5 < failed_after < TIMEOUT.total_seconds() + 10
