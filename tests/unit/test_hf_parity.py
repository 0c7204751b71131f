"""GPTModel against `transformers` on the same weights: Llama 2, Llama 3 (GQA), Llama 3.1 (rope
scaling) and GPT-2. Tiny configs built here (no downloads), random weights, fp32, no dropout."""
import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.hf_mapping import (  # noqa: E402
    hf_config_to_transformer_config,
    hf_to_logical,
    load_logical_into_model,
    logical_to_hf,
    model_to_logical,
    padded_vocab_size,
)
from megatron.core.parallel_state import ParallelGroups  # noqa: E402

# Resolved at import: transformers imports model code lazily, and the first access costs seconds.
LlamaForCausalLM, GPT2LMHeadModel = transformers.LlamaForCausalLM, transformers.GPT2LMHeadModel
TOLERANCE = 1e-4
BATCH, SEQ = 2, 48


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def llama_config(*, vocab_size=1000, num_key_value_heads=4, tie=False, rope_theta=10000.0,
                 rope_scaling=None, head_dim=None):
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, **rope_scaling}
    extra = {"head_dim": head_dim} if head_dim is not None else {}
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_key_value_heads, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_parameters=rope, attention_dropout=0.0,
        attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


def gpt2_config(*, vocab_size=1000):
    return transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager", bos_token_id=None, eos_token_id=None)


