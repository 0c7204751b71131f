"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) with dense layers: Llama's norms and SwiGLU MLPs around
multi-latent attention (--multi-latent-attention with --q-lora-rank, --kv-lora-rank,
--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim), its rotated parts in the interleaved channel
order (`rope_interleave`: --rotary-interleaved) and its latents normalized (`q_a_layernorm`,
`kv_a_layernorm`: --qk-layernorm, as Megatron-Core's layer spec builds them). Its
mixture-of-experts layers (the layers from `first_k_dense_replace` on) are not mapped: a checkpoint
with any is refused by name, and an export writes `first_k_dense_replace` = the layer count.

Multi-token prediction (--mtp-num-layers, `num_nextn_predict_layers`): DeepSeek's checkpoints store
module k (from 0) after the decoder's layers, at `model.layers.{num_hidden_layers + k}`: `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm` (Megatron-Core's `final_layernorm` of the module) and a decoder layer
built as the last one, plus copies of the embedding (`embed_tokens`) and output head
(`shared_head.head`), which are read as copies (ignored: the model's embedding and output layer
serve every depth, as in Megatron-Core) and not written. `transformers`' DeepseekV3ForCausalLM drops
these weights on load (its `_keys_to_ignore_on_load_unexpected`), and its config's default is
`num_nextn_predict_layers: 1`, so a checkpoint it saved says 1 but holds none: set the entry to 0 to
import such a checkpoint's main model.
"""
import dataclasses
import re

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
    mtp_num_layers=HFKey("num_nextn_predict_layers", to_hf=lambda depths: depths or 0,
                         from_hf=lambda depths: depths or None),
)


_MTP_COPY = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")


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


def mtp_weights(config) -> list:
    """The multi-token prediction modules' entries: each module's decoder layer mapped as the last
    decoder layer is (its kind: Megatron-Core builds the module's layer from the last layer's spec)."""
    last = config.num_layers - 1
    hf_last, ours_last = f"model.layers.{last}.", f"decoder.layers.{last}."
    layer = [entry for entry in weights(config) if entry.hf_name.startswith(hf_last)]
    entries = []
    for depth in range(config.mtp_num_layers or 0):
        hf, ours = f"model.layers.{config.num_layers + depth}", f"mtp.layers.{depth}"
        entries += [Entry(f"{hf}.enorm.weight", f"{ours}.enorm.weight", norm=True),
                    Entry(f"{hf}.hnorm.weight", f"{ours}.hnorm.weight", norm=True),
                    Entry(f"{hf}.eh_proj.weight", f"{ours}.eh_proj.weight"),
                    Entry(f"{hf}.shared_head.norm.weight", f"{ours}.final_layernorm.weight", norm=True)]
        entries += [dataclasses.replace(entry, hf_name=f"{hf}." + entry.hf_name[len(hf_last):],
                                        name=f"{ours}.transformer_layer." + entry.name[len(ours_last):])
                    for entry in layer]
    return entries


def mtp_copies(key: str, config) -> bool:
    """The copies of the embedding and output head stored with each prediction module."""
    return bool(config.mtp_num_layers) and bool(_MTP_COPY.fullmatch(key)) and (
        int(key.split(".")[2]) >= config.num_layers)


def weights_with_mtp(config) -> list:
    return weights(config) + mtp_weights(config)


FAMILIES = [Family("deepseek_v3", "DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM", KEYS,
                   dict(llama.SHAPE, qk_layernorm=True, multi_latent_attention=True), weights_with_mtp,
                   llama.SELECTS,
                   extra=dict(hidden_act="silu", attention_bias=False), reader=reader, writer=writer,
                   ignored=mtp_copies)]
