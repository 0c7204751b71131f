"""When a rank dies or hangs: every other rank stops within --distributed-timeout-minutes, naming it.

A collective with a dead peer fails at once (gloo: the connection resets); one with a hung peer
fails when it times out (every process group gets --distributed-timeout-minutes). The rank that
sees the failure then posts what it was doing (iteration, collective, error) to the job's
key-value store (torchrun's), and waits a few seconds for the others to post theirs. The ranks
that post nothing are the dead or hung ones: the report names them with their host and process
id, which every rank registered at start-up. The report is raised as `DistributedFailure`, and
`pretrain_gpt.py` prints it and exits 1.

NCCL aborts a timed-out process from its watchdog thread, before Python can report; there the
flight recorder (PyTorch's, switched on here through its environment variables) dumps each rank's
last collectives to the directory the start-up log names.

torchrun's agent keeps one key-value store for the whole job, across `--max-restarts` attempts;
`attempt_store` gives each attempt its own key prefix, so that a restarted attempt never reads the
addresses its dead predecessors published (which made the restart fail to connect).
"""
import datetime
import json
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from megatron.training.errors import DistributedFailure

_PACKAGE = str(Path(__file__).resolve().parents[2])     # .../megatron
_TORCH_DISTRIBUTED = str(Path(dist.__file__).resolve().parent)
FLIGHT_RECORDER_ENTRIES = "2000"


