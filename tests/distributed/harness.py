"""Runs a function on N gloo processes (FileStore rendezvous, one thread each) and collects results.

    results = run_distributed(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

Every rank's return value comes back in rank order. The run fails (AssertionError) with a report
naming every rank that raised (with its traceback), died (with its exit code) or was still
running, and the Python stack of every rank still running at that moment, when:
- any rank raises or exits without a result: the others get a short grace period to finish, then
  the stuck ones are dumped and ended (a peer waiting for a dead rank would otherwise wait for the
  collective timeout);
- the run takes longer than `timeout` seconds, counted once every rank has started and joined
  the process group (a deadlock, or a rank waiting forever).
Collectives time out after `collective_timeout` seconds instead of gloo's 30 minutes, so a hang
inside a collective also surfaces as an error. Every spawned process (and anything it started)
is ended before this returns. Ranks are forked from a server process that imported torch and the
model once (the `forkserver` start method), not from the test process: a rank starts in ~0.1 s
instead of the ~3 s of importing torch anew, and nothing the test process did (threads, process
groups, CUDA) is inherited. `fn` must be importable at module level in a test file; the test
process's environment is passed to each rank, as it was when the run began.
"""
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

GRACE_SECONDS = 3.0       # how long the other ranks may take to finish after one has failed
DUMP_WAIT_SECONDS = 1.0   # how long a stack dump may take to be written
STARTUP_SECONDS = 180.0   # starting the ranks (and the fork server, once), before `timeout` starts counting
# Imported once by the fork server, so that no rank imports them again.
PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt.model",
           "tests.distributed.parity"]


def _worker(rank, world_size, workdir, fn, args, collective_timeout, environment):
    os.setpgid(0, 0)  # own process group: the parent ends this process and anything it starts
    os.environ.clear()  # the fork server's environment is the one it started with, not the test's now
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    stacks = open(os.path.join(workdir, f"stack.{rank}"), "w")
    faulthandler.enable(stacks, all_threads=True)                    # crashes
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)  # the parent asks for a dump
    timeout = datetime.timedelta(seconds=collective_timeout)
    # Groups made later with dist.new_group take this module default, not the world group's.
    dist.distributed_c10d.default_pg_timeout = timeout
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    # Every pair connected before any rank may finish: a rank that returns at once would otherwise
    # close its end while a slower peer is still connecting to it.
    dist.barrier()
    open(os.path.join(workdir, f"ready.{rank}"), "w").close()
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    _write_result(workdir, rank, result)
    if result[0] == "ok":
        dist.destroy_process_group()
    else:
        os._exit(1)  # peers may be waiting on this rank in a collective: do not wait with them


def _write_result(workdir: str, rank: int, result: tuple) -> None:
    path = os.path.join(workdir, f"result.{rank}")
    with open(path + ".tmp", "wb") as file:
        pickle.dump(result, file)
    os.replace(path + ".tmp", path)


def _read_result(workdir: str, rank: int):
    path = os.path.join(workdir, f"result.{rank}")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as file:
        return pickle.load(file)


def _end(process) -> None:
    if process.is_alive():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    process.join()


def _dump_stacks(processes: list, workdir: str) -> dict:
    """Asks every live rank for the stacks of all its threads; returns {rank: text}."""
    alive = [rank for rank, process in enumerate(processes)
             if process.is_alive() and os.path.exists(os.path.join(workdir, f"ready.{rank}"))]
    for rank in alive:
        os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(DUMP_WAIT_SECONDS)
    stacks = {}
    for rank in alive:
        with open(os.path.join(workdir, f"stack.{rank}")) as file:
            stacks[rank] = file.read().strip() or "(no stack written)"
    return stacks


def _report(reason: str, processes: list, results: list, stacks: dict) -> str:
    lines = [reason]
    for rank, (process, result) in enumerate(zip(processes, results)):
        if result is not None and result[0] == "error":
            lines.append(f"rank {rank} raised:\n{result[1]}")
        elif result is None and rank not in stacks:
            state = "was still starting" if process.exitcode is None else f"exited with code {process.exitcode}"
            lines.append(f"rank {rank} {state} and returned nothing")
    for rank, text in sorted(stacks.items()):
        lines.append(f"rank {rank} was still running; its stack:\n{text}")
    return "\n".join(lines)


def run_distributed(world_size: int, fn, *args, timeout: float = 300.0, collective_timeout: float = 60.0):
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run)
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as workdir:
        processes = [context.Process(target=_worker, daemon=True,
                                     args=(rank, world_size, workdir, fn, args, collective_timeout, environment))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            reason = _supervise(processes, workdir, timeout)
            results = [_read_result(workdir, rank) for rank in range(world_size)]
            stacks = _dump_stacks(processes, workdir) if reason else {}
        finally:
            for process in processes:
                _end(process)
        if reason:
            raise AssertionError(_report(reason, processes, results, stacks))
        return [result[1] for result in results]


def _supervise(processes: list, workdir: str, timeout: float):
    """Waits until every rank has exited with a result; returns None, or why the run failed (a rank
    failed and the others did not finish within the grace period, or the run timed out)."""
    launched = time.monotonic()
    deadline = launched + STARTUP_SECONDS
    started, results, failed_at = None, {}, None
    while True:
        if started is None and all(os.path.exists(os.path.join(workdir, f"ready.{r}")) for r in range(len(processes))):
            started = time.monotonic()
            deadline = started + timeout
        for rank, process in enumerate(processes):
            if rank not in results and not process.is_alive():
                results[rank] = _read_result(workdir, rank)
        failed = any(r is None or r[0] == "error" for r in results.values())
        if len(results) == len(processes):
            return "a rank failed" if failed else None
        now = time.monotonic()
        if failed:
            failed_at = failed_at or now
            if now - failed_at > GRACE_SECONDS:
                return "a rank failed while others were still running"
        if now > deadline:
            if started is None:
                return f"the ranks did not start within {STARTUP_SECONDS:.0f} s"
            return (f"the run did not finish within {timeout:.0f} s of starting (a hang or deadlock?); "
                    f"start-up took {started - launched:.1f} s")
        time.sleep(0.05)
