"""The public surface: the flag list is frozen, example scripts parse, bad flags fail clearly."""
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments import all_flags, build_parser, parse_args
from megatron.training.validation import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
FLAGS_FILE = Path(__file__).with_name("flags.txt")
MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]


def test_flag_list_is_frozen():
    """Adding or renaming a flag is a public change: update tests/unit/flags.txt in the same commit."""
    expected = FLAGS_FILE.read_text().split()
    assert all_flags() == expected


def test_help_prints_every_flags_text_as_written():
    """argparse formats help strings with %: a percent sign in a flag's text is printed as it is."""
    text = " ".join(build_parser().format_help().split())
    assert "option_strings" not in text
    assert "5% slower on Mixtral 8x7B's" in text and "at least 5% faster" in text


def test_every_flag_has_help_text():
    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.option_strings[0] != "-h" and not a.help]
    assert missing == []


def test_megatron_names_map_to_fields():
    config = parse_args(MINIMAL + ["--disable-bias-linear", "--tensor-model-parallel-size", "2",
                                   "--data-cache-path", "/tmp/x", "--swiglu"])
    assert config.model.add_bias_linear is False
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.model.swiglu is True
    assert config.data.data_cache_path == "/tmp/x"


def test_weighted_data_path_is_a_list():
    config = parse_args([a for a in MINIMAL if a != "--mock-data"] + ["--data-path", "0.3", "a", "0.7", "b"])
    assert config.data.data_path == ["0.3", "a", "0.7", "b"]


