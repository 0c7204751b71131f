"""save_lock: one job per --save directory; a dead holder's lock is taken over with a note."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron.training.reliability.save_lock import LOCK_FILE, SaveLock
from megatron.training.validation import ConfigError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = SaveLock(str(tmp_path))
    assert first.acquire() is None
    with pytest.raises(ConfigError) as refused:
        SaveLock(str(tmp_path)).acquire()  # another open file: flock conflicts even within one process
    message = str(refused.value)
    assert message.startswith(f"--save {tmp_path} is in use by another job (host {socket.gethostname()}, "
                              f"pid {os.getpid()}, started 20")
    assert "\n" not in message and str(tmp_path / LOCK_FILE) in message
    first.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    again = SaveLock(str(tmp_path))
    assert again.acquire() is None  # a clean hand-over: no note
    again.release()


def test_a_killed_holders_lock_is_taken_over_with_a_note(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from megatron.training.reliability.save_lock import SaveLock; "
        f"lock = SaveLock({str(tmp_path)!r}); lock.acquire(); print('locked', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}, started"):
            SaveLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = SaveLock(str(tmp_path))
    note = lock.acquire()
    assert note.startswith(f"took over {tmp_path / LOCK_FILE} from a job that is gone (host {socket.gethostname()}, "
                           f"pid {holder.pid}, started 20"), note
    lock.release()
