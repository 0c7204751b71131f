"""The launch kit as a cluster runs it: the GPT-3 family script, the Slurm script under stand-ins for
`srun` and `scontrol`, and the Kubeflow PyTorchJob manifest. Each builds its torchrun command with
DRY_RUN=1 (print and stop); the flags are then parsed and validated for the intended world size."""
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.builders import transformer_config
from megatron.training.planning.architecture import architecture, total_parameters
from megatron.training.validation import validate

ROOT = Path(__file__).resolve().parents[2]


def _command(output: str) -> list:
    """The torchrun command a launch script printed (its last line starting with torchrun)."""
    line = [line for line in output.splitlines() if line.startswith("torchrun ")][-1]
    return shlex.split(line)


def _flags(command: list) -> list:
    return command[command.index(next(c for c in command if c.endswith("pretrain_gpt.py"))) + 1:]


def _option(command: list, name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("size, nodes, expected", [
    ("125M", 1, 125e6), ("350M", 1, 355e6), ("760M", 1, 760e6), ("1.3B", 1, 1.3e9), ("2.7B", 1, 2.7e9),
    ("6.7B", 1, 6.7e9), ("13B", 1, 13e9), ("175B", 16, 175e9)])
def test_gpt3_family(size, nodes, expected):
    """Every size parses and validates for 8 GPUs per node (175B: TP 8 x PP 16 on 16 nodes), and has
    its name's parameter count (GPT-2's 50257-token vocabulary)."""
    env = dict(os.environ, DRY_RUN="1", MODEL_SIZE=size, NPROC="8", NNODES=str(nodes), MASTER_ADDR="node0")
    result = subprocess.run(["bash", str(ROOT / "examples/gpt3/train_gpt3.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    config = parse_args(_flags(_command(result.stdout)))
    validate(config, 8 * nodes)
    model = transformer_config(config, 50257)
    parameters = total_parameters(architecture(model))
    assert abs(parameters / expected - 1) < 0.06, parameters
    assert config.training.rampup_batch_size and config.training.train_samples == 146484375


def _stand_ins(directory: Path) -> Path:
    """`srun` runs its task once per node (SLURM_NODEID 0, 1, ...) with DRY_RUN=1 (unless
    STANDIN_RUN=0), then writes STANDIN_PROGRESS as the saved iteration and exits STANDIN_STATUS;
    `scontrol` names the nodes and records requeues."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "while [[ \"$1\" == --* ]]; do shift; done\n"
        "for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do\n"
        "  if [ \"${STANDIN_RUN:-1}\" = 0 ]; then break; fi\n"
        "  SLURM_NODEID=$node DRY_RUN=1 \"$@\" > \"$STANDIN_DIR/node$node.txt\" 2>&1 || exit $?\n"
        "done\n"
        "if [ -n \"${STANDIN_PROGRESS:-}\" ]; then mkdir -p \"$CKPT_DIR\"; "
        "echo \"$STANDIN_PROGRESS\" > \"$CKPT_DIR/latest_checkpointed_iteration.txt\"; fi\n"
        "exit \"${STANDIN_STATUS:-0}\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        "if [ \"$1 $2\" = \"show hostnames\" ]; then printf 'gpu-node-7\\ngpu-node-8\\n'; fi\n"
        "if [ \"$1\" = requeue ]; then echo \"$2\" >> \"$STANDIN_DIR/requeued\"; fi\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod((bin_dir / tool).stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _sbatch(tmp_path: Path, saved_before=None, **standin) -> subprocess.CompletedProcess:
    bin_dir = _stand_ins(tmp_path)
    ckpt = tmp_path / "ckpt"
    if saved_before is not None:
        ckpt.mkdir()
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(saved_before))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[7-8]",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="llama", SLURM_SUBMIT_DIR=str(ROOT),
               STANDIN_DIR=str(tmp_path), CKPT_DIR=str(ckpt), LOG_DIR=str(tmp_path / "logs"), NPROC="8", TP="2",
               GLOO_SOCKET_IFNAME="ib0", **standin)
    return subprocess.run(["bash", str(ROOT / "examples/llama/train_llama_slurm.sh"), "8", "1", "16", "4096", "100",
                           "0", "1"], capture_output=True, text=True, env=env, timeout=120)


def test_slurm_builds_one_torchrun_per_node_and_requeues_after_progress(tmp_path):
    result = _sbatch(tmp_path, STANDIN_PROGRESS="40")
    assert result.returncode == 0, result.stderr
    commands = [_command((tmp_path / f"node{n}.txt").read_text()) for n in (0, 1)]
    for node, command in enumerate(commands):
        assert command[:5] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "2"]
        assert _option(command, "--rdzv-backend") == "c10d"
        assert _option(command, "--rdzv-endpoint") == "gpu-node-7:29500"
        assert _option(command, "--rdzv-conf") == f"is_host={1 if node == 0 else 0}"
        flags = _flags(command)
        config = parse_args(flags)
        validate(config, 16)
        assert (config.training.global_batch_size, config.training.seq_length, config.training.train_iters) == (32, 4096, 100)
        assert config.training.recompute_granularity == "full" and not config.parallel.use_torch_fsdp2
        assert config.checkpoint.save == config.checkpoint.load == str(tmp_path / "ckpt")
        assert config.training.exit_signal_handler and config.checkpoint.save_interval == 500
    assert _flags(commands[0]) == _flags(commands[1])
    assert "GLOO_SOCKET_IFNAME=ib0" in (tmp_path / "node1.txt").read_text()
    assert (tmp_path / "requeued").read_text().split() == ["4242"]
    assert "stopped at iteration 40 of 100" in result.stdout


@pytest.mark.parametrize("before, after, status, requeued", [
    (40, "100", 0, False),    # finished
    (40, "40", 1, False),     # no progress since the start: a failure, not a stop to requeue
    (None, None, 3, False),   # failed before saving anything
    (None, "20", 0, True),    # first job, stopped by the time limit after saving
])
def test_slurm_requeue_decision(tmp_path, before, after, status, requeued):
    standin = {"STANDIN_STATUS": str(status), "STANDIN_RUN": "0"} | ({"STANDIN_PROGRESS": after} if after else {})
    result = _sbatch(tmp_path, saved_before=before, **standin)
    assert (tmp_path / "requeued").exists() is requeued
    assert result.returncode == (0 if requeued else status)


def test_kubernetes_pytorchjob():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((ROOT / "examples/kubernetes/pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    master, worker = (specs[r]["template"]["spec"]["containers"][0] for r in ("Master", "Worker"))
    assert master == worker
    assert master["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {item["name"]: item["value"] for item in master["env"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in master["volumeMounts"]}
    for name in ("DATA_PATH", "TOKENIZER_MODEL", "CKPT_DIR", "LOG_DIR", "DATA_CACHE_PATH"):
        assert env[name].startswith(mounts["training-data"] + "/"), name
    assert mounts["shm"] == "/dev/shm"
    # The pod's command, run as the operator starts the second pod (RANK 1), from this checkout.
    script = master["args"][0].replace("/workspace/megatron-lite", str(ROOT))
    assert master["command"] == ["bash", "-c"] and "examples/llama/train_llama3.sh" in script
    pod_env = dict(os.environ, **env, WORLD_SIZE=str(nodes), RANK="1", MASTER_ADDR="llama3-8b-pretrain-master-0",
                   MASTER_PORT="23456", DRY_RUN="1")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=pod_env, timeout=60)
    assert result.returncode == 0, result.stderr
    command = _command(result.stdout)
    assert _option(command, "--nnodes") == str(nodes) and _option(command, "--nproc_per_node") == env["NPROC"]
    assert _option(command, "--rdzv-endpoint") == "llama3-8b-pretrain-master-0:23456"
    assert _option(command, "--rdzv-conf") == "is_host=0"
    config = parse_args(_flags(command))
    validate(config, nodes * int(env["NPROC"]))
    assert config.parallel.tensor_model_parallel_size == int(env["TP"]) and config.model.use_rope_scaling
    assert config.checkpoint.save == env["CKPT_DIR"] and config.data.data_path == [env["DATA_PATH"]]
