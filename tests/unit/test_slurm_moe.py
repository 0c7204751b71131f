"""examples/llama/train_llama_slurm.sh with MODEL=mixtral, qwen3_moe and deepseek_v3, under the stand-ins
for `srun` and `scontrol` of test_launch_kit.py: every node runs the mixture-of-experts script with
the job's environment (EP and ETP included) and DRY_RUN=1; the torchrun commands it prints are
parsed and validated for the job's world size."""
import os
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.validation import validate
from tests.unit.test_launch_kit import ROOT, _command, _flags, _option, _stand_ins

NODES, GPUS_PER_NODE = 2, 8


def _sbatch(tmp_path: Path, model: str, arguments: list, **variables) -> subprocess.CompletedProcess:
    bin_dir = _stand_ins(tmp_path)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[7-8]",
               SLURM_JOB_NUM_NODES=str(NODES), SLURM_JOB_ID="4243", SLURM_JOB_NAME="moe", SLURM_SUBMIT_DIR=str(ROOT),
               STANDIN_DIR=str(tmp_path), LOG_DIR=str(tmp_path / "logs"), NPROC=str(GPUS_PER_NODE), MODEL=model,
               **variables)
    env.pop("CKPT_DIR", None)
    return subprocess.run(["bash", str(ROOT / "examples/llama/train_llama_slurm.sh"), *arguments], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("model, size, variables, experts, ep, etp, topk", [
    ("mixtral", "8x7B", dict(EP="8", TP="2"), 8, 8, 2, 2),
    ("mixtral", "8x22B", dict(EP="4", TP="2", ETP="1", PP="2", MOE_DISPATCHER="allgather"), 8, 4, 1, 2),
    ("qwen3_moe", "30B-A3B", dict(EP="16"), 128, 16, 1, 8),
    ("deepseek_v3", "proxy", dict(EP="16"), 256, 16, 1, 8),
])
def test_slurm_runs_the_moe_scripts(tmp_path, model, size, variables, experts, ep, etp, topk):
    result = _sbatch(tmp_path, model, [size, "1", "32", "4096", "100", "0", "0"], SAVE_INTERVAL="200", **variables)
    assert result.returncode == 0, result.stderr
    commands = [_command((tmp_path / f"node{n}.txt").read_text()) for n in range(NODES)]
    for node, command in enumerate(commands):
        assert command[:5] == ["torchrun", "--nproc_per_node", str(GPUS_PER_NODE), "--nnodes", str(NODES)]
        assert _option(command, "--rdzv-endpoint") == "gpu-node-7:29500"
        assert _option(command, "--rdzv-conf") == f"is_host={1 if node == 0 else 0}"
    assert _flags(commands[0]) == _flags(commands[1])
    config = parse_args(_flags(commands[0]))
    validate(config, NODES * GPUS_PER_NODE)
    model_config, parallel = config.model, config.parallel
    assert (model_config.num_experts, model_config.moe_router_topk) == (experts, topk)
    etp_found = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size  # unset: TP
    assert (parallel.expert_model_parallel_size, etp_found) == (ep, etp)
    assert parallel.tensor_model_parallel_size == int(variables.get("TP", 1))
    assert parallel.pipeline_model_parallel_size == int(variables.get("PP", 1))
    assert model_config.moe_token_dispatcher_type == variables.get("MOE_DISPATCHER", "alltoall")
    assert (config.training.global_batch_size, config.training.train_iters) == (NODES * 32, 100)
    expected_dir = str(ROOT / "checkpoints" / f"{model}{size}-moe")
    assert config.checkpoint.save == config.checkpoint.load == expected_dir
    assert config.checkpoint.save_interval == 200 and config.training.exit_signal_handler


def test_slurm_refuses_an_unknown_model(tmp_path):
    result = _sbatch(tmp_path, "deepseek", ["8", "1", "16", "4096", "100", "0", "0"])
    assert result.returncode == 2
    assert "MODEL must be llama3, mixtral, qwen3_moe or deepseek_v3 (got 'deepseek')" in result.stderr
    assert not (tmp_path / "node0.txt").exists()
