"""No Python warning in the documented layouts: pretrain_gpt.py under torchrun with every warning
turned into an error (PYTHONWARNINGS=error, inherited by the workers) trains, evaluates and exits 0.
FSDP2 used to warn that the model returned a view tensor (its per-token loss, transposed)."""
import os
import subprocess

import pytest

from tests.functional.test_pretrain_gpt import TINY_LLAMA, losses, pretrain_command

LAYOUTS = {
    "single-process": (1, []),
    "tp2-dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-tp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-tp2": (4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]),
    "distributed-optimizer": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    "fsdp2": (2, ["--use-torch-fsdp2"]),
    "fsdp2-pp2": (4, ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]),
    "ep2-fp8": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                    "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--bf16", "--fp8-format", "hybrid",
                    "--fp8-recipe", "delayed"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_documented_layout_runs_with_warnings_as_errors(layout):
    nproc, flags = LAYOUTS[layout]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), PYTHONWARNINGS="error")
    result = subprocess.run(pretrain_command(nproc) + TINY_LLAMA + flags, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    assert len(losses(result.stdout)) == 5
