"""Mixture-of-experts flags: each bad combination is one error naming the flags and values, before
the model is built; the flags reach the model description; a tiny MoE model trains with the
auxiliary losses in the log line and no Python warning."""
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.builders import transformer_config
from megatron.training.reporting.logging import flops_per_iteration
from megatron.training.validation import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]
MOE = ["--num-experts", "8", "--moe-ffn-hidden-size", "32"]


def _validate(extra: list, world_size: int = 1) -> list:
    return validate(parse_args(MINIMAL + extra), world_size)


@pytest.mark.parametrize("flags, world, message", [
    (["--expert-model-parallel-size", "3"], 6,
     "--num-experts (8) must be divisible by --expert-model-parallel-size (3)"),
    (["--expert-model-parallel-size", "4"], 2,
     "--expert-model-parallel-size (4) x --expert-tensor-parallel-size (1) = 4 must divide the ranks of a pipeline "
     "stage (tensor x context x data parallel = 2)"),
    (["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], 2,
     "--expert-model-parallel-size (2) x --expert-tensor-parallel-size (2) = 4 must divide the ranks"),
    (["--moe-router-topk", "9"], 1, "--moe-router-topk (9) must be between 1 and --num-experts (8)"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     "--num-experts (8) must be divisible by --moe-router-num-groups (3)"),
    (["--moe-router-group-topk", "2"], 1, "group-limited routing (--moe-router-group-topk 2) needs --moe-router-num-groups"),
    (["--moe-pad-expert-input-to-capacity"], 1, "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (["--moe-token-drop-policy", "position"], 1, "--moe-token-drop-policy position needs --moe-expert-capacity-factor"),
    (["--tensor-model-parallel-size", "2"], 2,
     "mixture of experts with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--moe-token-dispatcher-type", "flex"], 1, "--moe-token-dispatcher-type flex needs DeepEP"),
    (["--moe-router-load-balancing-type", "sinkhorn"], 1, "--moe-router-load-balancing-type sinkhorn is not built"),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1", "0.2", "0.3"],
     1, "--moe-aux-loss-coeff has 3 values for the 2 --moe-router-load-balancing-type values"),
    (["--moe-router-enable-expert-bias"], 1, "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--moe-layer-freq", "[1]*3"], 1, "--moe-layer-freq pattern [1, 1, 1] must have one 0 or 1 per layer"),
    (["--use-torch-fsdp2"], 2, "--use-torch-fsdp2 with --num-experts is not built"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2",
      "--moe-ffn-hidden-size", "33"], 2,
     "--moe-ffn-hidden-size (33) must be divisible by --expert-tensor-parallel-size (2)"),
])
def test_bad_moe_flags_are_one_clear_error(flags, world, message):
    with pytest.raises(ConfigError) as error:
        _validate(MOE + flags, world)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_triton_weight_gradients_need_a_gpu_and_triton(monkeypatch):
    from megatron.training import validation

    flags = MOE + ["--moe-grouped-wgrad", "triton"]
    monkeypatch.setattr(validation, "_cuda_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="--moe-grouped-wgrad triton runs its kernel on a CUDA GPU and none is "
                                          "visible"):
        _validate(flags)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _validate(flags)  # (the interpreter: the CPU tests and gpu_check.sh's dry run)
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(validation.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"--moe-grouped-wgrad triton needs Triton \(pip install triton\)"):
        _validate(flags)


def test_per_expert_weight_gradients_say_where_they_do_nothing():
    def notes(flags):
        return [note for note in _validate(flags) if "--moe-grouped-wgrad per-expert" in note]

    fp8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert notes(MOE + ["--moe-grouped-wgrad", "per-expert"]) == []
    assert notes(MOE + fp8 + ["--moe-grouped-wgrad", "per-expert", "--moe-router-padding-for-fp8"]) == []
    for flags in (["--moe-grouped-wgrad", "per-expert"],
                  MOE + ["--moe-grouped-wgrad", "per-expert", "--no-gradient-accumulation-fusion"],
                  MOE + fp8 + ["--moe-grouped-wgrad", "per-expert"]):  # FP8 rows padded: the loop
        assert len(notes(flags)) == 1 and "has no effect here" in notes(flags)[0]


def test_expert_parallel_needs_experts():
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2 needs --num-experts"):
        _validate(["--expert-model-parallel-size", "2"], 2)


