"""Falcon (`FalconForCausalLM`): attention and MLP in parallel (--parallel_attn), LayerNorm, GeLU,
rotary embeddings, no biases, tied embeddings.

Falcon-7B: one norm feeds both branches and attention is multi-query (`new_decoder_architecture`
false, `multi_query` true). Falcon-40B's new decoder architecture: grouped-query attention
(`num_kv_heads`) and, with `num_ln_in_parallel_attn` 2 (its default), a norm per branch
(`ln_attn`, `ln_mlp`: --parallel_layernorm). The fused `query_key_value` goes group by group (each
key/value group's query heads, then its key and its value head; with one group, as 7B's); ALiBi,
biases and the sequential layer (`parallel_attn` false) are other models, refused on import.
"""
from megatron.core.models.gpt.families.base import IN_WEIGHTS, TIED, Entry, Family, HFKey
from megatron.core.models.gpt.families.llama import FINAL_NORM, OUTPUT_LAYER
from megatron.core.models.gpt.model import WORD_EMBEDDINGS

_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # name: tanh approximation


def _tanh_gelu(name) -> bool:
    if name not in _ACTIVATIONS:
        raise ValueError(f"Falcon activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


KEYS = dict(
    num_layers="num_hidden_layers",
    hidden_size="hidden_size",
    num_attention_heads="num_attention_heads",
    ffn_hidden_size="ffn_hidden_size",
    group_query_attention=HFKey("num_kv_heads", to_hf=None, from_hf=lambda heads: heads is not None),
    num_query_groups="num_kv_heads",
    parallel_layernorm=HFKey("num_ln_in_parallel_attn", to_hf=lambda two: 2 if two else 1,
                             from_hf=lambda norms: norms == 2),
    max_position_embeddings="max_position_embeddings",
    rotary_base="rope_parameters.rope_theta",
    norm_epsilon="layer_norm_epsilon",
    apply_layernorm_1p=IN_WEIGHTS,
    openai_gelu=HFKey("activation", to_hf=lambda tanh: "gelu_pytorch_tanh" if tanh else "gelu", from_hf=_tanh_gelu),
    untie_embeddings_and_output_weights=TIED,
    make_vocab_size_divisible_by=IN_WEIGHTS,
    hidden_dropout="hidden_dropout",
    attention_dropout="attention_dropout",
    init_method_std="initializer_range",
)


def reader(read):
    """Falcon-7B's layout (multi-query, one norm) as the new architecture's entries: one key/value
    head and one norm; the new architecture's missing `num_ln_in_parallel_attn` is 2."""
    if read("new_decoder_architecture"):
        layout = dict(num_ln_in_parallel_attn=read("num_ln_in_parallel_attn") or 2)
    elif read("multi_query") is False:
        raise ValueError("Falcon with multi_query false and new_decoder_architecture false (per-head interleaved "
                         "query/key/value) is not supported: only Falcon-7B's and the new decoder architecture's "
                         "layouts are")
    else:
        layout = dict(num_kv_heads=1, num_ln_in_parallel_attn=1)
    return lambda key: layout[key] if key in layout else read(key)


def writer(entries: dict) -> dict:
    """Falcon-7B's layout when it fits (one key/value head, one norm), else the new architecture
    (which ignores `multi_query`: left true, as in Falcon-40B's config.json)."""
    seven_b = entries["num_kv_heads"] == 1 and entries["num_ln_in_parallel_attn"] == 1
    entries.update(new_decoder_architecture=not seven_b, multi_query=True)
    if seven_b:
        entries["num_ln_in_parallel_attn"] = None  # as Falcon-7B's config.json
    return entries


def weights(config) -> list:
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    entries = [Entry("transformer.word_embeddings.weight", WORD_EMBEDDINGS, vocab=True)]
    norms = (("ln_attn", "input_layernorm"), ("ln_mlp", "pre_mlp_layernorm")) if config.parallel_layernorm else \
        (("input_layernorm", "input_layernorm"),)
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}", f"decoder.layers.{i}"
        entries += [Entry(f"{hf}.{theirs}.{suffix}", f"{ours}.{mine}.{suffix}", norm=suffix == "weight")
                    for theirs, mine in norms for suffix in ("weight", "bias")]
        entries += [
            Entry(f"{hf}.self_attention.query_key_value.weight", f"{ours}.self_attention.linear_qkv.weight",
                  ("q", "k", "v"), (heads * d, groups * d, groups * d), qkv_groups=groups),
            Entry(f"{hf}.self_attention.dense.weight", f"{ours}.self_attention.linear_proj.weight"),
            Entry(f"{hf}.mlp.dense_h_to_4h.weight", f"{ours}.mlp.linear_fc1.weight"),
            Entry(f"{hf}.mlp.dense_4h_to_h.weight", f"{ours}.mlp.linear_fc2.weight"),
        ]
    entries += [Entry(f"transformer.ln_f.{suffix}", f"{FINAL_NORM}.{suffix}", norm=suffix == "weight")
                for suffix in ("weight", "bias")]
    if config.untie_embeddings_and_output_weights:
        entries.append(Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


FAMILIES = [Family("falcon", "Falcon", "FalconConfig", "FalconForCausalLM", KEYS,
                   dict(normalization="LayerNorm", swiglu=False, add_bias_linear=False, add_qkv_bias=False,
                        position_embedding_type="rope", parallel_attn=True, qk_layernorm=False),
                   weights, ("normalization", "position_embedding_type", "swiglu", "parallel_attn"),
                   extra=dict(alibi=False, bias=False, parallel_attn=True), context="with --parallel_attn ",
                   reader=reader, writer=writer)]
