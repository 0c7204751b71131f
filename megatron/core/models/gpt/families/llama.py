"""Llama (`LlamaForCausalLM`): RMSNorm, SwiGLU, rotary embeddings, no biases, grouped-query
attention. Its config keys and weight names are also the base of Qwen3, Mixtral and the Qwen-MoE
families, which import them from here."""
from megatron.core.models.gpt.families.base import IN_WEIGHTS, TIED, Entry, Family, HFKey
from megatron.core.models.gpt.model import WORD_EMBEDDINGS

FINAL_NORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer.weight"


def _rope_type(rope_type) -> bool:
    if rope_type not in (None, "default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    return rope_type == "llama3"


KEYS = dict(
    num_layers="num_hidden_layers",
    hidden_size="hidden_size",
    num_attention_heads="num_attention_heads",
    ffn_hidden_size="intermediate_size",
    kv_channels="head_dim",
    group_query_attention=HFKey("num_key_value_heads", to_hf=None, from_hf=lambda heads: heads is not None),
    num_query_groups="num_key_value_heads",
    max_position_embeddings="max_position_embeddings",
    rotary_base="rope_parameters.rope_theta",
    rotary_interleaved=IN_WEIGHTS,
    use_rope_scaling=HFKey("rope_parameters.rope_type", to_hf=lambda scaled: "llama3" if scaled else "default",
                           from_hf=_rope_type),
    rope_scaling_factor="rope_parameters.factor",
    rope_low_freq_factor="rope_parameters.low_freq_factor",
    rope_high_freq_factor="rope_parameters.high_freq_factor",
    rope_original_max_position_embeddings="rope_parameters.original_max_position_embeddings",
    norm_epsilon="rms_norm_eps",
    apply_layernorm_1p=IN_WEIGHTS,
    untie_embeddings_and_output_weights=TIED,
    make_vocab_size_divisible_by=IN_WEIGHTS,
    attention_dropout="attention_dropout",
    init_method_std="initializer_range",
)
SHAPE = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False,
             position_embedding_type="rope", hidden_dropout=0.0, multi_latent_attention=False)
# The layer choices that pick a family of this shape on export (DeepSeek-V3's is multi-latent attention).
SELECTS = ("normalization", "position_embedding_type", "swiglu", "qk_layernorm", "multi_latent_attention")


def weights(config, experts=None) -> list:
    """Llama's tensors; with `experts` (a family's MoE names: router, and expert e's gate, up and
    down projections, `{e}` in place of the expert), the mixture-of-experts layers' too. Query/key
    norms (--qk-layernorm) and q/k/v biases (--add-qkv-bias) where the config has them."""
    entries = [Entry("model.embed_tokens.weight", WORD_EMBEDDINGS, vocab=True)]
    pattern = config.moe_layers if config.num_experts else None
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        entries += attention_weights(config, hf, ours)
        entries.append(Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.pre_mlp_layernorm.weight", norm=True))
        if pattern is not None and pattern[i]:
            entries += moe_weights(config, hf, ours, experts)
        else:
            entries += mlp_weights(f"{hf}.mlp", f"{ours}.mlp")
    entries.append(Entry("model.norm.weight", f"{FINAL_NORM}.weight", norm=True))
    if config.untie_embeddings_and_output_weights:
        entries.append(Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def attention_weights(config, hf: str, ours: str) -> list:
    qkv = f"{ours}.self_attention.linear_qkv.weight"
    entries = [
        Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", norm=True),
        Entry(f"{hf}.self_attn.q_proj.weight", qkv, ("q",), rotary_heads=config.num_attention_heads),
        Entry(f"{hf}.self_attn.k_proj.weight", qkv, ("k",), rotary_heads=config.num_query_groups),
        Entry(f"{hf}.self_attn.v_proj.weight", qkv, ("v",)),
        Entry(f"{hf}.self_attn.o_proj.weight", f"{ours}.self_attention.linear_proj.weight"),
    ]
    if config.qk_layernorm:
        entries += [Entry(f"{hf}.self_attn.{x}_norm.weight", f"{ours}.self_attention.{x}_layernorm.weight", norm=True)
                    for x in ("q", "k")]
    if config.add_qkv_bias:
        heads = dict(q=config.num_attention_heads, k=config.num_query_groups, v=0)
        entries += [Entry(f"{hf}.self_attn.{x}_proj.bias", f"{ours}.self_attention.linear_qkv.bias", (x,),
                          rotary_heads=heads[x]) for x in ("q", "k", "v")]
    return entries


def mlp_weights(hf: str, ours: str) -> list:
    """A SwiGLU MLP: HF's separate gate and up projections are the parts of our fused fc1."""
    fc1 = f"{ours}.linear_fc1.weight"
    return [Entry(f"{hf}.gate_proj.weight", fc1, ("gate",)), Entry(f"{hf}.up_proj.weight", fc1, ("up",)),
            Entry(f"{hf}.down_proj.weight", f"{ours}.linear_fc2.weight")]


def moe_weights(config, hf: str, ours: str, names: tuple) -> list:
    """The router and the experts, one HF tensor per expert; GPTModel stacks them,
    `experts.fc1_weight` [E, 2F, h] (gate; up) and `experts.fc2_weight` [E, h, F]."""
    router, gate, up, down = names
    entries = [Entry(f"{hf}.{router}.weight", f"{ours}.mlp.router.weight")]
    for e in range(config.num_experts):
        entries += [Entry(f"{hf}.{gate.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("gate",), expert=e),
                    Entry(f"{hf}.{up.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("up",), expert=e),
                    Entry(f"{hf}.{down.format(e=e)}.weight", f"{ours}.mlp.experts.fc2_weight", expert=e)]
    return entries


FAMILIES = [Family("llama", "Llama", "LlamaConfig", "LlamaForCausalLM", KEYS, dict(SHAPE, qk_layernorm=False),
                   weights, SELECTS, extra=dict(hidden_act="silu", attention_bias=False, mlp_bias=False))]