@torch.no_grad()
def randomize(hf_model, seed=0):
    """Weights of a size that makes logits O(1): HF's own init (std 0.02, norms at one) would give
    logits so small that a 1e-4 tolerance could not tell a correct mapping from a wrong one."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in hf_model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name or ".ln_" in name:
            param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
        elif "embed" in name or ".wte." in name or ".wpe." in name:
            param.copy_(noise)
        elif param.ndim == 1:
            param.copy_(0.1 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5 if param.shape[-1] > 1 else noise)
    return hf_model


def build_pair(hf_config, arch):
    cls = LlamaForCausalLM if arch == "llama" else GPT2LMHeadModel
    hf = randomize(cls(hf_config)).eval()
    config = hf_config_to_transformer_config(hf_config)
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(hf.state_dict(), config, arch))
    return hf, ours


def inputs(vocab_size, seq=SEQ, seed=1):
    tokens = torch.randint(0, vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq).expand(BATCH, seq)
    return tokens, positions


@torch.no_grad()
def assert_logits_match(hf, ours, vocab_size, seq=SEQ):
    tokens, positions = inputs(vocab_size, seq)
    expected = hf(input_ids=tokens).logits  # [b, s, V]
    logits = ours(tokens, positions)  # [s, b, V_padded]
    assert logits.shape == (seq, BATCH, padded_vocab_size(vocab_size))
    got = logits.transpose(0, 1)[..., :vocab_size]
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    return got


@torch.no_grad()
def assert_loss_matches(hf, ours, vocab_size):
    """HF shifts internally: logits at t predict token t+1, mean over the b*(s-1) predicted tokens."""
    tokens, positions = inputs(vocab_size, seed=2)
    expected = hf(input_ids=tokens, labels=tokens).loss
    labels = torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)
    per_token = ours(tokens, positions, labels=labels)  # [b, s]
    assert per_token.shape == (BATCH, SEQ)
    torch.testing.assert_close(per_token[:, :-1].mean(), expected, atol=TOLERANCE, rtol=0)


# ------------------------------------------------------------------------------------------------
def test_llama2_mha_untied_logits():
    hf, ours = build_pair(llama_config(), "llama")
    assert ours.config.padded_vocab_size == 1024 and ours.config.untie_embeddings_and_output_weights
    assert_logits_match(hf, ours, 1000)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama3_gqa_logits(tie):
    hf_config = llama_config(num_key_value_heads=2, tie=tie, rope_theta=500000.0)
    hf, ours = build_pair(hf_config, "llama")
    assert ours.config.num_query_groups == 2
    assert ours.config.untie_embeddings_and_output_weights is not tie
    assert hasattr(ours, "output_layer") is not tie
    assert_logits_match(hf, ours, 1000)


def test_llama_head_dim_differs_from_hidden_over_heads():
    hf_config = llama_config(num_key_value_heads=2, head_dim=24)
    hf, ours = build_pair(hf_config, "llama")
    assert ours.config.kv_channels == 24
    assert_logits_match(hf, ours, 1000)


def test_llama31_rope_scaling_logits_and_scaling_matters():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf_config = llama_config(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    hf, ours = build_pair(hf_config, "llama")
    config = ours.config
    assert config.use_rope_scaling and config.rope_original_max_position_embeddings == 16
    scaled = assert_logits_match(hf, ours, 1000)

    # The same weights without scaling must give clearly different logits, or this test proves nothing.
    unscaled_config = hf_config_to_transformer_config(llama_config(num_key_value_heads=2, rope_theta=500000.0))
    assert not unscaled_config.use_rope_scaling
    unscaled = GPTModel(unscaled_config, parallel_state.single_process()).eval()
    load_logical_into_model(unscaled, model_to_logical(ours))
    tokens, positions = inputs(1000)
    with torch.no_grad():
        plain = unscaled(tokens, positions).transpose(0, 1)[..., :1000]
    assert (plain - scaled).abs().max() > 100 * TOLERANCE


def test_gpt2_logits():
    hf, ours = build_pair(gpt2_config(), "gpt2")
    assert ours.config.position_embedding_type == "learned_absolute"
    assert not ours.config.untie_embeddings_and_output_weights
    assert_logits_match(hf, ours, 1000, seq=64)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_matches_hf(arch):
    # An unpadded vocabulary: padded entries take part in GPTModel's softmax (as in Megatron) but
    # do not exist in HF's.
    hf_config = llama_config(vocab_size=256, num_key_value_heads=2) if arch == "llama" else gpt2_config(vocab_size=256)
    hf, ours = build_pair(hf_config, arch)
    assert ours.config.padded_vocab_size == 256
    assert_loss_matches(hf, ours, 256)


# ------------------------------------------------------------------------------------------------
ROUND_TRIP_CASES = {
    "llama_untied": (lambda: llama_config(), "llama"),
    "llama_tied_gqa": (lambda: llama_config(num_key_value_heads=2, tie=True), "llama"),
    "gpt2": (lambda: gpt2_config(), "gpt2"),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIP_CASES))
def test_round_trip_hf_logical_hf_exact(case):
    make_config, arch = ROUND_TRIP_CASES[case]
    hf_config = make_config()
    cls = LlamaForCausalLM if arch == "llama" else GPT2LMHeadModel
    hf_state = randomize(cls(hf_config)).state_dict()
    if hf_config.tie_word_embeddings:
        del hf_state["lm_head.weight"]  # as save_pretrained writes it
    config = hf_config_to_transformer_config(hf_config)

    logical = hf_to_logical(hf_state, config, arch)
    embedding = logical["embedding.word_embeddings.weight"][""]
    assert embedding.shape[0] == 1024 and torch.all(embedding[1000:] == 0)

    back = logical_to_hf(logical, config, arch, vocab_size=hf_config.vocab_size)
    assert sorted(back) == sorted(hf_state)
    for key, tensor in hf_state.items():
        assert torch.equal(back[key], tensor), key

    # Through the model too: load, read back, convert.
    model = GPTModel(config, parallel_state.single_process())
    load_logical_into_model(model, logical)
    again = logical_to_hf(model_to_logical(model), config, arch, vocab_size=hf_config.vocab_size)
    for key, tensor in hf_state.items():
        assert torch.equal(again[key], tensor), key


def test_round_trip_loads_into_hf_model():
    """HF's own loader accepts what logical_to_hf writes (tied head left to HF to tie)."""
    hf_config = llama_config(num_key_value_heads=2, tie=True)
    source = randomize(LlamaForCausalLM(hf_config))
    config = hf_config_to_transformer_config(hf_config)
    state = logical_to_hf(hf_to_logical(source.state_dict(), config, "llama"), config, "llama",
                          vocab_size=hf_config.vocab_size)
    target = LlamaForCausalLM(hf_config)
    result = target.load_state_dict(state, strict=False)
    assert list(result.missing_keys) in ([], ["lm_head.weight"]) and not result.unexpected_keys
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)


