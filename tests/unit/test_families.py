"""A model family is one file: the registry is the list of the modules of
megatron/core/models/gpt/families, and a family added as a new module (here Qwen2, written to a
temporary directory put on the package's path) converts both ways, through hf_mapping and
tools/checkpoint/convert.py, with logits equal to `transformers`' (fp32, 1e-4)."""
import dataclasses
import importlib
import sys
import textwrap

import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel, families  # noqa: E402
from megatron.core.models.gpt.hf_mapping import (  # noqa: E402
    architecture_for_hf,
    architecture_of,
    hf_config_from_transformer_config,
    hf_config_to_transformer_config,
    hf_to_logical,
    load_logical_into_model,
    logical_to_hf,
    model_to_logical,
)
from tests.unit.test_hf_parity import assert_logits_match, randomize  # noqa: E402

Qwen2ForCausalLM = transformers.Qwen2ForCausalLM
TOY = "toy_qwen2"
# The whole of a new family: Llama's tensors and keys, with q/k/v biases and without head_dim
# (Qwen2's attention takes hidden_size / num_attention_heads).
TOY_MODULE = textwrap.dedent('''\
    """Qwen2 (`Qwen2ForCausalLM`): Llama with q/k/v biases."""
    from megatron.core.models.gpt.families import llama
    from megatron.core.models.gpt.families.base import Family

    KEYS = {field: key for field, key in llama.KEYS.items() if field != "kv_channels"}
    FAMILIES = [Family("qwen2", "Qwen2", "Qwen2Config", "Qwen2ForCausalLM", KEYS,
                       dict(llama.SHAPE, qk_layernorm=False, add_qkv_bias=True), llama.weights,
                       llama.SELECTS + ("add_qkv_bias",),
                       extra=dict(hidden_act="silu", use_sliding_window=False))]
    ''')


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The package's path with one more directory holding the toy family's module."""
    (tmp_path / f"{TOY}.py").write_text(TOY_MODULE)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    yield
    sys.modules.pop(f"{families.__name__}.{TOY}", None)
    importlib.invalidate_caches()


def qwen2_config(vocab_size=1000):
    return transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_dropout=0.0,
        attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_the_registry_is_the_list_of_the_family_modules():
    names = [family.name for family in families.registry()]
    assert names == ["deepseek_v3", "falcon", "gpt2", "llama", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe"]
    assert len({family.architecture for family in families.registry()}) == len(names)


def test_an_unclaimed_architecture_is_one_error_listing_the_families():
    config = qwen2_config()
    config.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="no family claims it") as error:
        hf_config_to_transformer_config(config)
    for family in families.registry():
        assert f"{family.architecture} ({family.name})" in str(error.value)
    # The architectures entry decides over model_type (a Llama class over a Llama-typed config).
    llama = transformers.LlamaConfig(architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="no family claims it"):
        architecture_of(llama)


def test_without_the_module_a_qwen2_shape_is_refused_naming_its_setting():
    llama = transformers.LlamaConfig(**{key: value for key, value in qwen2_config().to_dict().items()
                                        if key not in ("model_type", "architectures")})
    config = dataclasses.replace(hf_config_to_transformer_config(llama), add_qkv_bias=True)
    with pytest.raises(ValueError, match="--add-qkv-bias has no Hugging Face Llama equivalent"):
        architecture_for_hf(config)


@pytest.mark.usefixtures("toy_family")
def test_a_family_added_as_one_module_converts_both_ways():
    hf = randomize(Qwen2ForCausalLM(qwen2_config())).eval()
    assert architecture_of(hf.config) == "qwen2"
    config = hf_config_to_transformer_config(hf.config)
    assert config.add_qkv_bias and config.num_query_groups == 2
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(hf.state_dict(), config, "qwen2"))
    assert_logits_match(hf, ours, 1000)

    assert architecture_for_hf(config) == "qwen2"
    back = logical_to_hf(model_to_logical(ours), config, "qwen2", vocab_size=1000)
    original = hf.state_dict()
    assert sorted(back) == sorted(original)
    for key, tensor in back.items():
        assert torch.equal(tensor, original[key]), key
    exported = hf_config_from_transformer_config(config, 1000)
    assert type(exported) is transformers.Qwen2Config and exported.architectures == ["Qwen2ForCausalLM"]
    again = Qwen2ForCausalLM(exported)
    again.load_state_dict(back, strict=True)
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the exported config runs another attention kernel: equal up to rounding
        torch.testing.assert_close(again.eval()(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.usefixtures("toy_family")
def test_the_added_family_converts_through_the_tool(tmp_path):
    from tests.unit.test_checkpoint_convert import convert

    hf = randomize(Qwen2ForCausalLM(qwen2_config()))
    hf.save_pretrained(tmp_path / "hf")
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(tmp_path / "ours")])
    convert.convert(["--source-format", "torch_dist", "--source", str(tmp_path / "ours"), "--target-format", "hf",
                     "--target", str(tmp_path / "back")])
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, hf.state_dict()[key]), key


@pytest.mark.usefixtures("toy_family")
def test_the_added_family_is_planned_as_built():
    """The planner counts the toy family's parameters and FLOPs on its built model: no planner edit."""
    from megatron.training.planning.architecture import architecture, flops_per_iteration, total_parameters
    from megatron.training.reporting.logging import flops_per_iteration as logged

    config = hf_config_to_transformer_config(Qwen2ForCausalLM(qwen2_config()).config)
    built = GPTModel(config, parallel_state.single_process(), device=torch.device("meta"))
    assert total_parameters(architecture(config)) == sum(p.numel() for p in built.parameters())
    h, f, q, kv, layers, vocab, s = 64, 96, 64, 32, 2, config.padded_vocab_size, 16
    per_token = layers * (2 * (h * (q + 2 * kv) + q * h) + 2 * s * q + 2 * 3 * h * f) + 2 * h * vocab  # causal: s/2 keys
    assert flops_per_iteration(architecture(config), 2, s) == 3 * 2 * s * per_token == logged(config, 2, s)
