"""Importing a Megatron-LM DeepSeek-V3-style checkpoint written by Megatron-Core itself.

`megatron_lm_mla_reference.py` (4 gloo processes, only Megatron-Core on PYTHONPATH) builds a GPTModel
with multi-latent attention (a query latent, both latents' norms, YaRN), a dense first layer then a
mixture of experts with a shared expert, sigmoid routing with an expert bias, group-limited top-k,
and one multi-token prediction depth; records the logits of its main head and of the prediction
depth at TP1, and saves it at TP1 and, resharded by Megatron-Core, at TP2 x PP2, in torch_dist and
legacy files. Each checkpoint, imported and loaded into our GPTModel, must give both logits within
TOLERANCE (fp32), and every layout and format must import to the same tensors.
"""
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron.core.checkpointing.megatron_lm import config_from_megatron_args, read_megatron_checkpoint
from megatron.core.checkpointing.safe_pickle import MegatronObject, load_pickled
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.hf_mapping import load_logical_into_model
from megatron.core.parallel_state import single_process
from tests.unit.test_megatron_lm_import import TOLERANCE, run_fixture_writer

WRITER = Path(__file__).with_name("megatron_lm_mla_reference.py")
ITERATION = 7
CHECKPOINTS = [(fmt, layout) for fmt in ("torch_dist", "torch") for layout in ("tp1_pp1", "tp2_pp2")]


@pytest.fixture(scope="session")
def mla_checkpoints(tmp_path_factory):
    """Megatron-Core's DeepSeek-V3-style checkpoints and logits, written once per session (4 processes)."""
    return run_fixture_writer(WRITER, tmp_path_factory.mktemp("megatron_lm_mla"))


def checkpoint_dir(root, fmt, layout) -> Path:
    return root / f"deepseek_{fmt}_{layout}"


@pytest.fixture(scope="session")
def reference_logical(mla_checkpoints):
    return read_megatron_checkpoint(checkpoint_dir(mla_checkpoints, "torch", "tp1_pp1")).logical


def logits_and_mtp_logits(checkpoint, tokens) -> tuple:
    """Our main head's logits and the prediction depth's, [b, s, V] each."""
    model = GPTModel(checkpoint.config, single_process()).eval()
    load_logical_into_model(model, checkpoint.logical)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        rotary = model.rotary(positions)
        hidden = model.decoder(model.embedding(tokens, positions), rotary)  # [s, b, h], after the final norm
        (depth,) = model.mtp(hidden, tokens, positions, model._mtp_embedding, rotary)
        return model._logits(hidden).transpose(0, 1), model._logits(depth).transpose(0, 1)


def _assert_same_logical(logical, expected):
    assert logical.keys() == expected.keys()
    for name, parts in expected.items():
        assert logical[name].keys() == parts.keys(), name
        for part, tensor in parts.items():
            assert torch.equal(logical[name][part], tensor), (name, part)


@pytest.mark.parametrize("fmt,layout", CHECKPOINTS, ids=["-".join(c) for c in CHECKPOINTS])
def test_imported_deepseek_model_gives_megatron_core_logits(mla_checkpoints, reference_logical, fmt, layout):
    torch.set_num_threads(1)
    checkpoint = read_megatron_checkpoint(checkpoint_dir(mla_checkpoints, fmt, layout))
    assert (checkpoint.iteration, checkpoint.format) == (ITERATION, fmt)
    reference = torch.load(mla_checkpoints / "deepseek_logits.pt", weights_only=True)
    logits, mtp_logits = logits_and_mtp_logits(checkpoint, reference["tokens"])
    assert reference["logits"].std() > 0.5 and reference["mtp_logits"].std() > 0.5  # a comparison that means something
    for ours, theirs in ((logits, reference["logits"]), (mtp_logits, reference["mtp_logits"])):
        difference = (ours - theirs).abs().max().item()
        assert difference < TOLERANCE, f"max |logit difference| {difference}"
    _assert_same_logical(checkpoint.logical, reference_logical)


def test_deepseek_config_follows_megatron_arguments(mla_checkpoints):
    config = read_megatron_checkpoint(checkpoint_dir(mla_checkpoints, "torch_dist", "tp2_pp2")).config
    assert config.multi_latent_attention and config.qk_layernorm
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 24, 16, 8, 12)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim,
            config.yarn_original_max_position_embeddings) == ("yarn", 4.0, 1.0, 1.0, 8)
    assert config.rotary_interleaved  # Megatron-Core's MLA rotates channel 2i with 2i+1
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (1, 0.3)
    assert (config.moe_layer_freq, config.moe_router_num_groups, config.moe_router_group_topk) == ("[0, 1]", 2, 1)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias


