"""GPT-2 (`GPT2LMHeadModel`): LayerNorm, GeLU, learned absolute positions, biases, multi-head
attention. Its `Conv1D` weights are [in, out], the transpose of `nn.Linear`'s, and its fused
`c_attn` is [q; k; v] along the output features."""
from megatron.core.models.gpt.families.base import IN_WEIGHTS, TIED, Entry, Family, HFKey
from megatron.core.models.gpt.families.llama import FINAL_NORM, OUTPUT_LAYER
from megatron.core.models.gpt.model import WORD_EMBEDDINGS

POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # name: tanh approximation


def _tanh_gelu(name) -> bool:
    if name not in _ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


KEYS = dict(
    num_layers="n_layer",
    hidden_size="n_embd",
    num_attention_heads="n_head",
    ffn_hidden_size="n_inner",
    max_position_embeddings="n_positions",
    norm_epsilon="layer_norm_epsilon",
    apply_layernorm_1p=IN_WEIGHTS,
    openai_gelu=HFKey("activation_function", to_hf=lambda tanh: "gelu_new" if tanh else "gelu", from_hf=_tanh_gelu),
    untie_embeddings_and_output_weights=TIED,
    make_vocab_size_divisible_by=IN_WEIGHTS,
    hidden_dropout="resid_pdrop",
    attention_dropout="attn_pdrop",
    init_method_std="initializer_range",
)


def weights(config) -> list:
    h = config.hidden_size
    entries = [Entry("transformer.wte.weight", WORD_EMBEDDINGS, vocab=True),
               Entry("transformer.wpe.weight", POSITION_EMBEDDINGS)]
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}", f"decoder.layers.{i}"
        attention, mlp = f"{ours}.self_attention", f"{ours}.mlp"
        for suffix in ("weight", "bias"):
            conv1d = suffix == "weight"
            entries += [
                Entry(f"{hf}.ln_1.{suffix}", f"{ours}.input_layernorm.{suffix}", norm=suffix == "weight"),
                Entry(f"{hf}.attn.c_attn.{suffix}", f"{attention}.linear_qkv.{suffix}", ("q", "k", "v"), (h, h, h),
                      conv1d=conv1d),
                Entry(f"{hf}.attn.c_proj.{suffix}", f"{attention}.linear_proj.{suffix}", conv1d=conv1d),
                Entry(f"{hf}.ln_2.{suffix}", f"{ours}.pre_mlp_layernorm.{suffix}", norm=suffix == "weight"),
                Entry(f"{hf}.mlp.c_fc.{suffix}", f"{mlp}.linear_fc1.{suffix}", conv1d=conv1d),
                Entry(f"{hf}.mlp.c_proj.{suffix}", f"{mlp}.linear_fc2.{suffix}", conv1d=conv1d),
            ]
    entries += [Entry(f"transformer.ln_f.{suffix}", f"{FINAL_NORM}.{suffix}", norm=suffix == "weight")
                for suffix in ("weight", "bias")]
    if config.untie_embeddings_and_output_weights:
        entries.append(Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def _causal_mask_buffer(key: str, config) -> bool:
    """Older transformers versions keep the causal mask as a buffer in the state dict."""
    return key.endswith(".attn.bias") or key.endswith(".attn.masked_bias")


def _prefixed(key: str) -> str:
    """Original GPT-2 checkpoints name the base model's tensors without the `transformer.` prefix."""
    return key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"


FAMILIES = [Family("gpt2", "GPT-2", "GPT2Config", "GPT2LMHeadModel", KEYS,
                   dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                        position_embedding_type="learned_absolute"), weights,
                   extra=dict(scale_attn_by_inverse_layer_idx=False, scale_attn_weights=True),
                   copies=dict(embd_pdrop="hidden_dropout"), context="with LayerNorm ",
                   ignored=_causal_mask_buffer, normalize_key=_prefixed)]
