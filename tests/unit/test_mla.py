"""Multi-latent attention (--multi-latent-attention) against `transformers`' DeepseekV3ForCausalLM
on tiny all-dense models built here (fp32, random weights): equal logits (1e-4) with and without
the query latent and in both rotary channel orders, the round trip gives the tensors and config
back, 5 training steps track transformers + torch AdamW. (YaRN and the mixture-of-experts layers:
tests/unit/test_deepseek_v3.py.)"""
import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

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
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.validation import ConfigError, validate  # noqa: E402
from tests.unit.test_arguments import MINIMAL  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402
from tests.hf_training import assert_training_tracks_transformers  # noqa: E402

DeepseekV3ForCausalLM = transformers.DeepseekV3ForCausalLM
VOCAB, BATCH, SEQ, TOLERANCE = 128, 2, 24, 1e-4
CASES = {"q-latent": dict(q_lora_rank=24), "no-q-latent": dict(q_lora_rank=None),
         "rotate-half": dict(q_lora_rank=24, rope_interleave=False)}


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deepseek_config(**overrides):
    """All layers dense (first_k_dense_replace = the layer count); distinct sizes for every part so
    that a mix-up cannot pass."""
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=12, first_k_dense_replace=2, max_position_embeddings=64, tie_word_embeddings=False,
                  attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  num_nextn_predict_layers=0)  # transformers' model holds no multi-token prediction weights
    return transformers.DeepseekV3Config(**{**values, **overrides})


def pair(case):
    hf = randomize(DeepseekV3ForCausalLM(deepseek_config(**CASES[case]))).eval()
    config = hf_config_to_transformer_config(hf.config)
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(hf.state_dict(), config, "deepseek_v3"))
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_mla_logits_equal_transformers(case):
    hf, ours = pair(case)
    config = ours.config
    assert config.multi_latent_attention and config.q_lora_rank == CASES[case]["q_lora_rank"]
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 16, 8, 12)
    assert config.rotary_interleaved == CASES[case].get("rope_interleave", True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf(input_ids=tokens).logits
    got = ours(tokens, torch.arange(SEQ).expand(BATCH, SEQ)).transpose(0, 1)[..., :VOCAB]
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_mla_round_trip_gives_the_tensors_back(case):
    hf, ours = pair(case)
    config = ours.config
    assert architecture_for_hf(config) == "deepseek_v3"
    back = logical_to_hf(model_to_logical(ours), config, "deepseek_v3", vocab_size=VOCAB)
    original = hf.state_dict()
    assert sorted(back) == sorted(original)
    for key, tensor in back.items():
        assert torch.equal(tensor, original[key]), key
    exported = hf_config_from_transformer_config(config, VOCAB)
    assert exported.first_k_dense_replace == 2 and exported.num_key_value_heads == 4
    assert hf_config_to_transformer_config(exported) == config


def test_five_training_steps_track_transformers_and_adamw():
    hf, ours = pair("q-latent")
    assert_training_tracks_transformers(hf, ours, VOCAB, BATCH, SEQ)


def test_flags_and_the_pai_spellings():
    flags = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--v-head-dim", "12",
             "--position-embedding-type", "rope"]
    model = parse_args(MINIMAL + flags + ["--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8"]).model
    assert (model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim) == (24, 16, 16, 8)
    pai = parse_args(MINIMAL + flags + ["--qk-nope-head-dim", "16", "--qk-rope-head-dim", "8"]).model
    assert (pai.qk_head_dim, pai.qk_pos_emb_head_dim) == (16, 8)


def test_context_parallel_a2a_counts_a_key_and_value_per_head():
    """a2a splits the heads over the context-parallel ranks: multi-latent attention has a key and a
    value per head, so --num-query-groups does not limit it; its heads do."""
    flags = MINIMAL + ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--position-embedding-type", "rope",
                       "--attention-dropout", "0", "--context-parallel-size", "4", "--cp-comm-type", "a2a"]
    validate(parse_args(flags + ["--group-query-attention", "--num-query-groups", "2"]), 4)
    with pytest.raises(ConfigError, match=r"query heads per tensor-parallel rank \(2"):
        validate(parse_args(flags + ["--tensor-model-parallel-size", "2"]), 8)
