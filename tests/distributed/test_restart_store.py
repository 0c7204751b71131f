"""A torchrun restart joins on keys of its own.

torchrun's agent hosts one key-value store for the whole job and keeps it across `--max-restarts`
attempts; PyTorch's workers use it without a per-attempt prefix, so a restarted rank that comes up
before its peer reads the address its dead predecessor published and fails to connect. Here the
agent's store is played by a TCPStore in the test, and attempt 1's rank 0 starts seconds before
its rank 1: with `join_process_group` both still meet."""
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import datetime, torch, torch.distributed as dist
from megatron.training.initialize import join_process_group
join_process_group("gloo", 2, datetime.timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
print("joined", total.item(), flush=True)
dist.destroy_process_group()  # an exit with gloo's threads still up may abort ("terminate called ...")
"""


def start(rank: int, attempt: int, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True",
               TORCHELASTIC_RESTART_COUNT=str(attempt))
    return subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def test_a_restarted_rank_does_not_read_its_dead_predecessors_address():
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=60))
    first = [start(rank, 0, agent_store.port) for rank in (0, 1)]
    for worker in first:
        assert worker.wait(timeout=120) == 0, worker.stdout.read()
    early = start(0, 1, agent_store.port)
    time.sleep(5)  # longer than gloo's connection retries
    late = start(1, 1, agent_store.port)
    for worker in (early, late):
        output = worker.communicate(timeout=120)[0]
        assert worker.returncode == 0 and "joined 2.0" in output, output[-3000:]
