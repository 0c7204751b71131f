"""Importing Megatron-LM checkpoints written by Megatron-Core itself.

`megatron_lm_reference.py` (run in 4 gloo processes with only Megatron-Core on PYTHONPATH) builds a
Llama-style model (RMSNorm, SwiGLU, GQA with 2 query groups, RoPE with Llama 3.1 scaling, untied, no
biases) and a GPT-style one (LayerNorm, biases, GeLU, learned positions, tied embeddings) with
Megatron-Core's GPTModel, saves them in both formats (torch_dist and legacy mp_rank files) at TP1,
TP2 x PP2 and (Llama) TP2 x PP2 with two virtual stages, and records the logits of Megatron-Core's
forward pass at TP1. Each checkpoint, imported and loaded into our GPTModel, must give those logits
within TOLERANCE (fp32), and every layout must import to bit-identical logical tensors.
"""
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.checkpointing import megatron_lm
from megatron.core.checkpointing.megatron_lm import config_from_megatron_args, read_megatron_checkpoint
from megatron.core.checkpointing.safe_pickle import MegatronObject, load_pickled
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.hf_mapping import load_logical_into_model
from megatron.core.parallel_state import single_process
from tests.optional import require_megatron_core, require_module

WRITER = Path(__file__).with_name("megatron_lm_reference.py")
WORLD_SIZE = 4
ITERATION = 7
TOLERANCE = 1e-4  # max |logit difference|, fp32; logits are O(1) to O(10) (measured: <= 1e-5)
LAYOUTS = {"llama": ("tp1_pp1", "tp2_pp2", "tp2_pp2_vpp2"), "gpt": ("tp1_pp1", "tp2_pp2"), "qk": ("tp1_pp1", "tp2_pp2")}
CHECKPOINTS = [(model, fmt, layout) for model, layouts in LAYOUTS.items() for fmt in ("torch_dist", "torch")
               for layout in layouts]


@pytest.fixture(scope="session")
def megatron_checkpoints(tmp_path_factory):
    """Megatron-Core's checkpoints and logits, written once per session (4 processes, ~30-60 s)."""
    return run_fixture_writer(WRITER, tmp_path_factory.mktemp("megatron_lm"))


