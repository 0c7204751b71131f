"""bench_pretrain.py --profile (what bench/gpu_check.sh adds to the MoE runs) records one more step's
top kernels and CPU/GPU time in the run's JSON, and bench/gpu_report.py prints them per run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_report  # noqa: E402


def test_the_profiled_moe_step_reaches_the_report(tmp_path):
    figures = tmp_path / "run1.json"
    result = subprocess.run([sys.executable, "bench/bench_pretrain.py", "--preset", "tiny-moe", "--device", "cpu",
                             "--micro-batches", "1", "--warmup", "0", "--steps", "1", "--profile",
                             "--json", str(figures)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "profiled step: self CPU" in result.stdout and "CPU/GPU n/a (no device time)" in result.stdout
    profile = json.loads(figures.read_text())["profile"]
    assert profile["cpu_ms"] > 0 and len(profile["top"]) == 15
    (tmp_path / "runs.txt").write_text("bf16|tiny-moe||0\n")
    report = "\n".join(gpu_report._profiles(tmp_path))
    assert "### bf16 tiny-moe" in report and "| kernel or op | self CPU (ms) | self GPU (ms) | calls |" in report


def test_a_lane_cut_short_still_reports_each_outcome(tmp_path):
    """bench/gpu_check.sh runs the GPU lane with -v: when its time limit stops pytest before the
    summary, the report lists the outcomes printed as each test ended; with the summary, those."""
    (tmp_path / "lane.log").write_text(
        "tests/gpu/test_moe_gpu.py::test_grouped_mm_experts_equal_the_loop PASSED [ 10%]\n"
        "tests/gpu/test_moe_gpu.py::test_triton_weight_gradient_kernel_on_cuda[bf16] FAILED [ 20%]\n"
        "tests/gpu/test_moe_gpu.py::test_triton_weight_gradient_kernel_on_cuda[fp8-e4m3] ")
    lines = gpu_report._lane(tmp_path)
    assert any("test_grouped_mm_experts_equal_the_loop PASSED" in line for line in lines)
    assert any("kernel_on_cuda[bf16] FAILED" in line for line in lines)
    (tmp_path / "lane.log").write_text("tests/gpu/x.py::a PASSED [100%]\n\nPASSED tests/gpu/x.py::a\n1 passed in 1s\n")
    assert gpu_report._lane(tmp_path) == ["```", "PASSED tests/gpu/x.py::a", "1 passed in 1s", "```"]
