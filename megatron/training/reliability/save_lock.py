"""One job per --save directory: an advisory lock on `<save>/save.lock`, held by rank 0 for the job's life.

Two jobs writing one directory (a user resuming while the old job still runs) overwrite each
other's checkpoints and tracker. Rank 0 takes an exclusive, non-blocking `flock` on the lock file
before anything is built and writes its holder into it (host, process id, start time, UTC). A
second job finds the lock taken and stops at start-up with one line naming that holder.

The kernel drops the lock when its holder dies, however it dies, so a lock is never stale in the
sense of blocking: what a dead job leaves is its holder line. A job that finds a holder line in a
free lock says that it took the lock over from a job that is gone. A job that ends normally
empties the file before releasing it.

Filesystems: local disks, and NFS (Linux clients carry `flock` as an NFS byte-range lock, seen by
every client). Lustre carries it across nodes only when mounted with `-o flock` (with `localflock`
the lock is seen on one node only). A filesystem that refuses locks gives a note, and the job
runs unprotected.
"""
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Callable, Optional

import torch

from megatron.core.distributed import comm
from megatron.training.errors import ConfigError

LOCK_FILE = "save.lock"


def describe(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _read_holder(handle) -> Optional[dict]:
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "started": f"? (unreadable lock file: {text[:80]!r})"}
    return holder if isinstance(holder, dict) else None


class SaveLock:
    """The lock on one save directory (see the module docstring)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.handle = None

    def acquire(self) -> Optional[str]:
        """Takes the lock; returns a note (a takeover, or an unsupported filesystem) or None.
        Raises ConfigError naming the holder when another job holds it."""
        os.makedirs(self.save_dir, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                holder = _read_holder(handle) or {}
                handle.close()
                raise ConfigError(
                    f"--save {self.save_dir} is in use by another job ({describe(holder)}; lock file {self.path}): "
                    "stop that job first or pass another --save directory (if that job's host is down and the "
                    "lock outlived it, delete the lock file)") from None
            handle.close()
            return (f"--save {self.save_dir}: this filesystem does not support file locks ({error.strerror}); "
                    "nothing stops a second job from writing the same directory")
        previous = _read_holder(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}))
        handle.flush()
        os.fsync(handle.fileno())
        self.handle = handle
        if previous is not None:
            return f"took over {self.path} from a job that is gone ({describe(previous)})"
        return None

    def release(self) -> None:
        """Empties the file (so the next job sees a clean hand-over) and releases the lock."""
        if self.handle is None:
            return
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.flush()
        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None


def hold_save_directory(save_dir: Optional[str], groups, printer: Callable[[str], None]) -> Optional[SaveLock]:
    """Rank 0 locks `save_dir`; every rank learns whether it could (one max-reduction) and all stop
    together when it could not, rank 0 with the message naming the holder."""
    if not save_dir:
        return None
    lock, refusal = None, None
    if groups.global_rank == 0:
        lock = SaveLock(save_dir)
        try:
            note = lock.acquire()
        except ConfigError as error:
            refusal = error
        else:
            if note:
                printer(f"NOTE: {note}")
    refused = torch.tensor([float(refusal is not None)], device=groups.device)
    comm.all_reduce_max(refused, groups.world)
    if refusal is not None:
        raise refusal
    if refused.item() > 0:
        raise SystemExit(2)  # rank 0 prints why
    return lock