def test_good_moe_layouts_validate():
    _validate(MOE + ["--expert-model-parallel-size", "4"], 4)
    _validate(MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--expert-tensor-parallel-size", "1"], 4)
    _validate(MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                     "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk", "4"])


def test_flags_reach_the_model_description():
    config = parse_args(MINIMAL + MOE + [
        "--moe-layer-freq", "[0]*1+[1]*1", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
        "--moe-aux-loss-coeff", "0.01", "0.02", "--moe-shared-expert-intermediate-size", "48",
        "--moe-router-dtype", "fp32", "--moe-router-topk", "3"])
    model = transformer_config(config, 128)
    assert model.num_experts == 8 and model.moe_ffn_hidden_size == 32 and model.moe_router_topk == 3
    assert model.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert model.moe_aux_loss_coeff == [0.01, 0.02] and model.moe_router_dtype == "fp32"
    assert model.moe_layer_freq == "[0]*1+[1]*1" and model.moe_shared_expert_intermediate_size == 48


def test_flops_count_the_active_experts():
    dense = transformer_config(parse_args(MINIMAL + ["--ffn-hidden-size", "96"]), 128)
    moe = transformer_config(parse_args(MINIMAL + ["--num-experts", "8", "--moe-ffn-hidden-size", "48",
                                                   "--moe-router-topk", "2", "--ffn-hidden-size", "256"]), 128)
    assert flops_per_iteration(moe, 8, 32) == flops_per_iteration(dense, 8, 32)


def test_tiny_moe_trains_with_aux_losses_in_the_log_line():
    command = [sys.executable, "-W", "error", str(ROOT / "pretrain_gpt.py"), *MINIMAL, *MOE,
               "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
               "--distributed-backend", "gloo", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
               "--moe-layer-freq", "[0]*1+[1]*1", "--moe-shared-expert-intermediate-size", "32", "--swiglu",
               "--moe-token-dispatcher-type", "alltoall", "--moe-layer-recompute"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "iteration" in line and "lm loss" in line]
    assert len(lines) == 3
    assert all("load_balancing_loss: " in line and "z_loss: " in line for line in lines)
    assert "Warning" not in done.stderr
    # --moe-grouped-wgrad auto, the default: on the CPU the grouped path, untimed, said at start-up
    assert "[auto -> grouped-mm (not timed on the CPU)]" in done.stdout


def _script_args(script: str, env: dict) -> list:
    result = subprocess.run(["bash", str(ROOT / "examples" / script)], capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1", **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    return command[command.index(next(c for c in command if c.endswith("pretrain_gpt.py"))) + 1:]


@pytest.mark.parametrize("script, env, world, experts, ep", [
    ("mixtral/train_mixtral.sh", {}, 2, 4, 1),
    ("mixtral/train_mixtral.sh", {"MODEL_SIZE": "8x7B", "EP": "8", "NPROC": "8"}, 8, 8, 8),
    ("mixtral/train_mixtral.sh", {"MODEL_SIZE": "8x22B", "EP": "8", "TP": "2", "ETP": "1", "PP": "4", "NPROC": "8",
                                  "NNODES": "4", "MOE_LAYER_RECOMPUTE": "1"}, 32, 8, 8),
    ("qwen3_moe/train_qwen3_moe.sh", {}, 2, 8, 1),
    ("qwen3_moe/train_qwen3_moe.sh", {"MODEL_SIZE": "30B-A3B", "EP": "4", "TP": "2", "ETP": "1", "NPROC": "8"},
     8, 128, 4),
    ("deepseek_v3/train_deepseek_v3.sh", {}, 2, 16, 1),
    ("deepseek_v3/train_deepseek_v3.sh", {"MODEL_SIZE": "proxy", "EP": "8", "NPROC": "8"}, 8, 256, 8),
    ("deepseek_v3/train_deepseek_v3.sh", {"MODEL_SIZE": "671B", "EP": "64", "PP": "16", "NPROC": "8",
                                          "NNODES": "128", "MOE_LAYER_RECOMPUTE": "1"}, 1024, 256, 64),
])
def test_moe_example_scripts_pass_valid_flags(script, env, world, experts, ep):
    config = parse_args(_script_args(script, env))
    validate(config, world)
    assert config.model.num_experts == experts and config.parallel.expert_model_parallel_size == ep
    assert config.model.moe_layer_recompute == (env.get("MOE_LAYER_RECOMPUTE") == "1")
