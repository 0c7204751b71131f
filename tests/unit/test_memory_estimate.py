"""The planner's persistent memory terms made from the flags alone (--dry-run, tools/plan.py, and
the check that the model fits before it is allocated) against the parameters of the model actually
built for each tensor- and pipeline-parallel rank, and against the start-up figures of a built run;
and the dry run's plan for a target GPU."""

import pytest
import torch

import pretrain_gpt
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelGroups
from megatron.core.pipeline_parallel import layout
from megatron.training.arguments import parse_args
from megatron.training.memory import theoretical_bytes
from megatron.training.planning.architecture import architecture, stage_parameters
from megatron.training.planning.layout import layout_from_config
from megatron.training.planning.memory import persistent_terms
from megatron.training.planning.startup import check_device_fits, persistent_hints
from megatron.training.training import setup
from tests.distributed.parity import gpt2_config, llama_config

CASES = {
    "llama-gqa": llama_config(),
    "llama-mha-qknorm": llama_config(num_query_groups=8, qk_layernorm=True),
    "gpt2-tied-biases": gpt2_config(),
    "gpt2-qkv-bias-qknorm": gpt2_config(add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True,
                                        untie_embeddings_and_output_weights=True),
    "falcon-7b-one-norm": gpt2_config(add_bias_linear=False, position_embedding_type="rope", parallel_attn=True,
                                      group_query_attention=True, num_query_groups=1),
    "mla-q-latent-norms": llama_config(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                                       qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True),
    "mla-direct-biases": llama_config(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=16,
                                      qk_pos_emb_head_dim=8, v_head_dim=12, add_bias_linear=True),
    "falcon-40b-two-norms": gpt2_config(add_bias_linear=False, position_embedding_type="rope", parallel_attn=True,
                                        parallel_layernorm=True, group_query_attention=True, num_query_groups=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2), (4, 2)])
def test_parameters_per_rank_are_the_built_models(case, tp, pp):
    """Every TP rank of every stage (4 TP ranks with 2 key/value groups replicate the key/value heads)."""
    config = CASES[case]
    stages = layout.layers_per_rank(config.num_layers, pp)
    for pp_rank in range(pp):
        layers = layout.stage_layer_numbers(config.num_layers, pp, pp_rank)[0]
        for tp_rank in range(tp):
            groups = ParallelGroups(tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank)
            model = GPTModel(config, groups, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                             layer_numbers=layers, device=torch.device("meta"))
            built = sum(p.numel() for p in model.parameters())
            assert stage_parameters(architecture(config), tp, stages[pp_rank], first=pp_rank == 0,
                                    last=pp_rank == pp - 1, pp=pp) == built, (pp_rank, tp_rank)


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "255", "--distributed-backend", "gloo", "--swiglu", "--normalization", "RMSNorm"]


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--bf16", "--use-distributed-optimizer"], ["--optimizer", "sgd"],
                                   ["--bf16", "--grad-reduce-in-bf16", "--untie-embeddings-and-output-weights"]])
def test_estimate_is_the_start_up_figure_of_the_built_run(flags):
    config = parse_args(TINY + flags)
    run = setup(config, pretrain_gpt.forward_step, 255)
    built = theoretical_bytes(run.model.chunks, run.model.optimizer)
    lay = layout_from_config(config, run.model.config, 1)
    estimate = persistent_terms(architecture(run.model.config), lay, 2, first=True, last=True)
    assert estimate["weights"] == built["parameters"]
    assert estimate["optimizer state"] == built["optimizer_state"]
    # the gradient buffer rounds its buckets up; a few hundred elements at most here
    assert estimate["gradients"] <= built["gradients"] <= estimate["gradients"] * 1.02


def test_a_model_that_does_not_fit_names_the_flags_that_help():
    config = parse_args(TINY + ["--bf16"])
    with pytest.raises(ValueError) as error:
        check_device_fits(10 * 2 ** 30, 4 * 2 ** 30, "cuda:0", ["--tensor-model-parallel-size"], processes=1)
    assert "10.000 GiB of parameters, gradients and optimizer state" in str(error.value)
    assert "cuda:0 has 4.000 GiB free" in str(error.value)
    hints = " ".join(persistent_hints(config))
    assert "--use-distributed-optimizer" in hints and "--bf16" not in hints


