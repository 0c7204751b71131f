"""bench/cost_model.py's counted FLOPs agree with Megatron's formula, and bench/gpu_check.sh's plan
fits its budget (`--dry-run`, on CPU)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cost_model  # noqa: E402

from megatron.training.reporting.logging import flops_per_iteration  # noqa: E402


@pytest.mark.parametrize("name", sorted(cost_model.PRESETS))
def test_counted_gemm_and_attention_flops_equal_megatrons_formula(name):
    p = cost_model.PRESETS[name]
    tokens = p["micro"] * cost_model.SEQ
    counted = cost_model.MICRO_BATCHES * (
        p["layers"] * (sum(cost_model.gemm_flops(tokens, i, o) for i, o in cost_model.linear_shapes(p))
                       + cost_model.attention_flops(p))
        + cost_model.gemm_flops(tokens, p["h"], p["vocab"]))
    model = cost_model.dense_config(name)
    formula = flops_per_iteration(model, cost_model.MICRO_BATCHES * p["micro"], cost_model.SEQ)
    assert counted == pytest.approx(formula, rel=1e-12)
    assert cost_model.megatron_flops(name) == pytest.approx(formula, rel=1e-12)


def test_this_version_is_predicted_faster_in_every_configuration():
    rows = {(r["preset"], r["precision"], r["version"]): r for r in cost_model.predictions()}
    for name in cost_model.PRESETS:
        for precision in ("bf16", "fp8"):
            assert rows[name, precision, "after"]["step_seconds"] < rows[name, precision, "before"]["step_seconds"]


def test_gpu_check_dry_run_prints_a_plan_that_fits_the_budget():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum("llama3" in line for line in lines) == 1 and "past the budget" not in result.stdout
    assert sum(name in line for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3") for line in lines) == 8
    assert sum("--moe-grouped-wgrad per-expert" in line and "mixtral" in line for line in lines) == 2  # bf16, FP8
    dense_ab = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--dense-ab"], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env=env).stdout
    assert sum("llama3" in line for line in dense_ab.splitlines()) == 5  # + llama3.2-1b, FP8 and two A/Bs
    assert lines[-1].endswith("fits the 570 s budget") and "NOT" not in lines[-1], result.stdout
