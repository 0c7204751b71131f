"""launcher_watch: a worker ends when its parent dies, by the portable parent-PID watchdog alone
(the prctl path is exercised end to end in tests/functional/test_launcher_and_lock.py)."""
import os
import signal
import subprocess
import sys
import time

from megatron.training.reliability import launcher_watch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

# The parent starts a child in a session of its own (as torchrun starts workers) that arms only
# the watchdog thread, prints its pid and sleeps; the parent then prints its own pid and sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, threading, time
from megatron.training.reliability import launcher_watch
threading.Thread(target=launcher_watch._watch_parent, args=(os.getppid(), 0.1), daemon=True).start()
print(os.getpid(), flush=True)
time.sleep(600)
'''], start_new_session=True, stdout=sys.stdout)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_watchdog_kills_the_worker_when_its_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its parent by 10 s"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_outside_torchrun_nothing_is_armed(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher_watch.die_with_launcher() is None


def test_parent_death_signal_is_set_on_linux():
    if not sys.platform.startswith("linux"):
        assert launcher_watch.set_parent_death_signal(signal.SIGKILL) is False
        return
    # In a child, so that this test process keeps its own setting.
    code = ("import ctypes, signal; from megatron.training.reliability import launcher_watch as w; "
            "assert w.set_parent_death_signal(signal.SIGKILL); "
            "v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.stdout.strip() == str(int(signal.SIGKILL)), result.stderr
