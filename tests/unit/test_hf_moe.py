"""Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE (shared expert with its gate, q/k/v biases): tiny
models built in the test with `transformers`, written with save_pretrained (one tensor per expert,
as on the hub), read and mapped into GPTModel: the logits equal `transformers`' own; the mapping
back gives the same files' tensors and config; 5 training steps track transformers + AdamW."""
import dataclasses

import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.hf_mapping import (  # noqa: E402
    architecture_for_hf,
    architecture_of,
    hf_config_from_transformer_config,
    hf_config_to_transformer_config,
    hf_to_logical,
    load_logical_into_model,
    logical_to_hf,
    model_to_logical,
    padded_vocab_size,
)
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern  # noqa: E402
from megatron.core.checkpointing.conversion import read_hf  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402
from tests.hf_training import assert_training_tracks_transformers  # noqa: E402

VOCAB, BATCH, SEQ, TOLERANCE = 128, 2, 24, 1e-4  # 128: no padded rows in the training loss
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)


def mixtral():
    return transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **SHAPE)


def qwen3_moe(norm_topk_prob=True):
    return transformers.Qwen3MoeConfig(intermediate_size=80, moe_intermediate_size=32, num_experts=6,
                                       mlp_only_layers=[0], norm_topk_prob=norm_topk_prob, **SHAPE)


def qwen2_moe():
    return transformers.Qwen2MoeConfig(intermediate_size=80, moe_intermediate_size=32, num_experts=6,
                                       shared_expert_intermediate_size=40, mlp_only_layers=[1], **SHAPE)


CASES = {"mixtral": (mixtral, transformers.MixtralForCausalLM),
         "qwen2_moe": (qwen2_moe, transformers.Qwen2MoeForCausalLM),
         "qwen3_moe": (qwen3_moe, transformers.Qwen3MoeForCausalLM),
         "qwen3_moe unnormalized": (lambda: qwen3_moe(False), transformers.Qwen3MoeForCausalLM)}


def saved_pair(case, tmp_path):
    make_config, cls = CASES[case]
    hf = randomize(cls(make_config())).eval()
    hf.save_pretrained(tmp_path)
    hf_config, files = read_hf(str(tmp_path))
    config = hf_config_to_transformer_config(hf_config)
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(files, config, architecture_of(hf_config)))
    return hf, ours, hf_config, files


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_moe_logits_equal_transformers(case, tmp_path):
    hf, ours, _, _ = saved_pair(case, tmp_path)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf(input_ids=tokens).logits
    got = ours(tokens, torch.arange(SEQ).expand(BATCH, SEQ)).transpose(0, 1)[..., :VOCAB]
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_round_trip_gives_the_files_back(case, tmp_path):
    _, ours, hf_config, files = saved_pair(case, tmp_path)
    config = ours.config
    arch = architecture_for_hf(config)
    assert arch == hf_config.model_type
    back = logical_to_hf(model_to_logical(ours), config, arch, vocab_size=VOCAB)
    assert back.keys() == files.keys()
    for key, tensor in files.items():
        torch.testing.assert_close(back[key], tensor, rtol=0, atol=0, msg=key)
    exported = hf_config_from_transformer_config(config, VOCAB)
    again = hf_config_to_transformer_config(exported)
    assert again == config and padded_vocab_size(VOCAB) == config.padded_vocab_size


def test_qwen3_moe_layer_pattern_and_router_options():
    config = hf_config_to_transformer_config(qwen3_moe(False))
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_router_pre_softmax and config.qk_layernorm
    assert config.num_experts == 6 and config.moe_ffn_hidden_size == 32 and config.ffn_hidden_size == 80
    model = GPTModel(config, parallel_state.single_process())
    assert [layer.is_moe for layer in model.decoder.layers] == [False, True, True]


def test_moe_without_hf_equivalent_is_refused():
    config = hf_config_to_transformer_config(mixtral())
    for change in (dict(moe_router_score_function="sigmoid"), dict(moe_shared_expert_intermediate_size=32),
                   dict(moe_layer_freq=[0, 1, 1])):
        with pytest.raises(ValueError, match="Hugging Face equivalent|Mixtral has every layer"):
            architecture_for_hf(config.__class__(**{**config.__dict__, **change}))


def test_converted_checkpoint_keys_experts_by_global_index(tmp_path):
    from megatron.core.checkpointing.storage import saved_shapes
    from megatron.core.checkpointing.conversion import read_weights, write_weights

    _, ours, _, _ = saved_pair("qwen3_moe", tmp_path / "hf")
    logical = model_to_logical(ours)
    directory = write_weights(str(tmp_path / "ours"), logical, ours.config, VOCAB)
    keys = saved_shapes(directory)
    assert "model/decoder.layers.1.mlp.experts.5.fc1_weight/up" in keys
    assert not any(key.endswith("experts.fc1_weight/up") for key in keys)
    back, config, vocab, _ = read_weights(str(tmp_path / "ours"))
    assert moe_layer_pattern(config.moe_layer_freq, 3) == moe_layer_pattern(ours.config.moe_layer_freq, 3) == [0, 1, 1]
    assert dataclasses.replace(config, moe_layer_freq=[0, 1, 1]) == ours.config
    assert vocab == VOCAB and back.keys() == logical.keys()
    for name, parts in logical.items():
        for part, tensor in parts.items():
            torch.testing.assert_close(back[name][part], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_five_training_steps_track_transformers_and_adamw(case, tmp_path):
    """The same 5 AdamW steps (lr 1e-3, no weight decay, no clipping, no auxiliary loss) on the same
    batch: our model with our optimizer against `transformers` with torch.optim.AdamW."""
    hf, ours, _, _ = saved_pair(case, tmp_path)
    assert_training_tracks_transformers(hf, ours, VOCAB, BATCH, SEQ)
