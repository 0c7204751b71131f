"""Importing Megatron-LM mixture-of-experts checkpoints written by Megatron-Core itself.

`megatron_lm_moe_reference.py` (4 gloo processes, only Megatron-Core on PYTHONPATH) builds two MoE
GPTModels with Megatron-Core ("mixtral": every layer 4 experts, top-2 softmax; "shared": a dense first
layer, sigmoid routing with an expert bias and a top-k scaling factor, shared experts with their
gate, query/key norms), records the logits of its forward pass at TP1 / EP1, and saves each at
TP1 / EP1 and, resharded by Megatron-Core's dist_checkpointing, at EP2, TP2 x EP2 and (mixtral)
PP2 x EP2 and TP2 x EP2 with expert-tensor-parallel size 1 (torch_dist only): torch_dist, and legacy files with the experts in SequentialMLP's form, the legacy
GroupedMLP's (weight1/weight2) or TEGroupedMLP's names. Each checkpoint, imported and loaded into
our GPTModel, must give Megatron-Core's logits within TOLERANCE (fp32), and every layout and form
must import to the same tensors; the Mixtral-like one, exported to Hugging Face, must give
Megatron-Core's logits in `transformers`' MixtralForCausalLM.
"""
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron.core.checkpointing.megatron_lm import config_from_megatron_args, read_megatron_checkpoint
from megatron.core.checkpointing.safe_pickle import load_pickled
from tests.unit.test_megatron_lm_import import TOLERANCE, _rewrite_args, our_logits, run_fixture_writer

WRITER = Path(__file__).with_name("megatron_lm_moe_reference.py")
ITERATION = 7
CHECKPOINTS = [
    ("mixtral", "torch_dist", "tp1_pp1_ep1"), ("mixtral", "torch", "tp1_pp1_ep1"),
    ("mixtral", "torch-grouped", "tp1_pp1_ep1"),
    ("mixtral", "torch_dist", "tp1_pp1_ep2"), ("mixtral", "torch", "tp1_pp1_ep2"),
    ("mixtral", "torch_dist", "tp2_pp1_ep2"), ("mixtral", "torch", "tp2_pp1_ep2"),
    ("mixtral", "torch-grouped", "tp2_pp1_ep2"),
    ("mixtral", "torch_dist", "tp1_pp2_ep2"), ("mixtral", "torch", "tp1_pp2_ep2"),
    ("mixtral", "torch_dist", "tp2_pp1_ep2_etp1"),
    ("shared", "torch_dist", "tp1_pp1_ep1"), ("shared", "torch", "tp1_pp1_ep1"), ("shared", "torch-te", "tp1_pp1_ep1"),
    ("shared", "torch_dist", "tp1_pp1_ep2"), ("shared", "torch-te", "tp1_pp1_ep2"),
    ("shared", "torch_dist", "tp2_pp1_ep2"), ("shared", "torch-te", "tp2_pp1_ep2"),
]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    """Megatron-Core's MoE checkpoints and logits, written once per session (4 processes, ~10-30 s)."""
    return run_fixture_writer(WRITER, tmp_path_factory.mktemp("megatron_lm_moe"))


def checkpoint_dir(root, model, fmt, layout) -> Path:
    return root / f"{model}_{fmt}_{layout}"


@pytest.fixture(scope="session")
def reference_logical(moe_checkpoints):
    return {model: read_megatron_checkpoint(checkpoint_dir(moe_checkpoints, model, "torch", "tp1_pp1_ep1")).logical
            for model in ("mixtral", "shared")}


@pytest.mark.parametrize("model,fmt,layout", CHECKPOINTS, ids=["-".join(c) for c in CHECKPOINTS])
def test_imported_moe_model_gives_megatron_core_logits(moe_checkpoints, reference_logical, model, fmt, layout):
    torch.set_num_threads(1)
    checkpoint = read_megatron_checkpoint(checkpoint_dir(moe_checkpoints, model, fmt, layout))
    assert (checkpoint.iteration, checkpoint.format) == (ITERATION, "torch_dist" if fmt == "torch_dist" else "torch")
    reference = torch.load(moe_checkpoints / f"{model}_logits.pt", weights_only=True)
    difference = (our_logits(checkpoint, reference["tokens"]) - reference["logits"]).abs().max().item()
    assert difference < TOLERANCE, f"max |logit difference| {difference}"
    expected = reference_logical[model]
    assert checkpoint.logical.keys() == expected.keys()
    for name, parts in expected.items():
        assert checkpoint.logical[name].keys() == parts.keys(), name
        for part, tensor in parts.items():
            assert torch.equal(checkpoint.logical[name][part], tensor), (name, part)


