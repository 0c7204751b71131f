"""Runs a function as every rank of a world inside this one process, one thread per rank, over
PyTorch's threaded process group (the one its own distributed tests use): the collectives are real
(each rank's all-to-all sends its rows to the other threads), so what a layout builds and exchanges
is checked in a unit test, in seconds, without spawning processes.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args) -> results in rank order

as `tests/distributed/harness.run_distributed` takes them, so a test can move between the two.

Each thread initializes the default process group as its own rank, so `initialize_model_parallel`
and every group it makes work as under torchrun. Threads share the GIL: this is for small layers
and bookkeeping, not for training runs (tests/distributed holds those, over gloo processes).
"""
import threading
import traceback

import pytest
import torch
import torch.distributed as dist

TIMEOUT_SECONDS = 120.0  # a rank still running by then is stuck in a collective its peers left


def _threaded_backend():
    """PyTorch's threaded process group, or a skip saying why (a build without its test modules)."""
    try:
        from torch.testing._internal.distributed import multi_threaded_pg
    except ImportError as error:
        pytest.skip(f"needs torch.testing._internal.distributed.multi_threaded_pg ({error}); "
                    "the same layouts run over gloo processes in tests/distributed")
    return multi_threaded_pg


def run_ranks(world_size: int, fn, *args) -> list:
    """fn(rank, world_size, *args) on ranks 0 .. world_size - 1, each in its own thread with the default process
    group initialized as that rank. Returns their results in rank order; raises AssertionError with
    the traceback of every rank that raised, or naming the ranks still running at the timeout."""
    if dist.is_initialized():
        raise RuntimeError("run_ranks needs a process without a default process group")
    threaded = _threaded_backend()
    results, errors = [None] * world_size, {}
    store = dist.HashStore()

    def rank_main(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
        except SystemExit:  # ended by the threaded group because another rank failed
            pass
        except BaseException:  # reported below; the peers waiting in a collective are released
            errors[rank] = traceback.format_exc()
            threaded.ProcessLocalGroup.exception_handle(None)

    # Process group names are registered per thread, not per process, while these threads run.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_SECONDS)
        stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors or stuck:
        report = [f"rank {rank} raised:\n{text}" for rank, text in sorted(errors.items())]
        if stuck:
            report.append(f"ranks {stuck} still running after {TIMEOUT_SECONDS:.0f} s (waiting in a collective)")
        raise AssertionError("\n".join(report))
    return results
