"""DeepSeek-V3's YaRN rotary scaling (--rope-type yarn) and its mixture-of-experts layers against
`transformers`' DeepseekV3ForCausalLM on tiny models built here (fp32, random weights, written with
save_pretrained: one tensor per expert, as on the hub): equal logits (1e-4) past the original
context, the round trip gives the files' tensors and config back, 5 AdamW steps track
transformers; YaRN's frequencies equal a direct evaluation of its formula and Megatron-Core's own
YarnRotaryEmbedding."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.checkpointing.conversion import read_hf  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.hf_mapping import (  # noqa: E402
    architecture_for_hf,
    hf_config_from_transformer_config,
    hf_config_to_transformer_config,
    hf_to_logical,
    load_logical_into_model,
    logical_to_hf,
    model_to_logical,
)
from megatron.core.transformer.config import TransformerConfig, derive  # noqa: E402
from megatron.core.transformer.rope import (  # noqa: E402
    inverse_frequencies,
    yarn_concentration,
    yarn_softmax_correction,
)
from megatron.training.arguments import parse_args  # noqa: E402
from tests.hf_training import assert_training_tracks_transformers  # noqa: E402
from tests.unit.test_arguments import MINIMAL  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402
from tests.unit.test_mla import deepseek_config  # noqa: E402
from tests.optional import require_megatron_core, skip_unless_importable_by_megatron_core  # noqa: E402
from tests.unit.test_moe_flags import _script_args  # noqa: E402

VOCAB, BATCH, SEQ, TOLERANCE = 128, 2, 40, 1e-4  # 40 positions: past the original 16 of the YaRN cases
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
CASES = {
    # DeepSeek-V3's own mscale = mscale_all_dim: only the attention scale changes, by mscale(4, 1)^2
    "yarn": dict(rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=1.0), first_k_dense_replace=3),
    # unequal: the rotated channels are scaled too, by mscale(4, 1) / mscale(4, 0.5)
    "yarn unequal mscale": dict(rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.5), first_k_dense_replace=3),
    # neither: transformers scales the rotated channels by mscale(4, 1), the attention not at all
    "yarn without mscale": dict(rope_scaling=dict(YARN), first_k_dense_replace=3),
    # the first layer dense, the others mixtures of experts (with YaRN, as the released model)
    "experts": dict(rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=1.0), first_k_dense_replace=1),
    "experts, no groups, two shared": dict(first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=2,
                                           routed_scaling_factor=1.0),
}
EXPERTS = dict(num_hidden_layers=3, moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_model(case):
    hf = randomize(transformers.DeepseekV3ForCausalLM(deepseek_config(**{**EXPERTS, **CASES[case]}))).eval()
    generator = torch.Generator().manual_seed(2)
    for module in hf.modules():  # a bias as large as the scores' spread: it changes which experts are chosen
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(0.3 * torch.randn(module.e_score_correction_bias.shape,
                                                                   generator=generator))
    return hf


def saved_pair(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    hf_config, files = read_hf(str(tmp_path))
    config = hf_config_to_transformer_config(hf_config)
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(files, config, "deepseek_v3"))
    return hf, ours, files


def logits(model, tokens, ours: bool):
    if not ours:
        return model(input_ids=tokens).logits
    return model(tokens, torch.arange(SEQ).expand(BATCH, SEQ)).transpose(0, 1)[..., :VOCAB]


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_logits_equal_transformers(case, tmp_path):
    hf, ours, _ = saved_pair(case, tmp_path)
    config = ours.config
    if "rope_scaling" in CASES[case]:
        assert (config.rope_type, config.rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (
            "yarn", 4.0, 16)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    expected = logits(hf, tokens, ours=False)
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(logits(ours, tokens, ours=True), expected, atol=TOLERANCE, rtol=0)


@torch.no_grad()
def test_the_scaling_and_the_expert_bias_change_the_logits(tmp_path):
    """The comparisons above mean something: without YaRN, or without the expert bias, the logits
    differ by far more than the tolerance."""
    hf, ours, _ = saved_pair("experts", tmp_path)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    reference = logits(ours, tokens, ours=True)
    plain = GPTModel(dataclasses.replace(ours.config, rope_type="rope", rotary_scaling_factor=1.0),
                     parallel_state.single_process()).eval()
    plain.load_state_dict(ours.state_dict())
    assert (logits(plain, tokens, ours=True) - reference).abs().max() > 100 * TOLERANCE
    for name, buffer in ours.named_buffers():
        if name.endswith("expert_bias"):
            buffer.zero_()
    assert (logits(ours, tokens, ours=True) - reference).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_gives_the_files_back(case, tmp_path):
    hf, ours, files = saved_pair(case, tmp_path)
    config = ours.config
    assert architecture_for_hf(config) == "deepseek_v3"
    back = logical_to_hf(model_to_logical(ours), config, "deepseek_v3", vocab_size=VOCAB)
    assert sorted(back) == sorted(files)
    for key, tensor in back.items():
        assert torch.equal(tensor, files[key]), key
    exported = hf_config_from_transformer_config(config, VOCAB)
    assert hf_config_to_transformer_config(exported) == config
    moe = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
           "topk_group", "routed_scaling_factor") if config.num_experts else ()
    for key in ("first_k_dense_replace",) + moe:
        assert getattr(exported, key) == getattr(hf.config, key), key
    scaling = CASES[case].get("rope_scaling")
    if scaling is not None:  # mscale and mscale_all_dim unset compute as 1 and 0
        expected = dict(scaling, mscale=scaling.get("mscale", 1.0), mscale_all_dim=scaling.get("mscale_all_dim", 0.0))
        assert {key: exported.rope_parameters[key] for key in expected} == expected


def test_experts_map_onto_megatron_core_fields(tmp_path):
    _, ours, _ = saved_pair("experts", tmp_path)
    c = ours.config
    assert (c.num_experts, c.moe_ffn_hidden_size, c.moe_router_topk, c.moe_shared_expert_intermediate_size) == (
        8, 20, 4, 20)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_layer_freq == "[0]*1+[1]*2" and c.ffn_hidden_size == 96


def test_five_training_steps_track_transformers_and_adamw(tmp_path):
    hf, ours, _ = saved_pair("experts", tmp_path)
    assert_training_tracks_transformers(hf, ours, VOCAB, BATCH, SEQ)


def test_yarn_frequencies_equal_the_formula():
    """Frequency i of d rotated channels, theta_i = base^(-2i/d), turns r_i = L theta_i / (2 pi)
    times over the original context L. It is kept where r_i > beta_fast, divided by the factor where
    r_i < beta_slow, and mixed linearly in i between the indices where r_i crosses beta_fast
    (rounded down) and beta_slow (rounded up)."""
    d, base, factor, original = 32, 10000.0, 40.0, 4096
    config = _yarn_config(qk_pos_emb_head_dim=d, rotary_base=base, rotary_scaling_factor=factor,
                          yarn_original_max_position_embeddings=original)
    got = inverse_frequencies(config).double()
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turns = original * theta / (2 * math.pi)
    crossing = [d / 2 * math.log(original / (2 * math.pi * beta)) / math.log(base) for beta in (32, 1)]
    low, high = math.floor(crossing[0]), math.ceil(crossing[1])
    mix = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    torch.testing.assert_close(got, theta * (1 - mix) + theta / factor * mix, rtol=1e-6, atol=0)
    assert 0 < low < high < d // 2 - 1, "the band must lie inside for the check to cover all three regimes"
    torch.testing.assert_close(got[turns > 32], theta[turns > 32], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[turns < 1], theta[turns < 1] / factor, rtol=1e-6, atol=0)
    unrounded = inverse_frequencies(dataclasses.replace(config, yarn_correction_range_round_to_int=False)).double()
    mix = ((torch.arange(d // 2, dtype=torch.float64) - crossing[0]) / (crossing[1] - crossing[0])).clamp(0, 1)
    torch.testing.assert_close(unrounded, theta * (1 - mix) + theta / factor * mix, rtol=1e-6, atol=0)


REFERENCE_CASES = [
    dict(dim=64, base=10000, factor=40, original=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
         round=True),  # DeepSeek-V3's
    dict(dim=16, base=10000, factor=4, original=16, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.5,
         round=True),
    dict(dim=32, base=500000, factor=8, original=8192, beta_fast=16, beta_slow=2, mscale=0.7, mscale_all_dim=0.0,
         round=False),
]


def test_yarn_equals_megatron_core():
    """Our frequencies, concentration and softmax factor against Megatron-Core's own YarnRotaryEmbedding
    (run in a subprocess: both packages are `megatron`)."""
    root = require_megatron_core("megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": root}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_core_yarn_reference.py")
    done = subprocess.run([sys.executable, "-W", "ignore", script, json.dumps(REFERENCE_CASES)], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        skip_unless_importable_by_megatron_core(done.stderr)
        raise AssertionError(done.stderr[-3000:])
    for case, expected in zip(REFERENCE_CASES, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
        config = _yarn_config(
            qk_pos_emb_head_dim=case["dim"], rotary_base=case["base"], rotary_scaling_factor=case["factor"],
            yarn_original_max_position_embeddings=case["original"], yarn_beta_fast=case["beta_fast"],
            yarn_beta_slow=case["beta_slow"], mscale=case["mscale"], mscale_all_dim=case["mscale_all_dim"],
            yarn_correction_range_round_to_int=case["round"])
        torch.testing.assert_close(inverse_frequencies(config), torch.tensor(expected["inv_freq"]), rtol=1e-6, atol=0)
        assert yarn_concentration(config) == pytest.approx(expected["concentration"], rel=1e-12)
        assert yarn_softmax_correction(config) == pytest.approx(expected["softmax"], rel=1e-12)


def _yarn_config(**values):
    return derive(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, multi_latent_attention=True,
                                    position_embedding_type="rope", rope_type="yarn", **values))


def test_flags_and_their_default():
    """Megatron-LM's spellings; without --rope-type, YaRN when a factor is given (Megatron-LM's
    multi-latent attention default), plain RoPE otherwise (the same thing at factor 1)."""
    mla = MINIMAL + ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "16"]
    yarn = ["--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"]
    model = parse_args(mla + yarn + ["--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast", "16",
                                     "--yarn-beta-slow", "2", "--no-yarn-correction-range-round-to-int"]).model
    assert (model.rotary_scaling_factor, model.mscale, model.mscale_all_dim) == (40, 1.0, 1.0)
    assert (model.yarn_original_max_position_embeddings, model.yarn_beta_fast, model.yarn_beta_slow) == (4096, 16, 2)
    assert model.yarn_correction_range_round_to_int is False and model.rope_type is None
    assert derive(model).rope_type == "yarn"
    assert derive(parse_args(mla).model).rope_type == "rope"
    unused = derive(parse_args(mla + ["--rope-type", "rope", "--rotary-scaling-factor", "40"]).model)
    assert unused.rotary_scaling_factor == 1.0
    with pytest.raises(ValueError, match="--rope-type yarn, or drop --rotary-scaling-factor and --mscale-all-dim"):
        derive(parse_args(mla + ["--rope-type", "rope"] + yarn).model)


@pytest.mark.parametrize("changes,message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2 with topk_group=2"),
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1), "num_experts_per_tok=1 is not supported"),
    (dict(rope_scaling=dict(YARN, attention_factor=1.5)), "attention_factor is not supported"),
    (dict(rope_scaling=dict(YARN, mscale=0.0, mscale_all_dim=1.0)), "has no Megatron-Core equivalent"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_type 'linear' is not supported"),
])
def test_what_megatron_core_cannot_compute_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        hf_config_to_transformer_config(deepseek_config(**{**EXPERTS, "first_k_dense_replace": 1, **changes}))


def test_an_export_hugging_face_cannot_express_is_named():
    config = hf_config_to_transformer_config(deepseek_config(**{**EXPERTS, "first_k_dense_replace": 1}))
    with pytest.raises(ValueError, match="--moe-layer-freq 2 has no Hugging Face DeepSeek-V3 equivalent"):
        architecture_for_hf(dataclasses.replace(config, moe_layer_freq="2"))
    with pytest.raises(ValueError, match="--moe-shared-expert-intermediate-size 30 has no Hugging Face"):
        architecture_for_hf(dataclasses.replace(config, moe_shared_expert_intermediate_size=30))


@pytest.mark.parametrize("seq_length, rope_type", [("4096", "rope"), ("32768", "yarn")])
def test_the_example_extends_the_context_with_deepseek_v3s_yarn(seq_length, rope_type):
    env = {"MODEL_SIZE": "671B", "EP": "64", "PP": "16", "NPROC": "8", "NNODES": "128", "SEQ_LENGTH": seq_length}
    model = derive(parse_args(_script_args("deepseek_v3/train_deepseek_v3.sh", env)).model)
    assert model.rope_type == rope_type and model.max_position_embeddings == int(seq_length)
    if rope_type == "yarn":
        assert (model.rotary_scaling_factor, model.mscale, model.mscale_all_dim) == (40, 1.0, 1.0)
        assert (model.yarn_original_max_position_embeddings, model.yarn_beta_fast, model.yarn_beta_slow) == (
            4096, 32, 1)