def run_fixture_writer(writer: Path, out: Path) -> Path:
    """Runs a Megatron-Core fixture writer in WORLD_SIZE processes (only Megatron-Core on
    PYTHONPATH) into `out`; skips when Megatron-Core cannot run here."""
    reference_dir = require_megatron_core("megatron/core/dist_checkpointing/serialization.py")
    require_module("psutil", install="pip install psutil (Megatron-Core's torch_dist writer needs it)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=reference_dir, WORLD_SIZE=str(WORLD_SIZE), OMP_NUM_THREADS="1")
    logs = [out / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    processes = []
    for rank, log in enumerate(logs):
        with open(log, "w") as stream:
            processes.append(subprocess.Popen([sys.executable, str(writer), str(out), str(out / "store")],
                                              env={**env, "RANK": str(rank)}, stdout=stream, stderr=subprocess.STDOUT))
    try:
        codes = [process.wait(timeout=600) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if any(codes):
        text = "\n".join(log.read_text()[-3000:] for log, code in zip(logs, codes) if code)
        if "ModuleNotFoundError" in text:
            pytest.skip(f"Megatron-Core in {reference_dir} cannot run here: {text.strip().splitlines()[-1]}")
        pytest.fail(f"Megatron-Core fixture writer failed (exit codes {codes}):\n{text}")
    return out


def checkpoint_dir(root, model, fmt, layout) -> Path:
    return root / f"{model}_{fmt}_{layout}"


def our_logits(checkpoint, tokens) -> torch.Tensor:
    model = GPTModel(checkpoint.config, single_process()).eval()
    load_logical_into_model(model, checkpoint.logical)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions).transpose(0, 1)  # [s, b, V] -> [b, s, V]


@pytest.fixture(scope="session")
def tp1_logical(megatron_checkpoints):
    return {model: read_megatron_checkpoint(checkpoint_dir(megatron_checkpoints, model, "torch", "tp1_pp1")).logical
            for model in LAYOUTS}


@pytest.mark.parametrize("model,fmt,layout", CHECKPOINTS, ids=["-".join(c) for c in CHECKPOINTS])
def test_imported_model_gives_megatron_core_logits(megatron_checkpoints, tp1_logical, model, fmt, layout):
    torch.set_num_threads(1)
    checkpoint = read_megatron_checkpoint(checkpoint_dir(megatron_checkpoints, model, fmt, layout))
    assert (checkpoint.iteration, checkpoint.format) == (ITERATION, fmt)
    reference = torch.load(megatron_checkpoints / f"{model}_logits.pt", weights_only=True)
    difference = (our_logits(checkpoint, reference["tokens"]) - reference["logits"]).abs().max().item()
    assert difference < TOLERANCE, f"max |logit difference| {difference}"
    # Every layout and format merges to exactly the same tensors.
    expected = tp1_logical[model]
    assert checkpoint.logical.keys() == expected.keys()
    for name, parts in expected.items():
        assert checkpoint.logical[name].keys() == parts.keys(), name
        for part, tensor in parts.items():
            assert torch.equal(checkpoint.logical[name][part], tensor), (name, part)


def test_convert_tool_writes_a_checkpoint_of_the_same_model(megatron_checkpoints, tmp_path):
    """tools/checkpoint/convert.py --source-format megatron: the written checkpoint reads back to the
    imported tensors and gives Megatron-Core's logits."""
    import importlib.util

    from megatron.core.checkpointing.conversion import read_weights

    spec = importlib.util.spec_from_file_location("convert_tool", Path(__file__).resolve().parents[2]
                                                  / "tools" / "checkpoint" / "convert.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    source = checkpoint_dir(megatron_checkpoints, "llama", "torch_dist", "tp2_pp2")
    convert.convert(["--source-format", "megatron", "--source", str(source), "--target", str(tmp_path / "ours")])
    logical, config, _, _ = read_weights(str(tmp_path / "ours"))
    imported = read_megatron_checkpoint(source)
    for name, parts in imported.logical.items():
        for part, tensor in parts.items():
            assert torch.equal(logical[name][part], tensor), (name, part)
    reference = torch.load(megatron_checkpoints / "llama_logits.pt", weights_only=True)
    converted = megatron_lm.MegatronCheckpoint(ITERATION, {}, config, logical, "torch_dist", str(tmp_path))
    assert (our_logits(converted, reference["tokens"]) - reference["logits"]).abs().max().item() < TOLERANCE


def test_config_follows_megatron_arguments(megatron_checkpoints):
    llama = read_megatron_checkpoint(checkpoint_dir(megatron_checkpoints, "llama", "torch_dist", "tp2_pp2")).config
    assert (llama.num_layers, llama.num_query_groups, llama.kv_channels, llama.padded_vocab_size) == (4, 2, 16, 128)
    assert (llama.normalization, llama.swiglu, llama.activation, llama.add_bias_linear) == \
        ("RMSNorm", True, "silu", False)
    assert (llama.position_embedding_type, llama.rotary_base, llama.use_rope_scaling) == ("rope", 500000.0, True)
    assert llama.untie_embeddings_and_output_weights
    checkpoint = read_megatron_checkpoint(checkpoint_dir(megatron_checkpoints, "gpt", "torch", "tp2_pp2"))
    gpt = checkpoint.config
    assert (gpt.normalization, gpt.activation, gpt.add_bias_linear) == ("LayerNorm", "gelu_tanh", True)
    assert gpt.position_embedding_type == "learned_absolute" and not gpt.untie_embeddings_and_output_weights
    assert "output_layer.weight" not in checkpoint.logical  # the tied copy on the last stage is not read
    assert checkpoint.args["tensor_model_parallel_size"] == 2
    assert isinstance(checkpoint.args["model_type"], MegatronObject)  # Megatron's enum, never imported


def test_paths_iterations_and_tracker(megatron_checkpoints, tmp_path):
    source = checkpoint_dir(megatron_checkpoints, "gpt", "torch", "tp1_pp1")
    iteration_dir = source / f"iter_{ITERATION:07d}"
    for path, iteration in ((source, None), (source, ITERATION), (iteration_dir, None), (iteration_dir, ITERATION)):
        assert megatron_lm.iteration_directory(path, iteration) == str(iteration_dir)
    with pytest.raises(FileNotFoundError, match="iter_0000003"):
        megatron_lm.iteration_directory(source, 3)
    with pytest.raises(ValueError, match="iteration=3 asks for another"):
        megatron_lm.iteration_directory(iteration_dir, 3)
    with pytest.raises(ValueError, match="not a Megatron checkpoint"):
        read_megatron_checkpoint(tmp_path)
    copy = tmp_path / "release_copy"
    shutil.copytree(source, copy)
    (copy / f"iter_{ITERATION:07d}").rename(copy / "release")
    (copy / megatron_lm.TRACKER).write_text("release\n")
    assert read_megatron_checkpoint(copy).directory == str(copy / "release")
    (copy / megatron_lm.TRACKER).write_text("12\n")
    with pytest.raises(FileNotFoundError, match=f"iter_0000012 .*named by {copy / megatron_lm.TRACKER}"):
        read_megatron_checkpoint(copy)


def _copy(megatron_checkpoints, tmp_path, model, fmt, layout) -> Path:
    copy = tmp_path / f"{model}_{fmt}_{layout}"
    shutil.copytree(checkpoint_dir(megatron_checkpoints, model, fmt, layout), copy)
    return copy / f"iter_{ITERATION:07d}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("fmt,file", [("torch", "mp_rank_01_001/model_optim_rng.pt"), ("torch_dist", "__0_1.distcp"),
                                      ("torch_dist", "common.pt"), ("torch_dist", ".metadata")])
def test_truncated_file_is_named(megatron_checkpoints, tmp_path, fmt, file):
    directory = _copy(megatron_checkpoints, tmp_path, "llama", fmt, "tp2_pp2")
    _truncate(directory / file)
    with pytest.raises(ValueError, match=re.escape(str(directory / file))):
        read_megatron_checkpoint(directory)


def test_missing_shard_is_named(megatron_checkpoints, tmp_path):
    directory = _copy(megatron_checkpoints, tmp_path, "llama", "torch", "tp2_pp2")
    shutil.rmtree(directory / "mp_rank_01_001")
    with pytest.raises(FileNotFoundError, match="mp_rank_01_001/model_optim_rng.pt is missing"):
        read_megatron_checkpoint(directory)
    shutil.rmtree(directory / "mp_rank_00_001")
    with pytest.raises(ValueError, match="pipeline_model_parallel_size is 2 in the checkpoint's arguments"):
        read_megatron_checkpoint(directory)


class _Payload:
    """Unpickling this would create `marker`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickled_code_is_never_run(megatron_checkpoints, tmp_path):
    marker = tmp_path / "payload_ran"
    legacy = _copy(megatron_checkpoints, tmp_path, "gpt", "torch", "tp1_pp1")
    file = legacy / "mp_rank_00" / "model_optim_rng.pt"
    torch.save({"args": _Payload(str(marker)), "model": {}}, file)
    with pytest.raises(ValueError, match=f"{file}.*GLOBAL (posix|os).mkdir"):
        read_megatron_checkpoint(legacy)
    dist = _copy(megatron_checkpoints, tmp_path, "gpt", "torch_dist", "tp1_pp1")
    (dist / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ValueError, match=r"\.metadata.*refusing to load global (posix|os)\.mkdir"):
        read_megatron_checkpoint(dist)
    assert not marker.exists()


def _rewrite_args(directory: Path, **changes) -> None:
    """common.pt with changed arguments (Megatron's enum values written as plain strings)."""
    common = load_pickled(str(directory / "common.pt"))
    args = common["args"]
    for name, value in vars(args).items():
        if isinstance(value, MegatronObject):
            setattr(args, name, repr(value))
    for name, value in changes.items():
        setattr(args, name, value)
    torch.save(common, directory / "common.pt")


@pytest.mark.parametrize("changes,message", [
    (dict(qk_layernorm=True), "missing ['decoder.layers.0.self_attention.k_layernorm.weight'"),
    (dict(num_experts=8), "missing ['decoder.layers.0.mlp.experts.fc1_weight'"),  # a dense model's tensors
    # a dense model's tensors under multi-latent attention's arguments
    (dict(multi_latent_attention=True), "missing ['decoder.layers.0.self_attention.linear_kv_down_proj.weight'"),
    (dict(position_embedding_type="yarn"), "--position-embedding-type yarn"),
    (dict(num_layers=3), "expected the layers stacked in its first dimension (num_layers=3)"),
    (dict(ffn_hidden_size=64), "decoder.layers.0.mlp.linear_fc1.weight has shapes"),
    (dict(padded_vocab_size=256), "padded_vocab_size is 256"),
])
def test_options_we_cannot_represent_are_refused(megatron_checkpoints, tmp_path, changes, message):
    directory = _copy(megatron_checkpoints, tmp_path, "llama", "torch_dist", "tp1_pp1")
    _rewrite_args(directory, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_megatron_checkpoint(directory)


def test_arguments_map_to_config_without_a_checkpoint():
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=False, num_query_groups=1,
                swiglu=False, add_bias_linear=False, bias_gelu_fusion=True)
    config = config_from_megatron_args(args, 128)
    assert (config.num_query_groups, config.activation) == (4, "gelu")  # no bias: no fused (tanh) GeLU
    assert config_from_megatron_args({**args, "add_bias_linear": True}, 128).activation == "gelu_tanh"
    assert config_from_megatron_args({**args, "add_bias_linear": True, "bias_gelu_fusion": False}, 128).activation \
        == "gelu"
    with pytest.raises(ValueError, match="--normalization LayerNorm1p"):
        config_from_megatron_args({**args, "normalization": "LayerNorm1p"}, 128)