def test_moe_config_follows_megatron_arguments(moe_checkpoints):
    mixtral = read_megatron_checkpoint(checkpoint_dir(moe_checkpoints, "mixtral", "torch", "tp2_pp1_ep2")).config
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (4, 2, 96)
    assert mixtral.moe_router_score_function == "softmax" and mixtral.moe_shared_expert_intermediate_size is None
    # nargs='+' flags saved with their scalar defaults become one-element lists
    assert (mixtral.moe_router_load_balancing_type, mixtral.moe_aux_loss_coeff) == (["aux_loss"], [0.0])
    checkpoint = read_megatron_checkpoint(checkpoint_dir(moe_checkpoints, "shared", "torch_dist", "tp1_pp1_ep2"))
    shared = checkpoint.config
    assert (shared.moe_layer_freq, shared.moe_ffn_hidden_size, shared.moe_shared_expert_intermediate_size) == \
        ("[0, 1, 1]", 32, 64)
    assert shared.moe_shared_expert_gate and shared.moe_router_enable_expert_bias
    assert (shared.moe_router_score_function, shared.moe_router_topk_scaling_factor) == ("sigmoid", 2.0)
    assert (shared.moe_router_load_balancing_type, shared.moe_aux_loss_coeff) == (["seq_aux_loss"], [1e-3])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in checkpoint.logical  # the dense first layer
    bias = checkpoint.logical["decoder.layers.1.mlp.router.expert_bias"][""]
    assert bias.shape == (4,) and bias.abs().sum() > 0


def test_expert_bias_changes_the_logits(moe_checkpoints):
    """Without its expert bias the "shared" model routes differently: the bias is imported, not
    skipped (else the test above could pass with zeros)."""
    checkpoint = read_megatron_checkpoint(checkpoint_dir(moe_checkpoints, "shared", "torch_dist", "tp1_pp1_ep1"))
    reference = torch.load(moe_checkpoints / "shared_logits.pt", weights_only=True)
    for name in [n for n in checkpoint.logical if n.endswith("router.expert_bias")]:
        checkpoint.logical[name][""].zero_()
    assert (our_logits(checkpoint, reference["tokens"]) - reference["logits"]).abs().max().item() > 100 * TOLERANCE


def test_missing_expert_parallel_shard_is_named(moe_checkpoints, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_dir(moe_checkpoints, "mixtral", "torch", "tp1_pp2_ep2"), copy)
    directory = copy / f"iter_{ITERATION:07d}"
    shutil.rmtree(directory / "mp_rank_00_001_001")
    with pytest.raises(FileNotFoundError, match=re.escape("mp_rank_00_001_001/model_optim_rng.pt is missing")):
        read_megatron_checkpoint(directory)


def _args(moe_checkpoints) -> dict:
    file = checkpoint_dir(moe_checkpoints, "mixtral", "torch", "tp1_pp1_ep1") / f"iter_{ITERATION:07d}" / "mp_rank_00" \
        / "model_optim_rng.pt"
    return dict(vars(load_pickled(str(file))["args"]))