@pytest.mark.parametrize("flags, world, message", [
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
    (["--hidden-size", "65"], 1, "--hidden-size (65) must be divisible by --num-attention-heads (4)"),
    (["--global-batch-size", "6"], 2, "--global-batch-size (6) must be divisible by --micro-batch-size (2) x data-parallel size (2) = 4"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "--seq-length (64) exceeds --max-position-embeddings (32)"),
    (["--tensor-model-parallel-size", "3"], 4, "world size (4) is not divisible by tensor (3)"),
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"], 6,
     "world size (6) is not divisible by tensor (2) x pipeline (1) x context (2) parallel sizes = 4"),
    (["--context-parallel-size", "2", "--seq-length", "30", "--attention-dropout", "0"], 2,
     "--seq-length (30) must be divisible by 2 x --context-parallel-size (2) = 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "2",
      "--attention-dropout", "0"], 4,
     "key/value groups per tensor-parallel rank (2, from --num-attention-heads / --num-query-groups and "
     "--tensor-model-parallel-size) must be divisible by --context-parallel-size (4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p", "--attention-dropout", "0"], 2,
     "--cp-comm-type a2a+p2p (hierarchical all-to-all + ring) is not built"),
    (["--context-parallel-size", "2"], 2, "--attention-dropout (0.1) must be 0 with --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-dropout", "0", "--reset-attention-mask"], 2,
     "--reset-attention-mask is not supported with --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-dropout", "0", "--tensor-model-parallel-size", "4",
      "--sequence-parallel", "--seq-length", "12", "--max-position-embeddings", "12"], 8,
     "--seq-length (12) / --context-parallel-size (2) = 6 tokens per context-parallel rank must be divisible by "
     "--tensor-model-parallel-size (4)"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
    (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (["--fp8-format", "hybrid"], 1, "--fp8-format needs --bf16"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], 1, "--fp8-recipe mxfp8 is not available"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], 1,
     "--fp8-recipe rowwise takes --fp8-format e4m3"),
    (["--bf16", "--fp8-format", "e4m3", "--hidden-size", "72", "--num-attention-heads", "4"], 1,
     "FP8 GEMMs need matrix sizes divisible by 16: --hidden-size is 72"),
    (["--bf16", "--fp8-format", "hybrid", "--context-parallel-size", "2", "--micro-batch-size", "1",
      "--seq-length", "16", "--max-position-embeddings", "16", "--attention-dropout", "0"], 2,
     "FP8 GEMMs need matrix sizes divisible by 16: --micro-batch-size x --seq-length / --context-parallel-size is 8"),
    (["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--moe-ffn-hidden-size", "24"], 1,
     "FP8 GEMMs need matrix sizes divisible by 16: a moe layer's mlp.experts.fc1_weight is [4, 24, 64] on each "
     "rank (from --moe-ffn-hidden-size (24) / --expert-tensor-parallel-size (1), and --hidden-size)"),
    (["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--moe-ffn-hidden-size", "48",
      "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "mlp.experts.fc1_weight is [4, 24, 64] on each rank (from --moe-ffn-hidden-size (48) / "
     "--expert-tensor-parallel-size (2)"),
    (["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "40"], 1,
     "mlp.shared_experts.mlp.linear_fc1.weight is [40, 64] on each rank (from "
     "--moe-shared-expert-intermediate-size (40) / --tensor-model-parallel-size (1), and --hidden-size)"),
    (["--bf16", "--fp8-format", "hybrid", "--multi-latent-attention", "--q-lora-rank", "40", "--kv-lora-rank",
      "32", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"], 1,
     "a dense layer's self_attention.linear_q_up_proj.weight is [96, 40] on each rank"),
    (["--bf16", "--fp8-format", "e4m3", "--use-torch-fsdp2"], 2, "--fp8-format with --use-torch-fsdp2"),
    (["--use-flash-attn", "--attention-backend", "math"], 1,
     "--use-flash-attn conflicts with --attention-backend math"),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full needs --recompute-method"),
    (["--lr-decay-style", "WSD"], 1, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--profile", "--use-pytorch-profiler"], 1, "--profile-step-end (12) exceeds --train-iters (3)"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "2"], 1,
     "--profile-step-start (2) must be >= 0 and below --profile-step-end (2)"),
])
def test_bad_flags_name_the_flag_and_values(flags, world, message):
    with pytest.raises(ConfigError) as error:
        validate(parse_args(MINIMAL + flags), world)
    assert message in str(error.value)


@pytest.mark.parametrize("flags, note", [
    (["--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine: Transformer Engine is not used"),
    (["--cross-entropy-fusion-impl", "te"], "--cross-entropy-fusion-impl te: running the native fused cross entropy"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
     "attention stays causal over the whole sequence"),
])
def test_implementation_fallbacks_run_with_a_note(flags, note):
    notes = validate(parse_args(MINIMAL + flags), 1)
    assert any(note in n for n in notes), notes


def test_fusion_and_fp8_flags_parse_with_megatron_spellings():
    config = parse_args(MINIMAL)
    assert config.model.gradient_accumulation_fusion and config.model.cross_entropy_loss_fusion
    assert config.model.fp8 is None and config.model.attention_backend == "auto"
    config = parse_args(MINIMAL + ["--no-gradient-accumulation-fusion", "--no-cross-entropy-loss-fusion",
                                   "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--attention-backend",
                                   "fused", "--no-create-attention-mask-in-dataloader"])
    assert not config.model.gradient_accumulation_fusion and not config.model.cross_entropy_loss_fusion
    assert (config.model.fp8, config.model.fp8_recipe, config.model.attention_backend) == ("hybrid", "tensorwise", "fused")
    assert config.data.create_attention_mask_in_dataloader is False


def test_missing_data_source_is_an_error():
    with pytest.raises(ConfigError, match="--data-path"):
        validate(parse_args([a for a in MINIMAL if a != "--mock-data"]), 1)


def test_missing_required_flag_names_it(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "2"])
    assert "--hidden-size" in capsys.readouterr().err


def _script_args(script: str, env: dict) -> list:
    result = subprocess.run(["bash", str(ROOT / "examples/llama" / script)], capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1", "PATH": os.environ["PATH"], **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    return command[command.index(next(c for c in command if c.endswith("pretrain_gpt.py"))) + 1:]


@pytest.mark.parametrize("script, env, world", [
    ("train_llama3.sh", {}, 2),
    ("train_llama3.sh", {"MODEL_SIZE": "8", "TP": "2", "MBS": "2", "BS": "64", "SEQ_LENGTH": "8192", "NPROC": "8"}, 8),
    ("train_llama3.sh", {"MODEL_SIZE": "70", "LLAMA_VERSION": "3.1", "NPROC": "8", "NNODES": "4"}, 32),
    ("train_llama3.sh", {"MODEL_SIZE": "8", "PP": "2", "VPP": "2", "RECOMPUTE": "1", "NPROC": "8"}, 8),
    ("train_llama3.sh", {"MODEL_SIZE": "8", "FSDP": "1", "NPROC": "8", "ENABLE_PROFILING": "1",
                         "NO_TORCH_COMPILE": "1"}, 8),
    ("train_llama2.sh", {"MODEL_SIZE": "7", "NPROC": "8"}, 8),
    ("train_llama3.sh", {"MODEL_SIZE": "8", "TE_FP8": "1", "NPROC": "8"}, 8),
    ("train_llama2.sh", {"MODEL_SIZE": "13", "TP": "2", "NPROC": "4"}, 4),
    ("train_llama3.sh", {"MODEL_SIZE": "8", "TP": "2", "CP": "2", "SEQ_LENGTH": "32768", "NPROC": "8"}, 8),
])
def test_example_scripts_pass_valid_flags(script, env, world):
    args = _script_args(script, env)
    config = parse_args(args)
    validate(config, world)
    if env.get("LLAMA_VERSION") == "3.1":
        assert config.model.use_rope_scaling
        assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size) == (8, 4)
    if env.get("VPP"):
        assert config.parallel.num_virtual_stages_per_pipeline_rank == int(env["VPP"])
    if env.get("RECOMPUTE") == "1":
        assert config.training.recompute_granularity == "full"
    assert config.parallel.use_torch_fsdp2 == (env.get("FSDP") == "1")
    assert config.logging.profile == (env.get("ENABLE_PROFILING") == "1")
    assert config.model.no_torch_compile == (env.get("NO_TORCH_COMPILE") == "1")
    assert config.parallel.context_parallel_size == int(env.get("CP", "1"))
    assert (config.model.fp8 == "hybrid") == (env.get("TE_FP8") == "1")


def test_70b_on_one_node_explains_the_default_layout():
    result = subprocess.run(["bash", str(ROOT / "examples/llama/train_llama3.sh")], capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1", "MODEL_SIZE": "70", "NPROC": "8"}, timeout=60)
    assert result.returncode == 2
    assert "MODEL_SIZE=70 defaults to TP=8 x PP=4" in result.stderr
