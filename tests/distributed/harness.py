"""Runs a function on N gloo processes (FileStore rendezvous, one thread each) and collects results.

    results = run_distributed(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

Every rank's return value comes back in rank order; an exception on any rank fails the caller with
that rank's traceback. Processes are spawned (not forked), so `fn` must be importable at module
level in a test file.
"""
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # reported to the parent with the traceback
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_distributed(world_size: int, fn, *args, timeout: float = 240.0):
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), fn, args, results),
                                     nprocs=world_size, join=False, start_method="spawn")
        while not context.join(timeout=timeout):
            pass
        errors = [f"rank {r}:\n{results[r][1]}" for r in range(world_size) if r in results and results[r][0] == "error"]
        if errors:
            raise AssertionError("\n".join(errors))
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise AssertionError(f"ranks {missing} returned nothing")
        return [results[r][1] for r in range(world_size)]