def attempt_prefix() -> str:
    return f"megatron/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def attempt_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """torchrun's store, private to this restart attempt, when torchrun's agent hosts it (None
    otherwise: then init_process_group's own env:// store is fresh for every attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(attempt_prefix(), store)


def enable_nccl_flight_recorder(save_dir: Optional[str]) -> str:
    """Sets PyTorch's flight-recorder variables (unless the user did) so that a timed-out NCCL
    collective dumps every rank's last collectives; returns where. Call before the NCCL group exists."""
    if "TORCH_FR_DUMP_TEMP_FILE" in os.environ or "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in os.environ:
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    else:
        directory = os.path.join(save_dir, "flight_recorder") if save_dir else os.path.join(
            tempfile.gettempdir(), "megatron_flight_recorder")
        os.makedirs(directory, exist_ok=True)
        prefix = os.path.join(directory, "nccl_trace_rank_")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.setdefault(name, prefix)
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.setdefault(name, FLIGHT_RECORDER_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return (f"NCCL flight recorder: on a collective timeout every rank writes its last "
            f"{os.environ['TORCH_FR_BUFFER_SIZE']} collectives to {prefix}<rank> (read them with "
            f"python -m torch.distributed.flight_recorder.fr_trace {os.path.dirname(prefix)} -p "
            f"{os.path.basename(prefix)})")


_BACKEND_ERRORS = re.compile(r"gloo|NCCL|Connection (reset|closed)|[Tt]imed out|timeout caused pair closure")
_COMM = os.path.join(_PACKAGE, "core", "distributed", "comm.py")


def is_collective_failure(error: BaseException) -> bool:
    """A backend error from a collective (or from waiting on one), as opposed to a bug or bad input."""
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    innermost = frames[-1] if frames else None
    return bool(_BACKEND_ERRORS.search(str(error))) or innermost is not None and (
        innermost.filename.startswith(_TORCH_DISTRIBUTED) or innermost.filename == _COMM
        or (innermost.line or "").rstrip().endswith(".wait()"))


def where_it_failed(error: BaseException) -> str:
    """'all_reduce (megatron/core/optimizer/optimizer.py:143 in step)': the collective
    (the innermost torch.distributed call, or comm.py's) and the innermost line of this framework
    outside comm.py that issued it."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_PACKAGE)]
    theirs = [f for f in frames if f.filename.startswith(_TORCH_DISTRIBUTED) and not f.name.startswith("_")
              and f.name != "wrapper"]
    collective = theirs[-1].name if theirs else None
    if not ours:
        return collective or "a collective"
    innermost = ours[-1]
    if collective is None or collective == "wait":
        waiting = (innermost.line or "").rstrip().endswith(".wait()")
        collective = ("waiting on an asynchronous collective" if waiting else
                      innermost.name if innermost.filename == _COMM else "a collective")
    caller = ([f for f in ours if f.filename != _COMM] or ours)[-1]
    path = os.path.relpath(caller.filename, os.path.dirname(_PACKAGE))
    return f"{collective} ({path}:{caller.lineno} in {caller.name})"


class FailureReport:
    """The job-wide directory of ranks (host, pid) and the protocol above. One per process."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, grace_seconds: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.grace_seconds = grace_seconds

    @classmethod
    def connect(cls, rank: int, world_size: int, timeout: datetime.timedelta) -> Optional["FailureReport"]:
        """Joins the key-value store of a torchrun job (None for one process or without torchrun)
        and registers this rank's host and process id."""
        if world_size == 1 or "MASTER_ADDR" not in os.environ:
            return None
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
            grace = min(30.0, max(5.0, timeout.total_seconds() / 10))
            report = cls(dist.PrefixStore(attempt_prefix() + "failures/", store), rank, world_size, grace)
            report.store.set(f"rank/{rank}", f"host {socket.gethostname()}, pid {os.getpid()}")
        except (RuntimeError, ValueError, dist.DistError) as error:  # training goes on; failures are reported bare
            if rank == 0:
                print(f"NOTE: no failure reports naming dead or hung ranks: the job's key-value store at "
                      f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT')} is unreachable ({error})", flush=True)
            return None
        return report

    def post(self, error: BaseException, iteration: int, collective: bool) -> dict:
        """Records this rank's failure in the store (a failure of its own, such as running out of
        memory, also as the cause the other ranks will name)."""
        mine = {"iteration": iteration, "where": where_it_failed(error) if collective else "",
                "error": _first_line(error)}
        if not collective:
            self.store.set(f"cause/{self.rank}", f"{mine['error']} (with {iteration} iterations completed)")
        self.store.set(f"failed/{self.rank}", json.dumps(mine))
        self.store.add("failed", 1)
        return mine

    def describe(self, error: BaseException, iteration: int) -> str:
        """Posts this rank's collective failure, waits for the others' (up to the grace period),
        and returns a report naming the ranks that failed on their own and those that posted nothing."""
        try:
            mine = self.post(error, iteration, collective=True)
            deadline = time.monotonic() + self.grace_seconds
            while self.store.add("failed", 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.2)
            silent = [r for r in range(self.world_size) if not self.store.check([f"failed/{r}"])]
            causes = {r: self.store.get(f"cause/{r}").decode() for r in range(self.world_size)
                      if self.store.check([f"cause/{r}"])}
            hosts = {r: self._registered(r) for r in [*silent, *causes]}
        except (RuntimeError, dist.DistError) as store_error:  # the store went with the rank that hosted it
            return (f"rank {self.rank}: {where_it_failed(error)} failed with {iteration} iterations completed: "
                    f"{_first_line(error)}; "
                    f"the job's key-value store is unreachable too ({_first_line(store_error)}), so the rank that "
                    "hosted it (rank 0 without torchrun's agent store) is probably the one that died")
        text = f"rank {self.rank}: {mine['where']} failed with {iteration} iterations completed: {mine['error']}"
        if causes:
            text += ". Failed on their own first: " + "; ".join(
                f"rank {r} ({hosts[r]}): {cause}" for r, cause in causes.items())
        if silent:
            named = "; ".join(f"rank {r} ({hosts[r]})" for r in silent)
            text += (f". Not answering (dead or hung; they reported nothing within {self.grace_seconds:.0f} s): "
                     f"{named}. Look at their logs, or for signs of their node going down")
        if not causes and not silent:
            text += ". Every rank reported a collective failure: look for the first one in the log"
        return text

    def _registered(self, rank: int) -> str:
        key = f"rank/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "host unknown: it never started"


class Watch:
    """Turns a collective failure inside its `with` block into a `DistributedFailure` naming the
    dead or hung ranks, and posts any other failure as this rank's cause for the others to name.
    `iteration()` says where training was."""

    def __init__(self, report: Optional[FailureReport], iteration: Callable[[], int]):
        self.report = report
        self.iteration = iteration

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if self.report is None or error is None or not isinstance(error, Exception):
            return False
        if not is_collective_failure(error):
            try:
                self.report.post(error, self.iteration(), collective=False)
            except (RuntimeError, dist.DistError):
                pass  # the original error matters more than the report
            return False
        # A first line at once: on one node torchrun ends the other ranks as soon as one has died.
        print(f"rank {self.report.rank}: {where_it_failed(error)} failed: {_first_line(error)}; collecting the "
              f"other ranks' reports for up to {self.report.grace_seconds:.0f} s", file=sys.stderr, flush=True)
        raise DistributedFailure(self.report.describe(error, self.iteration())) from error


def _first_line(error: BaseException) -> str:
    """The error's first line, without a backend's source location and boilerplate."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", lines[0] if lines else "")
    text = text.split(". This is typically caused by")[0]
    return f"{type(error).__name__}: {text}"[:300]
