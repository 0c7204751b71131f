"""--qk-layernorm, --apply-layernorm-1p and --rotary-interleaved against `transformers` on the same
weights (Qwen3 for query/key norms; Llama and GPT-2 for the others, through the weight transforms of
hf_mapping), and the refusals where Hugging Face has no equivalent. fp32, no dropout."""
import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.core import parallel_state  # noqa: E402
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
from megatron.core.transformer.fusions import rotary, rotary_interleaved  # noqa: E402
from tests.unit.test_hf_parity import (  # noqa: E402
    TOLERANCE,
    assert_logits_match,
    gpt2_config,
    inputs,
    llama_config,
    randomize,
)

Qwen3ForCausalLM = transformers.Qwen3ForCausalLM


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen3_config(**overrides):
    values = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  attention_dropout=0.0, use_sliding_window=False, attn_implementation="eager",
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    values.update(overrides)
    return transformers.Qwen3Config(**values)


def ours_from_hf(hf, config, arch):
    model = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(model, hf_to_logical(hf.state_dict(), config, arch))
    return model


def test_qk_layernorm_is_qwen3():
    hf = randomize(Qwen3ForCausalLM(qwen3_config())).eval()
    config = hf_config_to_transformer_config(hf.config)
    assert config.qk_layernorm and architecture_for_hf(config) == "qwen3"
    ours = ours_from_hf(hf, config, "qwen3")
    assert_logits_match(hf, ours, 1000)

    # The norms matter: the same weights without them give other logits.
    plain = GPTModel(dataclasses.replace(config, qk_layernorm=False), parallel_state.single_process()).eval()
    load_logical_into_model(plain, {k: v for k, v in model_to_logical(ours).items() if "_layernorm" not in k
                                    or "self_attention" not in k})
    tokens, positions = inputs(1000)
    with torch.no_grad():
        difference = plain(tokens, positions) - ours(tokens, positions)
    assert difference.abs().max() > 100 * TOLERANCE

    exported = hf_config_from_transformer_config(config, 1000)
    assert isinstance(exported, transformers.Qwen3Config) and not exported.use_sliding_window
    back = logical_to_hf(model_to_logical(ours), config, "qwen3", vocab_size=1000)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("interleaved, zero_centered", [(True, False), (False, True), (True, True)],
                         ids=["interleaved", "layernorm-1p", "both"])
def test_llama_with_interleaved_rope_and_layernorm_1p(interleaved, zero_centered):
    """A model holding its weights in the interleaved layout / as (scale - 1) computes exactly what
    the Hugging Face Llama computes with the converted weights, and converts back bit for bit."""
    hf = randomize(transformers.LlamaForCausalLM(llama_config(num_key_value_heads=2))).eval()
    config = dataclasses.replace(hf_config_to_transformer_config(hf.config), rotary_interleaved=interleaved,
                                 apply_layernorm_1p=zero_centered)
    logical = hf_to_logical(hf.state_dict(), config, "llama")
    plain_logical = hf_to_logical(hf.state_dict(), hf_config_to_transformer_config(hf.config), "llama")
    q = "decoder.layers.0.self_attention.linear_qkv.weight"
    norm = "decoder.layers.0.input_layernorm.weight"
    assert torch.equal(logical[q]["q"], plain_logical[q]["q"]) is not interleaved
    assert torch.equal(logical[norm][""], plain_logical[norm][""]) is not zero_centered
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, logical)
    assert_logits_match(hf, ours, 1000)
    back = logical_to_hf(model_to_logical(ours), config, "llama", vocab_size=1000)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back[key], tensor), key


def test_gpt2_with_layernorm_1p():
    hf = randomize(transformers.GPT2LMHeadModel(gpt2_config())).eval()
    config = dataclasses.replace(hf_config_to_transformer_config(hf.config), apply_layernorm_1p=True)
    ours = ours_from_hf(hf, config, "gpt2")
    assert_logits_match(hf, ours, 1000, seq=64)


def test_interleaved_rotation_pairs_neighbouring_channels():
    """Channel 0 turns into channel 1 with --rotary-interleaved, into channel d/2 = 2 without."""
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    angle = torch.tensor([0.5, 0.0])  # frequency 0 turns by 0.5 rad, frequency 1 not at all
    c, s = math.cos(0.5), math.sin(0.5)
    paired = angle.repeat_interleave(2)
    torch.testing.assert_close(rotary_interleaved(x, paired.cos(), paired.sin()).flatten(), torch.tensor([c, s, 0.0, 0.0]))
    halves = torch.cat((angle, angle))
    torch.testing.assert_close(rotary(x, halves.cos(), halves.sin()).flatten(), torch.tensor([c, 0.0, s, 0.0]))


def test_new_norms_start_as_the_identity_scale():
    config = dataclasses.replace(hf_config_to_transformer_config(qwen3_config()), apply_layernorm_1p=True)
    model = GPTModel(config, parallel_state.single_process())
    model.initialize_parameters(1234)
    norms = {n: p for n, p in model.named_parameters() if "layernorm" in n}
    assert any("q_layernorm" in n for n in norms) and all(torch.all(p == 0) for p in norms.values())


@pytest.mark.parametrize("change, message", [
    (dict(qk_layernorm=True), "--qk-layernorm with LayerNorm has no Hugging Face GPT-2 equivalent"),
])
def test_gpt2_without_hf_equivalent_is_refused(change, message):
    config = dataclasses.replace(hf_config_to_transformer_config(gpt2_config()), **change)
    with pytest.raises(ValueError, match=message):
        architecture_for_hf(config)


def test_partial_rotary_is_refused():
    config = dataclasses.replace(hf_config_to_transformer_config(llama_config()), rotary_percent=0.5)
    with pytest.raises(ValueError, match="--rotary-percent 0.5 has no Hugging Face Llama equivalent"):
        architecture_for_hf(config)


@pytest.mark.parametrize("flag, field", [("--qk-layernorm", "qk_layernorm"),
                                         ("--apply-layernorm-1p", "apply_layernorm_1p"),
                                         ("--rotary-interleaved", "rotary_interleaved")])
def test_checkpoint_of_another_layout_is_refused(flag, field):
    from megatron.training.checkpointing import architecture, check_architecture
    from megatron.training.validation import ConfigError

    config = hf_config_to_transformer_config(llama_config())
    saved = architecture(dataclasses.replace(config, **{field: True}), 1000)
    with pytest.raises(ConfigError, match=f"it has {field} = True \\({flag}\\), this run has False"):
        check_architecture("ckpt", saved, architecture(config, 1000))


@pytest.mark.parametrize("hidden, swiglu, expected", [(4096, True, 10880), (64, True, 128), (64, False, 256)])
def test_default_ffn_hidden_size_is_megatrons(hidden, swiglu, expected):
    from megatron.training.arguments import parse_args
    from megatron.training.builders import transformer_config

    args = ["--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--micro-batch-size", "1",
            "--seq-length", "8", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]
    config = parse_args(args + (["--swiglu"] if swiglu else []))
    assert transformer_config(config, 64).ffn_hidden_size == expected
