"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): Llama's norms and SwiGLU MLPs around multi-latent
attention (--multi-latent-attention with --q-lora-rank, --kv-lora-rank, --qk-head-dim,
--qk-pos-emb-head-dim, --v-head-dim), its rotated parts in the interleaved channel order
(`rope_interleave`: --rotary-interleaved) and its latents normalized (`q_a_layernorm`,
`kv_a_layernorm`: --qk-layernorm, as Megatron-Core's layer spec builds them).

Its rotary scaling `rope_scaling` {rope_type: yarn, factor, original_max_position_embeddings,
beta_fast, beta_slow, mscale, mscale_all_dim, truncate} is --rope-type yarn with
--rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast,
--yarn-beta-slow, --mscale, --mscale-all-dim, --no-yarn-correction-range-round-to-int.

Its layers from `first_k_dense_replace` on are mixtures of experts (the --moe-layer-freq pattern
[0]*k+[1]*(L-k)): `n_routed_experts` of `moe_intermediate_size` (--num-experts,
--moe-ffn-hidden-size), `n_shared_experts` of that size beside them
(--moe-shared-expert-intermediate-size, their total), and a router with sigmoid scores whose
`e_score_correction_bias` is --moe-router-enable-expert-bias's bias, top-`num_experts_per_tok`
in the `topk_group` best of `n_group` groups, normalized, times `routed_scaling_factor`
(--moe-router-topk-scaling-factor). transformers scores a group by its best two experts,
Megatron-Core by its best topk/topk_group: they agree when num_experts_per_tok = 2 x topk_group
(DeepSeek-V3's 8 and 4), and other group settings are refused.

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
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

_YARN = "rope_parameters."


def _rope_type(rope_type) -> str:
    if rope_type not in (None, "default", "yarn"):
        raise ValueError(f"DeepSeek-V3 rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    return "yarn" if rope_type == "yarn" else "rope"


KEYS = dict(
    {field: llama.KEYS[field] for field in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
        "rotary_base", "norm_epsilon", "apply_layernorm_1p", "untie_embeddings_and_output_weights",
        "make_vocab_size_divisible_by", "attention_dropout", "init_method_std")},
    rotary_interleaved=HFKey("rope_interleave"),
    q_lora_rank="q_lora_rank",
    kv_lora_rank="kv_lora_rank",
    qk_head_dim="qk_nope_head_dim",
    qk_pos_emb_head_dim="qk_rope_head_dim",
    v_head_dim="v_head_dim",
    # YaRN (read in `_read_yarn`, written in `_write_yarn`)
    rope_type=HFKey(_YARN + "rope_type", from_hf=_rope_type),
    rotary_scaling_factor=_YARN + "factor",
    mscale=_YARN + "mscale",
    mscale_all_dim=_YARN + "mscale_all_dim",
    yarn_original_max_position_embeddings=_YARN + "original_max_position_embeddings",
    yarn_beta_fast=_YARN + "beta_fast",
    yarn_beta_slow=_YARN + "beta_slow",
    yarn_correction_range_round_to_int=_YARN + "truncate",
    # Mixture of experts (read in `_read_experts`, written in `_write_experts`)
    num_experts="n_routed_experts",
    moe_layer_freq="first_k_dense_replace",
    moe_ffn_hidden_size="moe_intermediate_size",
    moe_shared_expert_intermediate_size="n_shared_experts",
    moe_router_topk="num_experts_per_tok",
    moe_router_topk_scaling_factor=HFKey("routed_scaling_factor", to_hf=lambda factor: factor or 1.0,
                                         from_hf=lambda factor: None if factor == 1 else factor),
    moe_router_num_groups=HFKey("n_group", to_hf=lambda groups: groups or 1),
    moe_router_group_topk=HFKey("topk_group", to_hf=lambda groups: groups or 1),
    mtp_num_layers=HFKey("num_nextn_predict_layers", to_hf=lambda depths: depths or 0,
                         from_hf=lambda depths: depths or None),
)


_MTP_COPY = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")


def reader(read):
    return _read_experts(_read_yarn(read))


def writer(entries: dict) -> dict:
    """Every head its own key and value (HF's num_key_value_heads)."""
    entries.update(num_key_value_heads=entries["num_attention_heads"])
    return _write_experts(_write_yarn(entries))


def _read_yarn(read):
    """transformers' YaRN as Megatron-Core's: a missing factor is max_position_embeddings over the
    original length; the rotated channels are scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) only when both are set and nonzero, else by mscale(factor, 1), which is
    Megatron-Core's with mscale 1 (and mscale_all_dim 0 or unset)."""
    if read(_YARN + "rope_type") != "yarn":
        return read
    if read(_YARN + "attention_factor") is not None:
        raise ValueError("DeepSeek-V3 rope_scaling attention_factor is not supported: YaRN's scale of the rotated "
                         "channels comes from factor, mscale and mscale_all_dim here (as in Megatron-Core)")
    factor, mscale, mscale_all_dim = (read(_YARN + key) for key in ("factor", "mscale", "mscale_all_dim"))
    if factor is None:
        factor = read("max_position_embeddings") / read(_YARN + "original_max_position_embeddings")
    if factor > 1 and not mscale and mscale_all_dim:
        raise ValueError(f"DeepSeek-V3 rope_scaling mscale={mscale!r} with mscale_all_dim={mscale_all_dim} has no "
                         "Megatron-Core equivalent (transformers then scales the rotated channels by "
                         "mscale(factor, 1) but the attention by mscale(factor, mscale_all_dim)^2)")
    if factor > 1 and not (mscale and mscale_all_dim):
        mscale = 1.0
    values = {_YARN + "factor": factor, _YARN + "mscale": mscale}
    return lambda key: values[key] if key in values else read(key)


def _write_yarn(entries: dict) -> dict:
    rope = entries["rope_parameters"]
    rope["rope_type"] = "yarn" if rope.get("rope_type") == "yarn" else "default"
    return entries


def _read_experts(read):
    """The HF entries our fields read: no experts when every layer is dense; the layer pattern
    from first_k_dense_replace; the shared experts' total size; no groups when there is one."""
    layers, dense = read("num_hidden_layers"), read("first_k_dense_replace") or 0
    if read("n_routed_experts") is None or dense >= layers:
        return lambda key: None if key in ("n_routed_experts", "first_k_dense_replace") else read(key)
    if read("norm_topk_prob") is False:
        raise ValueError("DeepSeek-V3 norm_topk_prob=False is not supported: Megatron-Core's sigmoid router always "
                         "normalizes the chosen experts' weights")
    topk, groups, group_topk = read("num_experts_per_tok"), read("n_group") or 1, read("topk_group") or 1
    if topk == 1:
        raise ValueError("DeepSeek-V3 num_experts_per_tok=1 is not supported: transformers normalizes the one "
                         "expert's weight to 1, Megatron-Core's sigmoid router keeps its score")
    if groups > 1 and topk != 2 * group_topk:
        raise ValueError(f"DeepSeek-V3 num_experts_per_tok={topk} with topk_group={group_topk}: transformers "
                         "scores a group by its best 2 experts, Megatron-Core by its best num_experts_per_tok / "
                         "topk_group; only num_experts_per_tok = 2 x topk_group converts")
    shared = read("n_shared_experts") or 0
    values = {"first_k_dense_replace": _pattern(dense, layers),
              "n_shared_experts": shared * read("moe_intermediate_size") if shared else None,
              "n_group": groups if groups > 1 else None, "topk_group": group_topk if groups > 1 else None}
    return lambda key: values[key] if key in values else read(key)


def _pattern(dense: int, layers: int) -> str:
    """--moe-layer-freq for the first `dense` layers dense, as Megatron-LM's DeepSeek-V3 scripts spell it."""
    return f"[0]*{dense}+[1]*{layers - dense}" if dense else "1"


def _write_experts(entries: dict) -> dict:
    """The inverse of `_read_experts`; a pattern HF cannot express (a mixture of experts before a
    dense layer, a shared size that is no multiple of the expert's) is written as its nearest, which
    the conversion's round trip then names."""
    layers = entries["num_hidden_layers"]
    if entries.get("n_routed_experts") is None:  # dense: every layer below first_k_dense_replace
        entries.pop("n_routed_experts", None)
        entries.update(first_k_dense_replace=layers)
        return entries
    pattern = moe_layer_pattern(entries["first_k_dense_replace"], layers)
    entries["first_k_dense_replace"] = pattern.index(1) if 1 in pattern else layers
    shared, size = entries.get("n_shared_experts"), entries["moe_intermediate_size"]
    entries["n_shared_experts"] = shared // size if shared and shared % size == 0 else 0
    entries.update(norm_topk_prob=True)
    return entries


def expressible(config) -> dict:
    """The nearest mixture of experts HF expresses: its dense layers first, the shared experts a
    whole number of experts, and with groups top-k = 2 x the groups chosen."""
    if config.num_experts is None:
        return {}
    layers = config.num_layers
    pattern = moe_layer_pattern(config.moe_layer_freq, layers)
    dense = pattern.index(1) if 1 in pattern else layers
    changes = dict(moe_layer_freq=_pattern(dense, layers))
    shared, size = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    if shared is not None:
        changes.update(moe_shared_expert_intermediate_size=max(1, shared // size) * size)
    if config.moe_router_num_groups is not None:
        changes.update(moe_router_topk=2 * config.moe_router_group_topk)
    return changes


def weights(config) -> list:
    entries = [Entry("model.embed_tokens.weight", llama.WORD_EMBEDDINGS, vocab=True)]
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers) if config.num_experts else None
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        entries += attention_weights(config, hf, ours)
        entries.append(Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.pre_mlp_layernorm.weight", norm=True))
        if pattern is not None and pattern[i]:
            entries += moe_weights(config, hf, ours)
        else:
            entries += llama.mlp_weights(f"{hf}.mlp", f"{ours}.mlp")
    entries.append(Entry("model.norm.weight", f"{llama.FINAL_NORM}.weight", norm=True))
    if config.untie_embeddings_and_output_weights:
        entries.append(Entry("lm_head.weight", llama.OUTPUT_LAYER, vocab=True))
    return entries


def attention_weights(config, hf: str, ours: str) -> list:
    attention, mine = f"{hf}.self_attn", f"{ours}.self_attention"
    entries = [Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", norm=True)]
    if config.q_lora_rank is None:
        entries.append(Entry(f"{attention}.q_proj.weight", f"{mine}.linear_q_proj.weight"))
    else:
        entries += [Entry(f"{attention}.q_a_proj.weight", f"{mine}.linear_q_down_proj.weight"),
                    Entry(f"{attention}.q_a_layernorm.weight", f"{mine}.q_layernorm.weight", norm=True),
                    Entry(f"{attention}.q_b_proj.weight", f"{mine}.linear_q_up_proj.weight")]
    return entries + [Entry(f"{attention}.kv_a_proj_with_mqa.weight", f"{mine}.linear_kv_down_proj.weight"),
                      Entry(f"{attention}.kv_a_layernorm.weight", f"{mine}.kv_layernorm.weight", norm=True),
                      Entry(f"{attention}.kv_b_proj.weight", f"{mine}.linear_kv_up_proj.weight"),
                      Entry(f"{attention}.o_proj.weight", f"{mine}.linear_proj.weight")]


def moe_weights(config, hf: str, ours: str) -> list:
    """The router (`mlp.gate`) and its bias, the routed experts (one HF tensor each, stacked here),
    and the shared experts (one SwiGLU MLP of their total size)."""
    names = ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")
    entries = llama.moe_weights(config, hf, ours, names)
    entries.append(Entry(f"{hf}.mlp.gate.e_score_correction_bias", f"{ours}.mlp.router.expert_bias"))
    if config.moe_shared_expert_intermediate_size is not None:
        entries += llama.mlp_weights(f"{hf}.mlp.shared_experts", f"{ours}.mlp.shared_experts.mlp")
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
                   dict(llama.SHAPE, qk_layernorm=True, multi_latent_attention=True,
                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_dtype="fp32"),
                   weights_with_mtp, llama.SELECTS, experts=None,
                   extra=dict(hidden_act="silu", attention_bias=False), reader=reader, writer=writer,
                   expressible=expressible, ignored=mtp_copies)]
