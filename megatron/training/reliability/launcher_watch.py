"""Workers die with their launcher.

torchrun starts each worker in a session (and process group) of its own, so a `kill -9` of
torchrun's process group leaves the workers running, reparented to init, still writing
checkpoints into `--save`. Under torchrun each worker therefore ends itself when its parent (the
torchrun agent) dies:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills the worker the moment its parent
  exits, however it exits;
- everywhere, a daemon thread that compares `os.getppid()` with the parent it started under,
  every `POLL_SECONDS`, and kills the worker when it changes (the portable fallback, and a second
  line on Linux).

SIGKILL rather than SIGTERM: a worker with `--exit-signal-handler` would answer SIGTERM by saving
one more checkpoint, which is exactly the late write this prevents. Saves are atomic, so a worker
killed mid-save leaves the previous checkpoint as the latest. A worker started outside torchrun (a
single `python pretrain_gpt.py`, perhaps under nohup) is left alone.
"""
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Optional

POLL_SECONDS = 1.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def set_parent_death_signal(signum: int) -> bool:
    """Linux only: the kernel sends `signum` to this process when its parent exits. False elsewhere
    or where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, poll_seconds: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher(poll_seconds: float = POLL_SECONDS) -> Optional[threading.Thread]:
    """Under torchrun, ties this worker's life to its parent's (see the module docstring); returns
    the watchdog thread, or None outside torchrun."""
    if not under_torchrun():
        return None
    parent_pid = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if parent_pid == 1:  # the parent died before prctl took effect: it will never signal now
        os.kill(os.getpid(), signal.SIGKILL)
    watchdog = threading.Thread(target=_watch_parent, args=(parent_pid, poll_seconds), name="launcher-watch",
                                daemon=True)
    watchdog.start()
    return watchdog