def test_prediction_depth_weights_change_its_logits(mla_checkpoints):
    """The prediction depth's own tensors are imported, not left at a default: its logits move when
    enorm and hnorm trade places (the test above would catch that; this one shows it could)."""
    checkpoint = read_megatron_checkpoint(checkpoint_dir(mla_checkpoints, "torch", "tp2_pp2"))
    reference = torch.load(mla_checkpoints / "deepseek_logits.pt", weights_only=True)
    logical = checkpoint.logical
    logical["mtp.layers.0.enorm.weight"], logical["mtp.layers.0.hnorm.weight"] = \
        logical["mtp.layers.0.hnorm.weight"], logical["mtp.layers.0.enorm.weight"]
    _, mtp_logits = logits_and_mtp_logits(checkpoint, reference["tokens"])
    assert (mtp_logits - reference["mtp_logits"]).abs().max().item() > 100 * TOLERANCE


def _te_spec_names(directory: Path) -> None:
    """Legacy files rewritten as Transformer Engine's spec writes them: the latents' norms fused into
    the up projections (`linear_q_up_proj.layer_norm_weight`) and the down projections whole on every
    TP rank (duplicated linears), not column-parallel."""
    files = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))  # mp_rank_TT_PPP
    states = [load_pickled(str(file)) for file in files]
    down = re.compile(r".*self_attention\.linear_(q|kv)_down_proj\.weight")
    whole = {}  # (stage, name) -> the down projection's TP shards concatenated
    for state, file in zip(states, files):
        for name in [n for n in state["model"] if down.fullmatch(n)]:
            whole.setdefault((file.parent.name[-3:], name), []).append(state["model"][name])
    for state, file in zip(states, files):
        for name, value in vars(state["args"]).items():  # Megatron's enum values, written as plain strings
            if isinstance(value, MegatronObject):
                setattr(state["args"], name, repr(value))
        model = {}
        for name, value in state["model"].items():
            if down.fullmatch(name):
                value = torch.cat(whole[(file.parent.name[-3:], name)])
            for norm, fused in (("q_layernorm.", "linear_q_up_proj.layer_norm_"),
                                ("kv_layernorm.", "linear_kv_up_proj.layer_norm_")):
                name = name.replace(f"self_attention.{norm}", f"self_attention.{fused}")
            model[name] = value
        state["model"] = model
        file.unlink()  # the loaded tensors may map the old file: write a new one
        torch.save(state, file)


def test_transformer_engine_spec_names_import_to_the_same_tensors(mla_checkpoints, reference_logical, tmp_path):
    copy = tmp_path / "te"
    shutil.copytree(checkpoint_dir(mla_checkpoints, "torch", "tp2_pp2"), copy)
    directory = copy / f"iter_{ITERATION:07d}"
    _te_spec_names(directory)
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in \
        load_pickled(str(directory / "mp_rank_01_000" / "model_optim_rng.pt"))["model"]
    _assert_same_logical(read_megatron_checkpoint(directory).logical, reference_logical)


@pytest.mark.parametrize("changes,message", [
    (dict(rotary_interleaved=True), "--multi-latent-attention with --rotary-interleaved"),
    (dict(mla_down_proj_fusion=True), "--mla-down-proj-fusion"),
    (dict(mtp_use_repeated_layer=True), "--mtp-use-repeated-layer"),
])
def test_deepseek_options_we_cannot_represent_are_refused(mla_checkpoints, changes, message):
    file = checkpoint_dir(mla_checkpoints, "torch", "tp1_pp1") / f"iter_{ITERATION:07d}" / "mp_rank_00" \
        / "model_optim_rng.pt"
    args = dict(vars(load_pickled(str(file))["args"]))
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_megatron_args({**args, **changes}, 128)


def test_convert_tool_writes_the_deepseek_model(mla_checkpoints, tmp_path):
    """tools/checkpoint/convert.py --source-format megatron: our checkpoint (the prediction depth and
    both routers' expert biases with the weights) reads back to the imported tensors and config."""
    from megatron.core.checkpointing.conversion import read_weights
    from tests.unit.test_checkpoint_convert import convert

    source = checkpoint_dir(mla_checkpoints, "torch", "tp2_pp2")
    convert.convert(["--source-format", "megatron", "--source", str(source), "--target", str(tmp_path / "ours")])
    logical, config, _, _ = read_weights(str(tmp_path / "ours"))
    imported = read_megatron_checkpoint(source)
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in logical
    _assert_same_logical(logical, imported.logical)
    assert (config.multi_latent_attention, config.rotary_interleaved, config.mtp_num_layers) == (True, True, 1)
