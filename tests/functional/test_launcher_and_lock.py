"""A stopped job really stops, and one job writes a --save directory: pretrain_gpt.py under torchrun
(gloo, fp32, CPU, two ranks).

- SIGKILL to torchrun's whole process group mid-run: every worker is gone within a few seconds
  and no later checkpoint appears (megatron/training/reliability/launcher_watch.py);
- a second job given the --save directory of a running one stops at start-up with one line naming
  the holder; a lock left by a killed job is taken over with a note (megatron/training/reliability/save_lock.py).
"""
import os
import re
import signal
import subprocess
import time

from tests.functional.test_reliability import BASE, c10d, environment, torchrun, watchdog, _worker_pid
from tests.unit.test_launcher_watch import _alive

LONG = ["--train-iters", "100000", "--save-interval", "1"]


def _checkpoints(directory) -> set:
    return {name for name in os.listdir(directory) if re.fullmatch(r"iter_\d+", name)} if os.path.isdir(directory) else set()


def _start(checkpoint, lines: list) -> tuple:
    """A long job saving every iteration; returns (torchrun process, its two worker pids) once
    iteration 3 is logged."""
    process = subprocess.Popen(torchrun(2, *c10d()) + BASE + LONG + ["--save", str(checkpoint)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
                               start_new_session=True)
    for line in process.stdout:
        lines.append(line)
        if re.search(r" iteration +3/", line):
            return process, [_worker_pid(process.pid, rank) for rank in (0, 1)]
    raise AssertionError("".join(lines[-40:]))


def test_sigkill_to_torchruns_process_group_ends_every_worker_and_every_write(tmp_path):
    checkpoint = tmp_path / "ckpt"
    lines, workers = [], []
    process = None
    try:
        process, workers = _start(checkpoint, lines)
        timer = watchdog(process, 240)
        os.killpg(process.pid, signal.SIGKILL)  # torchrun's group: the agent, not its workers' groups
        timer.cancel()
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        survivors = [pid for pid in workers if _alive(pid)]
        written = _checkpoints(checkpoint)
        time.sleep(3)  # anything still writing would show up now
        assert survivors == [], f"workers {survivors} outlived torchrun by 10 s"
        assert _checkpoints(checkpoint) == written
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process is not None:
            process.wait()


def test_a_second_job_on_the_same_save_directory_is_refused_naming_the_first(tmp_path):
    checkpoint = tmp_path / "ckpt"
    lines, workers = [], []
    process = None
    try:
        process, workers = _start(checkpoint, lines)
        second = subprocess.run(torchrun(2, *c10d()) + BASE + ["--save", str(checkpoint)], capture_output=True,
                                text=True, timeout=240, env=environment())
        output = second.stdout + second.stderr
        refusals = [line for line in output.splitlines() if "is in use by another job" in line]
        assert second.returncode != 0 and len(refusals) == 1, output[-3000:]
        assert refusals[0].startswith(f"error: --save {checkpoint} is in use by another job (host ")
        assert f"pid {workers[0]}, started " in refusals[0]  # the first job's rank 0
        assert "iteration" not in output  # refused before any training
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    third = subprocess.run(torchrun(2, *c10d()) + BASE + ["--save", str(checkpoint)], capture_output=True, text=True,
                           timeout=240, env=environment())
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert f"NOTE: took over {checkpoint / 'save.lock'} from a job that is gone (host " in third.stdout
    assert f"pid {workers[0]}, started " in third.stdout
