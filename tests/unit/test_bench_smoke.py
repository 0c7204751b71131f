"""The benchmark scripts still run (tiny preset, CPU). No timing is asserted: figures are for humans."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [
    ["bench/bench_pretrain.py", "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
     "--micro-batches", "2", "--", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["bench/bench_distributed_optimizer.py", "--preset", "tiny"],
    ["bench/bench_context_parallel.py", "--preset", "tiny"],
])
def test_benchmark_runs_and_prints_figures(command):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens" in result.stdout and "peak memory" in result.stdout.lower()


def test_checkpoint_benchmark_runs():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "bench/bench_checkpoint.py", "--size", "tiny", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for text in ("sync save:", "load:", "async save: training blocked"):
        assert text in result.stdout, result.stdout[-2000:]
