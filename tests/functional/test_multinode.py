"""Two nodes on one machine: two network namespaces joined by a veth pair, each running
examples/llama/train_llama3.sh with NNODES=2 (2 processes per node, gloo over the veth interface
named by GLOO_SOCKET_IFNAME, torchrun's c10d rendezvous hosted by node 0, each node known by its veth
address, LOCAL_ADDR, since the host name resolves outside the namespaces). The loss curve of the
4-process run (TP 2 x DP 2) equals the single-process run of the same flags to a relative 1e-5.

Needs root and iproute2 (`ip netns`); skips with the reason otherwise (.ci/run installs iproute2).
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.functional.test_pretrain_gpt import losses

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.213.77"
SETTINGS = {"NNODES": "2", "NPROC": "2", "TP": "2", "MBS": "1", "BS": "4", "SEQ_LENGTH": "32", "TOTAL_ITERS": "5",
            "MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": "29587", "EXTRA_ARGS": "--num-workers 0 --log-interval 1", "TEE_OUTPUT": "1",
            "OMP_NUM_THREADS": "1"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_nodes():
    """[(namespace, interface), ...] for node 0 and node 1, removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"mln{os.getpid() % 100000}"
    nodes = [(f"{tag}n{i}", f"{tag}v{i}") for i in range(2)]
    try:
        for namespace, _ in nodes:
            _ip("netns", "add", namespace)
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for index, (namespace, interface) in enumerate(nodes):
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        for namespace, _ in nodes:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        pytest.skip(f"network namespaces cannot be made here: {error.stderr.strip()}")
    yield nodes
    for namespace, _ in nodes:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, **SETTINGS, LOG_DIR=str(tmp_path / "logs"), QUICKSTART_DIR=str(tmp_path / "none"), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_two_nodes_match_one_process(two_nodes, tmp_path):
    script = str(ROOT / "examples/llama/train_llama3.sh")
    nodes = [subprocess.Popen(["ip", "netns", "exec", namespace, "bash", script], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(tmp_path, NODE_RANK=str(rank), GLOO_SOCKET_IFNAME=interface,
                                       LOCAL_ADDR=f"{SUBNET}.{rank + 1}"))
             for rank, (namespace, interface) in enumerate(two_nodes)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}:\n{output[-3000:]}"
        assert f"GLOO_SOCKET_IFNAME={two_nodes[rank][1]}" in output
        assert "--rdzv-backend c10d" in output and f"is_host={1 if rank == 0 else 0}" in output
    logged = [losses(output) for output in outputs]
    curve = next(curve for curve in logged if curve)  # global rank 0 logs; c10d decides on which node
    assert len(curve) == 5

    # The same flags in one process (the launch script's command, at TP 1, with the vocabulary padded
    # as at TP 2: to a multiple of 128 x 2).
    printed = subprocess.run(["bash", script], capture_output=True, text=True, env=_env(tmp_path, DRY_RUN="1"),
                             timeout=60).stdout.strip().splitlines()[-1]
    command = shlex.split(printed)
    flags = command[command.index(str(ROOT / "pretrain_gpt.py")) + 1:]
    single = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags, "--tensor-model-parallel-size",
                             "1", "--make-vocab-size-divisible-by", "256"], capture_output=True, text=True,
                            env=_env(tmp_path), timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    reference = losses(single.stdout)
    assert len(reference) == 5
    for step, (got, want) in enumerate(zip(curve, reference)):
        assert abs(got - want) <= 1e-5 * abs(want), f"iteration {step + 1}: {got} vs {want}"
