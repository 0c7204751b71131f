"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) with dense layers: Llama's norms and SwiGLU MLPs around
multi-latent attention (--multi-latent-attention with --q-lora-rank, --kv-lora-rank,
--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim), its rotated parts in the interleaved channel
order (`rope_interleave`: --rotary-interleaved) and its latents normalized (`q_a_layernorm`,
`kv_a_layernorm`: --qk-layernorm, as Megatron-Core's layer spec builds them). Its
mixture-of-experts layers (the layers from `first_k_dense_replace` on) are not mapped: a checkpoint
with any is refused by name, and an export writes `first_k_dense_replace` = the layer count.
"""
from megatron.core.models.gpt.families import llama
from megatron.core.models.gpt.families.base import Entry, Family, HFKey

KEYS = dict(
    {field: llama.KEYS[field] for field in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
        "rotary_base", "use_rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "rope_original_max_position_embeddings", "norm_epsilon", "apply_layernorm_1p",
        "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "attention_dropout",
        "init_method_std")},
    rotary_interleaved=HFKey("rope_interleave"),
    q_lora_rank="q_lora_rank",
    kv_lora_rank="kv_lora_rank",
    qk_head_dim="qk_nope_head_dim",
    qk_pos_emb_head_dim="qk_rope_head_dim",
    v_head_dim="v_head_dim",
)


def reader(read):
    layers, dense = read("num_hidden_layers"), read("first_k_dense_replace")
    if dense is not None and layers is not None and dense < layers:
        raise ValueError(f"DeepSeek-V3 first_k_dense_replace={dense} < num_hidden_layers={layers}: its "
                         "mixture-of-experts layers are not converted here; only models whose layers are all dense")
    return read


def writer(entries: dict) -> dict:
    """All layers dense; every head its own key and value (HF's num_key_value_heads)."""
    entries.update(first_k_dense_replace=entries["num_hidden_layers"],
                   num_key_value_heads=entries["num_attention_heads"])
    return entries


def weights(config) -> list:
    entries = [Entry("model.embed_tokens.weight", llama.WORD_EMBEDDINGS, vocab=True)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        attention, mine = f"{hf}.self_attn", f"{ours}.self_attention"
        entries.append(Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", norm=True))
        if config.q_lora_rank is None:
            entries.append(Entry(f"{attention}.q_proj.weight", f"{mine}.linear_q_proj.weight"))
        else:
            entries += [Entry(f"{attention}.q_a_proj.weight", f"{mine}.linear_q_down_proj.weight"),
                        Entry(f"{attention}.q_a_layernorm.weight", f"{mine}.q_layernorm.weight", norm=True),
                        Entry(f"{attention}.q_b_proj.weight", f"{mine}.linear_q_up_proj.weight")]
        entries += [Entry(f"{attention}.kv_a_proj_with_mqa.weight", f"{mine}.linear_kv_down_proj.weight"),
                    Entry(f"{attention}.kv_a_layernorm.weight", f"{mine}.kv_layernorm.weight", norm=True),
                    Entry(f"{attention}.kv_b_proj.weight", f"{mine}.linear_kv_up_proj.weight"),
                    Entry(f"{attention}.o_proj.weight", f"{mine}.linear_proj.weight"),
                    Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.pre_mlp_layernorm.weight", norm=True)]
        entries += llama.mlp_weights(f"{hf}.mlp", f"{ours}.mlp")
    entries.append(Entry("model.norm.weight", f"{llama.FINAL_NORM}.weight", norm=True))
    if config.untie_embeddings_and_output_weights:
        entries.append(Entry("lm_head.weight", llama.OUTPUT_LAYER, vocab=True))
    return entries


FAMILIES = [Family("deepseek_v3", "DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM", KEYS,
                   dict(llama.SHAPE, qk_layernorm=True, multi_latent_attention=True), weights,
                   llama.SELECTS,
                   extra=dict(hidden_act="silu", attention_bias=False), reader=reader, writer=writer)]
