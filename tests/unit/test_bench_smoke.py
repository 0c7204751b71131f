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
    ["bench/bench_pretrain.py", "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
     "--micro-batches", "2", "--", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    ["bench/bench_cross_entropy.py", "--tokens", "64", "--vocab", "512"],
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


def test_gpu_check_dry_run_writes_the_report(tmp_path):
    """bench/gpu_check.sh end to end on CPU: test lane (skipped without a GPU), one benchmark run, report."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GPU_CHECK_DRY_RUN="1", GPU_CHECK_MAX_RUNS="1",
               PYTHON=sys.executable)
    report = tmp_path / "report.md"
    result = subprocess.run(["bash", "bench/gpu_check.sh", str(report)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "# GPU check (CPU dry run)" in text and "needs a CUDA GPU" in text
    assert "| bf16 | tiny |" in text and "attention" in text
    assert "- bf16 tiny: fast paths: compile: off (CPU) | weight-gradient GEMM:" in text


def test_memory_benchmark_runs_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "bench/bench_scale_memory.py",
               "--seq-length", "16", "--hidden-size", "32", "--vocab-size", "128", "--fsdp-layers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("PP4 x VPP2 rank") == 4 and "FSDP2 DP4 start-up, rank 0" in result.stdout