@pytest.mark.parametrize("changes,message", [
    (dict(moe_router_score_function="sqrtsoftplus"), "--moe-router-score-function sqrtsoftplus"),
    (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input"),
    (dict(moe_latent_size=16), "--moe-latent-size"),
    (dict(add_bias_linear=True), "--num-experts with linear biases"),
    (dict(expert_tensor_parallel_size=1, tensor_model_parallel_size=2), "--expert-tensor-parallel-size 1 != "),
])
def test_moe_options_we_cannot_represent_are_refused(moe_checkpoints, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_megatron_args({**_args(moe_checkpoints), **changes}, 128)


def test_moe_shapes_that_disagree_with_the_arguments_are_named(moe_checkpoints, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_dir(moe_checkpoints, "mixtral", "torch_dist", "tp1_pp1_ep1"), copy)
    directory = copy / f"iter_{ITERATION:07d}"
    _rewrite_args(directory, num_experts=8)
    with pytest.raises(ValueError, match=re.escape("holds experts [0, 1, 2, 3]; the arguments (num_experts=8)")):
        read_megatron_checkpoint(directory)


def test_convert_tool_writes_the_moe_model_with_its_expert_bias(moe_checkpoints, tmp_path):
    """tools/checkpoint/convert.py --source-format megatron on an expert-parallel checkpoint: our
    checkpoint (experts under global indices, the routers' expert biases with the weights) reads back
    to the imported tensors and gives Megatron-Core's logits."""
    import importlib.util

    from megatron.core.checkpointing import megatron_lm
    from megatron.core.checkpointing.conversion import read_weights

    spec = importlib.util.spec_from_file_location("convert_tool", Path(__file__).resolve().parents[2]
                                                  / "tools" / "checkpoint" / "convert.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    source = checkpoint_dir(moe_checkpoints, "shared", "torch-te", "tp2_pp1_ep2")
    convert.convert(["--source-format", "megatron", "--source", str(source), "--target", str(tmp_path / "ours")])
    logical, config, _, _ = read_weights(str(tmp_path / "ours"))
    imported = read_megatron_checkpoint(source)
    assert logical.keys() == imported.logical.keys()
    for name, parts in imported.logical.items():
        for part, tensor in parts.items():
            assert torch.equal(logical[name][part], tensor), (name, part)
    reference = torch.load(moe_checkpoints / "shared_logits.pt", weights_only=True)
    converted = megatron_lm.MegatronCheckpoint(ITERATION, {}, config, logical, "torch", str(tmp_path))
    assert (our_logits(converted, reference["tokens"]) - reference["logits"]).abs().max().item() < TOLERANCE


def test_megatron_mixtral_exported_to_hugging_face_gives_megatron_core_logits(moe_checkpoints, tmp_path):
    """Megatron-LM (legacy, TP2 x EP2) -> convert.py --target-format hf -> transformers'
    MixtralForCausalLM: the two independent implementations agree through our import."""
    from tests.optional import require_module
    from tests.unit.test_checkpoint_convert import convert

    transformers = require_module("transformers")
    source = checkpoint_dir(moe_checkpoints, "mixtral", "torch", "tp2_pp1_ep2")
    convert.convert(["--source-format", "megatron", "--source", str(source), "--target-format", "hf",
                     "--target", str(tmp_path / "hf")])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                              dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "MixtralForCausalLM"
    reference = torch.load(moe_checkpoints / "mixtral_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model.eval()(reference["tokens"]).logits
    assert (logits - reference["logits"]).abs().max().item() < TOLERANCE


def test_training_starts_from_the_imported_moe_model_and_its_expert_bias(moe_checkpoints, tmp_path):
    """pretrain_gpt.py --load <converted Megatron-LM MoE> --finetune --use-checkpoint-args: the MoE
    flags come from the checkpoint, and the routers start from Megatron-Core's expert biases (after
    one step each has moved by the update rate, 1e-3, at most)."""
    from megatron.core.checkpointing.storage import read_full_tensors
    from tests.functional.test_pretrain_gpt import run_pretrain
    from tests.unit.test_checkpoint_convert import convert

    source = checkpoint_dir(moe_checkpoints, "shared", "torch_dist", "tp1_pp1_ep2")
    convert.convert(["--source-format", "megatron", "--source", str(source), "--target", str(tmp_path / "ours")])
    flags = ["--load", str(tmp_path / "ours"), "--finetune", "--use-checkpoint-args", "--save", str(tmp_path / "tuned"),
             "--save-interval", "1", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr",
             "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
    result = run_pretrain([], base=flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--use-checkpoint-args: num_experts = 4" in result.stdout
    assert "--use-checkpoint-args: moe_router_enable_expert_bias = True" in result.stdout
    imported = read_megatron_checkpoint(source).logical
    keys = [f"model/decoder.layers.{layer}.mlp.router.expert_bias" for layer in (1, 2)]
    tuned = read_full_tensors(str(tmp_path / "tuned" / "iter_0000001"), keys)
    for key in keys:
        start = imported[key[len("model/"):]][""]
        assert start.abs().min() > 1e-2
        assert (tuned[key] - start).abs().max().item() <= 1e-3 + 1e-6, key
