"""Reliability end to end: pretrain_gpt.py under torchrun (gloo, fp32, CPU, two ranks).

- a NaN in one rank's loss stops every rank at that iteration, naming the rank;
- --skip-iter-on-nan skips NaN/Inf iterations, and the run equals one that skipped those batches
  (--iterations-to-skip); --log-straggler names a rank made slow;
- a rank killed mid-step (SIGKILL) or hung makes the other rank exit non-zero within
  --distributed-timeout-minutes + 30 s, naming the rank, its host and process id;
- SIGTERM to one rank: every rank stops after the same iteration, saves and exits 0; the resumed
  run equals the uninterrupted one;
- torchrun --max-restarts with --save/--load: a worker killed mid-run, the job restarts from the
  last checkpoint and ends equal to the uninterrupted run;
- running out of memory prints the start-up estimate, the measured peak and the flags to change.

Faults come from the test-only MEGATRON_TEST_FAULTS variable (megatron/training/reliability/fault_injection.py).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.functional.test_pretrain_gpt import ROOT, pretrain_env, tensorboard_scalars

TIMEOUT_MINUTES = 0.25
BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "8",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--log-interval", "1", "--eval-iters", "0",
    "--num-workers", "0", "--distributed-backend", "gloo", "--distributed-timeout-minutes", str(TIMEOUT_MINUTES),
]
TAGS = ("lm loss", "grad-norm")


def torchrun(nproc: int = 2, *options: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *options,
            str(ROOT / "pretrain_gpt.py")]


def watchdog(process: subprocess.Popen, seconds: float) -> threading.Timer:
    """Kills the job's process group after `seconds` (so that a regression fails the test rather
    than hanging it); cancel it when done."""
    timer = threading.Timer(seconds, lambda: os.killpg(process.pid, signal.SIGKILL))
    timer.start()
    return timer


def c10d() -> list:
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]


def environment(faults: str = None) -> dict:
    env = pretrain_env()
    env.pop("MEGATRON_TEST_FAULTS", None)
    if faults:
        env["MEGATRON_TEST_FAULTS"] = faults
    return env


def run_job(extra: list, faults: str = None, launcher: list = None) -> subprocess.CompletedProcess:
    return subprocess.run((launcher or torchrun(2, *c10d())) + BASE + extra, capture_output=True, text=True,
                          timeout=300, env=environment(faults))


def curves(directory) -> dict:
    return {tag: tensorboard_scalars(directory, tag) for tag in TAGS}


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    ok(run_job(["--tensorboard-dir", str(directory / "tb")]))
    return curves(directory / "tb")


def test_nan_in_one_ranks_loss_stops_every_rank_at_that_iteration(tmp_path):
    result = run_job(["--tensorboard-dir", str(tmp_path / "tb")], faults="nan-loss@3:1")
    assert result.returncode != 0
    message = ("error: iteration 3: NaN/Inf in the loss on rank 1 and in the gradients on ranks 0, 1 (checked after "
               "the data-parallel reduction); training stopped (--check-for-nan-in-loss-and-grad) without applying it")
    assert result.stderr.count(message) == 1, result.stderr[-3000:]  # printed once, by rank 0
    assert "resuming from one with --iterations-to-skip 2" in result.stderr
    assert re.search(r"exitcode\s*: 1 \(pid", result.stderr)
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert sorted(curves(tmp_path / "tb")["lm loss"]) == [1, 2]  # nothing logged for iteration 3 on


def test_skip_iter_on_nan_equals_a_run_that_skipped_those_batches(tmp_path):
    """A NaN gradient on rank 0 at 3 and a NaN loss on rank 1 at 5 are skipped; the curve then
    equals a run told to skip iterations 3 and 5 (Megatron's numbering: --iterations-to-skip 2 4)."""
    output = ok(run_job(["--skip-iter-on-nan", "--tensorboard-dir", str(tmp_path / "skip"), "--log-straggler"],
                        faults="nan-grad@3:0,nan-loss@5:1,slow@1:1"))
    assert "WARNING: iteration 3: NaN/Inf in the gradients on ranks 0, 1" in output
    assert "WARNING: iteration 5: NaN/Inf in the loss on rank 1 and in the gradients on ranks 0, 1" in output
    assert re.search(r"iteration +8/ +8 \|.*number of skipped iterations: +2 \| number of nan iterations: +2 \|", output)
    # --log-straggler: rank 1 spends 0.2 s more in every micro-batch; it is named the slowest
    reports = re.findall(r"straggler report at iteration (\d+) \(forward-backward time per rank, mean of the last "
                         r"interval\): slowest rank (\d) ([\d.]+) ms \| fastest rank (\d) ([\d.]+) ms", output)
    assert [(int(i), int(slow), int(fast)) for i, slow, _, fast, _ in reports] == [(i, 1, 0) for i in range(1, 9)]
    assert all(float(slow) - float(fast) > 300 for _, _, slow, _, fast in reports)  # 2 micro-batches x 0.2 s
    reference = ok(run_job(["--iterations-to-skip", "2", "4", "--tensorboard-dir", str(tmp_path / "reference")]))
    assert "> iteration 3 skipped (--iterations-to-skip)" in reference
    skipped, wanted = curves(tmp_path / "skip"), curves(tmp_path / "reference")
    for tag in TAGS:
        assert sorted(wanted[tag]) == [1, 2, 4, 6, 7, 8]
        assert {i: skipped[tag][i] for i in wanted[tag]} == wanted[tag], tag


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_killed_mid_step_is_named_by_the_others(tmp_path):
    """Two torchrun agents (two 'nodes') of one rank each; rank 1 is killed with SIGKILL inside
    iteration 3. Rank 0, on the other node, exits 1 within the timeout + 30 s naming rank 1."""
    port = _free_port()
    nodes = [subprocess.Popen(torchrun(1, "--nnodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                                       "--master_port", str(port)) + BASE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment("kill@3:1"),
                              start_new_session=True)
             for node in (0, 1)]
    try:
        killed_node_output = nodes[1].communicate(timeout=240)[0]
        died = time.monotonic()
        output = nodes[0].communicate(timeout=TIMEOUT_MINUTES * 60 + 30)[0]
        waited = time.monotonic() - died
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert "(SIGKILL)" in killed_node_output
    assert nodes[0].returncode != 0 and waited < TIMEOUT_MINUTES * 60 + 30
    pid = re.search(r"exitcode\s*: -9 \(pid: (\d+)\)", killed_node_output).group(1)
    assert re.search(rf"error: rank 0: .* failed with 2 iterations completed: .*Not answering \(dead or hung; they "
                     rf"reported nothing within \d+ s\): rank 1 \(host {re.escape(socket.gethostname())}, pid {pid}\)",
                     output), output[-3000:]


def test_a_hung_rank_is_named_within_the_timeout(tmp_path):
    """Rank 1 stops answering inside iteration 3 (it sleeps): rank 0's collective times out after
    --distributed-timeout-minutes, and it exits 1 naming rank 1."""
    process = subprocess.Popen(torchrun(2, *c10d()) + BASE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=environment("hang@3:1"), start_new_session=True)
    lines, hung, reported = [], None, None
    timer = watchdog(process, 240)
    try:
        for line in process.stdout:
            lines.append(line)
            if hung is None and re.search(r" iteration +2/", line):
                hung = time.monotonic()
            if "error: rank 0:" in line:
                reported = time.monotonic()
                break
        process.wait(timeout=120)
    finally:
        timer.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    assert hung is not None and reported is not None, output[-3000:]
    assert TIMEOUT_MINUTES * 60 - 1 < reported - hung < TIMEOUT_MINUTES * 60 + 30
    assert f"Timed out waiting {int(TIMEOUT_MINUTES * 60_000)}ms" in output
    assert re.search(r"Not answering .*: rank 1 \(host .*, pid \d+\)", output)
    assert process.returncode != 0


def test_sigterm_to_one_rank_saves_on_every_rank_exits_zero_and_resumes_exactly(tmp_path, uninterrupted):
    checkpoint = tmp_path / "ckpt"
    process = subprocess.Popen(torchrun(2, *c10d()) + BASE + ["--save", str(checkpoint), "--exit-signal-handler"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
                               start_new_session=True)
    lines = []
    timer = watchdog(process, 240)
    try:
        for line in process.stdout:
            lines.append(line)
            if re.search(r" iteration +3/", line):
                break
        os.kill(_worker_pid(process.pid, rank=1), signal.SIGTERM)
        lines += process.stdout.readlines()
        assert process.wait(timeout=120) == 0, "".join(lines[-30:])
    finally:
        timer.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    stopped = int(re.search(r"exiting after iteration (\d+): signal received by another rank", output).group(1))
    assert 3 <= stopped < 8
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    ok(run_job(["--load", str(checkpoint), "--tensorboard-dir", str(tmp_path / "tb")]))
    resumed = curves(tmp_path / "tb")
    for tag in TAGS:
        assert resumed[tag] == {i: uninterrupted[tag][i] for i in range(stopped + 1, 9)}, tag


def _worker_pid(agent_pid: int, rank: int) -> int:
    """The process id of torchrun's worker of this global rank (from its environment)."""
    for pid in open(f"/proc/{agent_pid}/task/{agent_pid}/children").read().split():
        variables = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        if f"RANK={rank}".encode() in variables:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent_pid}")


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    """torchrun --max-restarts 1 ... --save D --load D: rank 1 is killed inside iteration 5; the
    restarted attempt loads iteration 4 and the whole curve equals the uninterrupted run."""
    checkpoint = str(tmp_path / "ckpt")
    output = ok(run_job(["--save", checkpoint, "--load", checkpoint, "--save-interval", "2", "--tensorboard-dir",
                         str(tmp_path / "tb")], faults="kill@5:1",
                        launcher=torchrun(2, "--max-restarts", "1", *c10d())))
    assert "loaded weights and optimizer state of iteration 4" in output
    restarted = curves(tmp_path / "tb")
    for tag in TAGS:
        assert restarted[tag] == uninterrupted[tag], tag


def test_out_of_memory_prints_the_estimate_the_peak_and_the_flags():
    """A real allocation failure (the address space capped at 3 GiB; a micro-batch's logits alone
    need 2 GiB): one message instead of the allocator's traceback, exit 1."""
    import resource

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    args = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "512", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4000", "--eval-iters", "0",
            "--num-workers", "0"]
    result = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py")] + args, capture_output=True, text=True,
                            timeout=300, env=environment(), preexec_fn=cap_memory)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"error: out of memory on rank 0 \(cpu\) with 0 iterations completed: DefaultCPUAllocator: can't "
                     r"allocate memory: you tried to allocate \d+ bytes.*\n  start-up estimate: 0.00\d GiB \(parameters "
                     r".*\n  measured peak: \d+.\d\d GiB of \d+.\d\d GiB .*\n  to use less memory: --recompute-granularity "
                     r"selective .*--micro-batch-size 256 .*--tensor-model-parallel-size 2 with --sequence-parallel",
                     result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr

