"""The mixture-of-experts bench presets: bench/cost_model.py predicts the model bench_pretrain.py
runs (same architecture, its FLOPs counted per expert GEMM equal to Megatron's formula with the
active parameters), each fits one 80 GB GPU, and bench/gpu_check.sh's plan runs them."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_pretrain  # noqa: E402
import cost_model  # noqa: E402

from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.reporting.logging import flops_per_iteration  # noqa: E402
from megatron.training.startup import startup_checks  # noqa: E402

H100_BYTES = 80e9


def _benchmark_model(name):
    """The model description bench_pretrain.py builds for the preset (its flags, parsed and validated)."""
    flags = bench_pretrain.COMMON + bench_pretrain.PRESETS[name] + [
        "--global-batch-size", "8", "--train-iters", "4", "--max-position-embeddings", "4096"]
    config = parse_args(flags)
    return startup_checks(config, config.data.vocab_size, 1, None)[1]


@pytest.mark.parametrize("name", sorted(cost_model.MOE_PRESETS))
def test_the_cost_model_predicts_the_benchmarked_model(name):
    model = _benchmark_model(name)
    described = cost_model.moe_config(name)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "padded_vocab_size", "swiglu"):
        assert getattr(model, field) == getattr(described, field), field
    batch = cost_model.MICRO_BATCHES
    assert flops_per_iteration(model, batch, cost_model.SEQ) == flops_per_iteration(described, batch, cost_model.SEQ)


@pytest.mark.parametrize("name", sorted(cost_model.MOE_PRESETS))
def test_counted_expert_flops_equal_megatrons_active_parameter_formula(name):
    """The GEMM and attention FLOPs the cost model counts (each expert's GEMMs at its share of the
    rows, without the router's GEMM, which Megatron does not count) equal Megatron's formula."""
    p = cost_model.MOE_PRESETS[name]
    flops = cost_model.moe_layer_flops(p)
    layer = flops["linears"] + flops["experts"] + flops["attention"]
    output = cost_model.gemm_flops(p["micro"] * cost_model.SEQ, p["h"], p["vocab"])
    counted = cost_model.MICRO_BATCHES * (p["layers"] * layer + output)
    formula = flops_per_iteration(cost_model.moe_config(name), cost_model.MICRO_BATCHES * p["micro"], cost_model.SEQ)
    assert counted == pytest.approx(formula, rel=1e-12)
    # MFU is against the active parameters: the same step time with all experts counted would be far higher.
    dense = dataclasses.replace(cost_model.moe_config(name), num_experts=None,
                                ffn_hidden_size=p["experts"] * p["expert_f"])
    assert flops_per_iteration(dense, cost_model.MICRO_BATCHES, cost_model.SEQ) > 2 * formula


@pytest.mark.parametrize("name", sorted(cost_model.MOE_PRESETS))
def test_each_moe_preset_fits_one_h100(name):
    """Weights, gradients, optimizer state and FP8's weight casts under 70 GB, leaving 10 GB of the
    80 for one micro-batch's activations (a few GB at these sizes)."""
    fp8 = cost_model.moe_prediction(name, "fp8")
    assert fp8["state_gb"] * 1e9 < H100_BYTES - 10e9
    assert fp8["parameters"] > 3e9  # full-width layers, not a toy


def test_gpu_check_plan_runs_both_moe_presets_in_bf16_and_one_in_fp8():
    result = subprocess.run([sys.executable, "gpu_plan.py", "--lines"], capture_output=True, text=True,
                            cwd=ROOT / "bench", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = [line.split("|") for line in result.stdout.splitlines()]
    moe = [(name, preset) for name, preset, *_ in runs if preset in cost_model.MOE_PRESETS]
    assert ("bf16", "mixtral-8x7b-2layers") in moe and ("bf16", "qwen3-30b-a3b-4layers") in moe
    assert any(name.startswith("fp8") for name, _ in moe)


def test_the_moe_benchmark_runs_with_fp8_experts_on_cpu():
    """bench_pretrain.py on the tiny MoE preset (what gpu_check.sh's CPU dry run uses for the MoE
    entries), FP8 as the plan's Mixtral run: it trains and its start-up line names the experts' path."""
    result = subprocess.run([sys.executable, "bench/bench_pretrain.py", "--preset", "tiny-moe", "--device", "cpu",
                             "--micro-batches", "2", "--warmup", "1", "--steps", "2", "--", "--bf16",
                             "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "experts: per-expert scales, rows padded to 16, a loop of GEMMs" in result.stdout
    assert "tokens per GPU (tokens/s/GPU)" in result.stdout
    smoke = subprocess.run([sys.executable, "gpu_plan.py", "--lines", "--smoke"], capture_output=True, text=True,
                           cwd=ROOT / "bench", timeout=120).stdout
    assert sum("|tiny-moe|" in line for line in smoke.splitlines()) == 8
    assert sum("--moe-grouped-wgrad per-expert" in line for line in smoke.splitlines()) == 2  # bf16, FP8


@pytest.mark.parametrize("wgrad, path", [
    ("triton", "experts: a Triton grouped GEMM adding into main_grad"),
    ("per-expert", "experts: a GEMM per expert accumulating into main_grad (counts copied to the host without waiting)")])
def test_the_moe_benchmark_runs_the_weight_gradient_choices_on_cpu(wgrad, path):
    """The plan's weight-gradient A/Bs on the tiny MoE preset, the Triton kernel in Triton's
    interpreter (as gpu_check.sh's dry run runs it): it trains and its start-up line names the
    experts' path."""
    if wgrad == "triton":
        pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "bench/bench_pretrain.py", "--preset", "tiny-moe", "--device", "cpu",
                             "--micro-batches", "2", "--warmup", "1", "--steps", "2", "--", "--bf16",
                             "--moe-grouped-wgrad", wgrad], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert path in result.stdout
    assert "tokens per GPU (tokens/s/GPU)" in result.stdout