def test_load_into_tensor_parallel_rank_slices_heads():
    """With TP=2 and 2 KV groups, rank r's fused qkv holds query heads [2r, 2r+1], KV group r."""
    hf_config = llama_config(num_key_value_heads=2)
    hf_state = randomize(LlamaForCausalLM(hf_config)).state_dict()
    config = hf_config_to_transformer_config(hf_config, tp_size=2)
    logical = hf_to_logical(hf_state, config, "llama")
    head_dim = config.kv_channels
    for rank in range(2):
        # No collectives are issued by construction or loading, so a TP rank can be built alone.
        model = GPTModel(config, ParallelGroups(tp_size=2, tp_rank=rank))
        load_logical_into_model(model, logical)
        qkv = model.decoder.layers[1].self_attention.linear_qkv.weight
        rows = 2 * head_dim
        q = hf_state["model.layers.1.self_attn.q_proj.weight"][rank * rows:(rank + 1) * rows]
        k = hf_state["model.layers.1.self_attn.k_proj.weight"][rank * head_dim:(rank + 1) * head_dim]
        v = hf_state["model.layers.1.self_attn.v_proj.weight"][rank * head_dim:(rank + 1) * head_dim]
        assert torch.equal(qkv, torch.cat((q, k, v)))
        vocab_rows = config.padded_vocab_size // 2
        embedding = model.embedding.word_embeddings.weight
        assert torch.equal(embedding, logical["embedding.word_embeddings.weight"][""][rank * vocab_rows:][:vocab_rows])


def test_load_into_last_pipeline_stage_with_tied_head():
    hf_config = llama_config(num_key_value_heads=2, tie=True)
    hf_state = randomize(LlamaForCausalLM(hf_config)).state_dict()
    config = hf_config_to_transformer_config(hf_config)
    stage = GPTModel(config, parallel_state.single_process(), pre_process=False, layer_numbers=[1])
    load_logical_into_model(stage, hf_to_logical(hf_state, config, "llama"))
    assert torch.equal(stage.output_layer[:1000], hf_state["model.embed_tokens.weight"])
    assert torch.equal(stage.output_layer[1000:], torch.zeros(24, 64))
    assert torch.equal(stage.decoder.layers[0].mlp.linear_fc2.weight, hf_state["model.layers.1.mlp.down_proj.weight"])


def test_config_mapping_and_vocab_padding():
    assert padded_vocab_size(1000) == 1024
    assert padded_vocab_size(1024) == 1024
    assert padded_vocab_size(1025, 128, tp_size=2) == 1280
    assert padded_vocab_size(50257, 128, tp_size=8) == 51200
    config = hf_config_to_transformer_config(llama_config(num_key_value_heads=2), make_vocab_size_divisible_by=64,
                                             tp_size=4)
    assert config.padded_vocab_size == 1024
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (2, 64, 96)
    assert config.normalization == "RMSNorm" and config.swiglu and config.activation == "silu"
    assert not config.add_bias_linear and config.position_embedding_type == "rope"
    gpt2 = hf_config_to_transformer_config(gpt2_config())
    assert gpt2.activation == "gelu_tanh" and gpt2.add_bias_linear and gpt2.ffn_hidden_size == 256
    assert gpt2.max_position_embeddings == 64 and gpt2.normalization == "LayerNorm"


def test_unsupported_configs_raise():
    with pytest.raises(ValueError, match="model_type"):
        hf_config_to_transformer_config(transformers.MistralConfig())
    with pytest.raises(ValueError, match="--num-attention-heads by --tensor-model-parallel-size"):
        hf_config_to_transformer_config(llama_config(num_key_value_heads=2), tp_size=8)
    with pytest.raises(ValueError, match="rope_type"):
        hf_config_to_transformer_config(transformers.LlamaConfig(
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))


def test_missing_and_unexpected_keys_raise():
    hf_config = gpt2_config()
    state = randomize(GPT2LMHeadModel(hf_config)).state_dict()
    config = hf_config_to_transformer_config(hf_config)
    broken = dict(state)
    del broken["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match="c_fc.bias"):
        hf_to_logical(broken, config, "gpt2")
    broken = dict(state, **{"transformer.h.2.ln_1.weight": state["transformer.h.1.ln_1.weight"]})
    with pytest.raises(KeyError, match="h.2.ln_1"):
        hf_to_logical(broken, config, "gpt2")