LLAMA3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
             "32", "--group-query-attention", "--num-query-groups", "8", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10", "--lr", "3e-4", "--bf16",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"]


def _no_machine_memory(monkeypatch):
    """The dry run must plan for the target GPU, never for this machine."""
    from megatron.core import utils

    def refuse(*args):
        raise AssertionError("the dry run read this machine's memory")

    monkeypatch.setattr(utils, "available_memory", refuse)
    monkeypatch.setattr(utils, "memory_capacity_bytes", refuse)


def test_dry_run_of_llama3_8b_tp2_over_8_gpus(capsys, monkeypatch):
    """The README's 8-GPU Llama 3 8B command at sequence 8192: activations reported, a verdict for
    the H100 80GB, exit 0, on a machine with far less memory than the model needs."""
    _no_machine_memory(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    pretrain_gpt.main(LLAMA3_8B + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size",
                                   "64", "--seq-length", "8192", "--dry-run"])
    out = capsys.readouterr().out
    assert "plan for 1 node(s) x 8 H100 SXM 80GB (8 GPUs used): TP2 PP1 CP1 DP4 mbs 2 SP dist-opt" in out
    assert "    activations " in out and "verdict: " in out and "step time (prediction)" in out
    assert "nothing was built" in out


def test_dry_run_of_a_model_too_large_for_the_target(capsys, monkeypatch):
    """Llama 3 70B shapes at TP 8 on one node: weights, gradients and optimizer state alone exceed
    the H100's memory; the message names the flags that help."""
    _no_machine_memory(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    flags = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads",
             "64", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "32", "--micro-batch-size",
             "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "128256", "--tensor-model-parallel-size", "8", "--distributed-backend", "gloo", "--dry-run"]
    from megatron.training.validation import ConfigError

    with pytest.raises(ConfigError, match="the plan does not fit on H100 SXM 80GB: 94.99 GiB needed") as error:
        pretrain_gpt.main(flags)
    assert "--bf16" in str(error.value) and "--pipeline-model-parallel-size 2" in str(error.value)
    assert "> layout: 8 processes = TP 8 x CP 1 x PP 1 x DP 1" in capsys.readouterr().out


def test_dry_run_prints_layout_and_plan(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    pretrain_gpt.main(TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--global-batch-size", "8", "--dry-run", "--dry-run-gpu", "a100-80gb"])
    out = capsys.readouterr().out
    assert "> layout: 4 processes = TP 2 x CP 1 x PP 2 x DP 1; global batch 8 = 4 micro-batches of 2" in out
    assert "1 node(s) x 4 A100 SXM 80GB" in out and "memory per GPU (pipeline stage 0 of 2" in out
    assert "nothing was built" in out and "parameters on" not in out


def _script_flags(env: dict) -> list:
    """The pretrain_gpt.py flags examples/llama/train_llama3.sh builds for `env` (DRY_RUN=1 prints
    the command), with --bf16 as it adds on a GPU machine."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(["bash", str(root / "examples/llama/train_llama3.sh")], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, DRY_RUN="1", **env))
    assert result.returncode == 0, result.stderr
    command = next(line for line in result.stdout.splitlines() if "pretrain_gpt.py" in line)
    flags = shlex.split(command.split("pretrain_gpt.py", 1)[1])
    return flags + ([] if "--bf16" in flags else ["--bf16"])


@pytest.mark.parametrize("env, world", [
    (dict(TP="2", MBS="1", BS="64", SEQ_LENGTH="8192", MODEL_SIZE="8", NPROC="8"), 8),
    (dict(MODEL_SIZE="70", MBS="1", BS="64", SEQ_LENGTH="8192", RECOMPUTE="1", NNODES="4", NPROC="8"), 32),
])
def test_readme_llama_commands_plan_to_fit_on_h100(env, world, capsys, monkeypatch):
    """README's Llama 3 8B command and its 70B Slurm command (4 nodes, MBS 1, 16 per node, seq 8192,
    full recomputation) dry-run to a fitting plan for H100 80GB on a machine without a GPU."""
    flags = _script_flags(env)
    _no_machine_memory(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    pretrain_gpt.main(flags + ["--dry-run"])
    out = capsys.readouterr().out
    assert "verdict: fits on H100 SXM 80GB" in out and "nothing was built" in out
