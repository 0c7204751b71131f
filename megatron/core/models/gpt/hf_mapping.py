"""Mapping between Hugging Face `transformers` checkpoints (Llama, Qwen3, GPT-2 and the MoE families) and GPTModel.

The meeting point is the *logical* state: {global parameter name: {part name: full tensor}}, the
unsharded tensors a `TPLayout` cuts each rank's parameter from (see tensor_parallel.layers). So:

    HF state dict --hf_to_logical--> logical --load_logical_into_model--> any TP rank / PP stage
    single-process model --model_to_logical--> logical --logical_to_hf--> HF state dict

Everything here is pure tensor manipulation: no file I/O, no communication beyond `local_to_full`.

Differences the mapping absorbs:
- HF keeps q/k/v (Llama) and gate/up (SwiGLU) as separate tensors; GPTModel fuses them, and the
  fused parameters' layouts carry the parts by name ("q", "k", "v", "gate", "up").
- GPT-2 uses `Conv1D`, whose weight is [in, out]: the transpose of `nn.Linear`. Its fused `c_attn`
  is [q; k; v] along the output features.
- The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp_size` (as Megatron
  does); padded rows are zeros going in and dropped coming out.
- Llama checkpoints in HF format are in the rotate-half rotary convention. A model trained with
  --rotary-interleaved pairs channels (2i, 2i+1) instead: its q/k rows are permuted within each
  head on the way out (and back on the way in), which gives the same attention scores.
- With --apply-layernorm-1p a norm scales by (1 + weight): HF stores the scale itself, so 1 is
  added on the way out and subtracted on the way in.
- Query/key normalization (--qk-layernorm, RMSNorm over each head) is Qwen3's `q_norm`/`k_norm`:
  such a Llama-shaped model maps to `Qwen3ForCausalLM`. GPT-2 has no equivalent.
- Mixtures of experts: Mixtral (every layer MoE, softmax over the chosen experts) and Qwen3-MoE
  (with query/key norms; `norm_topk_prob` false is --moe-router-pre-softmax; `mlp_only_layers` and
  `decoder_sparse_step` become the --moe-layer-freq pattern), and Qwen2-MoE (Qwen3-MoE's layout
  without query/key norms, with q/k/v biases and a shared expert scaled by a sigmoid gate:
  --moe-shared-expert-intermediate-size with --moe-shared-expert-gate). HF files hold one tensor per expert
  (`experts.{e}.w1` ...); GPTModel stacks them, `experts.fc1_weight` [E, 2F, h] (gate; up) and
  `experts.fc2_weight` [E, h, F]; the router is HF's `gate`.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron.core.models.gpt.model import WORD_EMBEDDINGS
from megatron.core.transformer.config import RUN, TransformerConfig, derive, padded_vocab_size
from megatron.core.transformer.config.fields import IN_WEIGHTS, HFKey, applies, compared_value, role_of, setting
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"
__all__ = ["padded_vocab_size"]  # re-exported: the vocabulary padding is the config's (config.derive)


# ------------------------------------------------------------------------------------------------
# Config: a loop over TransformerConfig's fields, each naming its key per family in its metadata
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """A Hugging Face model family GPTModel computes exactly (up to the weight transforms above).

    `keys`: whose keys of the fields' `hf` metadata it reads, the first found (Qwen3: its own, then
    Llama's; Qwen2-MoE: its own, then Qwen3-MoE's, then Llama's).
    `implies`: the values of fields it has no key for. `selects`: the fields whose implied values
    pick the family of a model on export (any other field it cannot express is then named in the
    error); `experts`: whether it is a mixture-of-experts family (--num-experts set). `extra`:
    config entries it has that GPTModel has no field for, written on export and required on import.
    `copies`: entries written on export from a field ({key: field}). `layer_pattern`: the family
    keeps --moe-layer-freq as `mlp_only_layers` and `decoder_sparse_step` (Qwen-MoE)."""

    title: str
    config_class: str
    keys: tuple
    implies: dict
    selects: tuple = ("normalization", "position_embedding_type", "swiglu")
    extra: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)
    context: str = ""  # placed after a setting it cannot express ("with LayerNorm ")
    experts: bool = False
    layer_pattern: bool = False
    note: str = ""  # appended to the error naming a setting it cannot express


_LLAMA_SHAPE = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                    position_embedding_type="rope", hidden_dropout=0.0)
_LLAMA_SELECTS = ("normalization", "position_embedding_type", "swiglu", "qk_layernorm")
_MOE_SELECTS = _LLAMA_SELECTS + ("add_qkv_bias",)
_QWEN_MOE_EXTRA = dict(hidden_act="silu", use_sliding_window=False)
FAMILIES = {
    "llama": Family("Llama", "LlamaConfig", ("llama",), dict(_LLAMA_SHAPE, qk_layernorm=False), _LLAMA_SELECTS,
                    extra=dict(hidden_act="silu", attention_bias=False, mlp_bias=False)),
    "qwen3": Family("Qwen3", "Qwen3Config", ("qwen3", "llama"), dict(_LLAMA_SHAPE, qk_layernorm=True), _LLAMA_SELECTS,
                    extra=dict(hidden_act="silu", attention_bias=False, use_sliding_window=False)),
    "mixtral": Family("Mixtral", "MixtralConfig", ("mixtral", "llama"), dict(_LLAMA_SHAPE, qk_layernorm=False),
                      _MOE_SELECTS, experts=True,
                      extra=dict(hidden_act="silu", sliding_window=None, router_jitter_noise=0.0),
                      note=" (Mixtral has every layer a mixture of experts, softmax over the chosen experts, "
                           "no shared experts)"),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeConfig", ("qwen3_moe", "llama"), dict(_LLAMA_SHAPE, qk_layernorm=True),
                        _MOE_SELECTS, experts=True, layer_pattern=True,
                        extra=dict(_QWEN_MOE_EXTRA, attention_bias=False)),
    "qwen2_moe": Family("Qwen2-MoE", "Qwen2MoeConfig", ("qwen2_moe", "qwen3_moe", "llama"),
                        dict(_LLAMA_SHAPE, qk_layernorm=False, add_qkv_bias=True, moe_shared_expert_gate=True),
                        _MOE_SELECTS, experts=True, layer_pattern=True, extra=dict(_QWEN_MOE_EXTRA, qkv_bias=True)),
    "gpt2": Family("GPT-2", "GPT2Config", ("gpt2",),
                   dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                        position_embedding_type="learned_absolute"),
                   extra=dict(scale_attn_by_inverse_layer_idx=False, scale_attn_weights=True),
                   copies=dict(embd_pdrop="hidden_dropout"), context="with LayerNorm "),
}
ARCHITECTURES = tuple(FAMILIES)
_LLAMA_LIKE = tuple(name for name in FAMILIES if name != "gpt2")
# Where each family keeps a mixture-of-experts block: the router, and expert e's gate, up and down
# projections, in the checkpoint files' per-expert names (what save_pretrained writes).
_MOE_KEYS = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}
_MOE_KEYS["qwen2_moe"] = _MOE_KEYS["qwen3_moe"]
_FIELDS = dataclasses.fields(TransformerConfig)


def architecture_of(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {ARCHITECTURES}")
    return model_type


def hf_config_to_transformer_config(hf_config, *, make_vocab_size_divisible_by: int = 128,
                                    tp_size: int = 1) -> TransformerConfig:
    """The (derived) TransformerConfig of a `transformers` config of one of `FAMILIES`.

    Raises ValueError for options GPTModel does not implement, rather than converting them silently.
    """
    family = FAMILIES[architecture_of(hf_config)]
    for key, expected in family.extra.items():
        found = getattr(hf_config, key, expected)
        if found != expected:
            raise ValueError(f"{family.title} {key}={found!r} is not supported by GPTModel (only {expected!r})")
    config = _from_entries(lambda key: _read(hf_config, key), family, make_vocab_size_divisible_by,
                           hf_config.vocab_size, tp_size)
    config.check_tensor_parallel(tp_size)
    return config


def architecture_for_hf(config: TransformerConfig) -> str:
    """The name in `FAMILIES` of the Hugging Face family that computes exactly this model (up to
    the weight transforms in the module docstring). Raises ValueError naming the first setting the
    family cannot express."""
    config = derive(config)
    name = next((name for name, family in FAMILIES.items() if _implied(config, family)), None)
    if name is None:
        raise ValueError("this model has no Hugging Face equivalent here: only Llama (RMSNorm, SwiGLU, RoPE, no "
                         "biases; Qwen3 with --qk-layernorm; Mixtral, Qwen3-MoE and Qwen2-MoE with --num-experts) "
                         "and GPT-2 (LayerNorm, GeLU, learned positions, biases, multi-head attention) shapes convert")
    family = FAMILIES[name]
    entries = _to_entries(config, family, vocab_size=config.padded_vocab_size)
    back = _from_entries(lambda key: _lookup(entries, key), family, config.make_vocab_size_divisible_by,
                         config.padded_vocab_size, 1)
    for spec in _FIELDS:
        value = getattr(config, spec.name)
        if (role_of(spec, config) != RUN and _key(spec, family) is not IN_WEIGHTS
                and compared_value(spec, back) != compared_value(spec, config)):
            raise ValueError(f"{setting(spec, value)} {family.context}has no Hugging Face {family.title} "
                             f"equivalent{family.note}")
    return name


def hf_config_from_transformer_config(config: TransformerConfig, vocab_size: int):
    """The `transformers` config of a model (the inverse of `hf_config_to_transformer_config`);
    `vocab_size` is the unpadded vocabulary."""
    import transformers

    family = FAMILIES[architecture_for_hf(config)]
    entries = _to_entries(derive(config), family, vocab_size)
    return getattr(transformers, family.config_class)(**entries)


def _key(spec: dataclasses.Field, family: Family) -> Optional[HFKey]:
    keys = spec.metadata.get("hf", {})
    key = next((keys[name] for name in family.keys if name in keys), None)
    return HFKey(key) if isinstance(key, str) else key


def _implied(config: TransformerConfig, family: Family) -> bool:
    return ((config.num_experts is not None) == family.experts
            and all(getattr(config, name) == family.implies[name] for name in family.selects))


def _from_entries(read, family: Family, make_vocab_size_divisible_by: int, vocab_size: int,
                  tp_size: int) -> TransformerConfig:
    """The derived config of a family's entries, `read(key)` giving each (None when absent)."""
    values = dict(family.implies, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    for spec in _FIELDS:
        key = _key(spec, family)
        raw = read(key.key) if key is not None and key is not IN_WEIGHTS else None
        if raw is not None:
            values[spec.name] = key.from_hf(raw)
    if family.layer_pattern:  # Qwen-MoE: layer i is dense if listed in mlp_only_layers or off the sparse step
        dense, step = read("mlp_only_layers") or [], read("decoder_sparse_step") or 1
        pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(values["num_layers"])]
        values["moe_layer_freq"] = pattern if not all(pattern) else "1"  # every layer: the flag's default
    return derive(TransformerConfig(**values), vocab_size=vocab_size, tp_size=tp_size)


def _to_entries(config: TransformerConfig, family: Family, vocab_size: int) -> dict:
    """The family's config entries of a derived config (`rope_parameters` as one dict)."""
    entries = dict(family.extra, vocab_size=vocab_size)
    for spec in _FIELDS:
        key = _key(spec, family)
        if key is None or key.to_hf is None or not applies(spec, config):
            continue
        container, _, leaf = key.key.rpartition(".")
        target = entries.setdefault(container, {}) if container else entries
        target[leaf] = key.to_hf(getattr(config, spec.name))
    for key, name in family.copies.items():
        entries[key] = getattr(config, name)
    if family.layer_pattern:
        pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
        entries.update(decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    return entries


def _lookup(entries: dict, key: str):
    container, _, leaf = key.rpartition(".")
    return (entries.get(container) or {}).get(leaf) if container else entries.get(key)


def _read(hf_config, key: str):
    """An entry of a `transformers` config; rope entries from either transformers 5
    (`rope_parameters`) or 4.x (`rope_theta`, `rope_scaling`)."""
    if key.startswith("rope_parameters."):
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        for name, value in (getattr(hf_config, "rope_scaling", None) or {}).items():
            params.setdefault(name, value)
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None))
        params.setdefault("rope_type", params.get("type"))
        return params.get(key.partition(".")[2])
    return getattr(hf_config, key, None)


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    """One HF tensor and where it lives in the logical state.

    `parts`: the logical parts the HF tensor is split into along dim 0 (after the Conv1D
    transpose), with their `sizes`; most tensors are one part. `conv1d`: stored as [in, out].
    `vocab`: rows are vocabulary entries (padded in the logical state). `norm`: a norm's scale
    (shifted by one for zero-centered norms). `rotary_heads`: query/key rows of this many heads,
    permuted for an interleaved-RoPE model.
    """

    hf_name: str
    name: str
    parts: tuple = ("",)
    sizes: Optional[tuple] = None
    conv1d: bool = False
    vocab: bool = False
    norm: bool = False
    rotary_heads: int = 0
    expert: Optional[int] = None  # this HF tensor is expert `expert` of a stacked logical tensor


def _llama_entries(config: TransformerConfig) -> list:
    """Llama's tensors, and Qwen3's (Llama's plus q_norm/k_norm)."""
    entries = [_Entry("model.embed_tokens.weight", WORD_EMBEDDINGS, vocab=True)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        qkv = f"{ours}.self_attention.linear_qkv.weight"
        fc1 = f"{ours}.mlp.linear_fc1.weight"
        entries += [
            _Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", norm=True),
            _Entry(f"{hf}.self_attn.q_proj.weight", qkv, ("q",), rotary_heads=config.num_attention_heads),
            _Entry(f"{hf}.self_attn.k_proj.weight", qkv, ("k",), rotary_heads=config.num_query_groups),
            _Entry(f"{hf}.self_attn.v_proj.weight", qkv, ("v",)),
            _Entry(f"{hf}.self_attn.o_proj.weight", f"{ours}.self_attention.linear_proj.weight"),
            _Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.pre_mlp_layernorm.weight", norm=True),
        ]
        if config.num_experts is not None and moe_layer_pattern(config.moe_layer_freq, config.num_layers)[i]:
            entries += _moe_entries(config, hf, ours)
        else:
            entries += [_Entry(f"{hf}.mlp.gate_proj.weight", fc1, ("gate",)),
                        _Entry(f"{hf}.mlp.up_proj.weight", fc1, ("up",)),
                        _Entry(f"{hf}.mlp.down_proj.weight", f"{ours}.mlp.linear_fc2.weight")]
        if config.qk_layernorm:
            entries += [_Entry(f"{hf}.self_attn.{x}_norm.weight", f"{ours}.self_attention.{x}_layernorm.weight",
                               norm=True) for x in ("q", "k")]
        if config.add_qkv_bias:
            heads = dict(q=config.num_attention_heads, k=config.num_query_groups, v=0)
            entries += [_Entry(f"{hf}.self_attn.{x}_proj.bias", f"{ours}.self_attention.linear_qkv.bias", (x,),
                               rotary_heads=heads[x]) for x in ("q", "k", "v")]
    entries.append(_Entry("model.norm.weight", f"{FINAL_NORM}.weight", norm=True))
    if config.untie_embeddings_and_output_weights:
        entries.append(_Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def _moe_entries(config: TransformerConfig, hf: str, ours: str) -> list:
    family = "mixtral" if not (config.qk_layernorm or config.add_qkv_bias) else "qwen3_moe"
    router, gate, up, down = _MOE_KEYS[family]
    entries = [_Entry(f"{hf}.{router}.weight", f"{ours}.mlp.router.weight")]
    if config.moe_shared_expert_intermediate_size is not None:  # Qwen2-MoE
        shared = f"{ours}.mlp.shared_experts"
        entries += [_Entry(f"{hf}.mlp.shared_expert.gate_proj.weight", f"{shared}.mlp.linear_fc1.weight", ("gate",)),
                    _Entry(f"{hf}.mlp.shared_expert.up_proj.weight", f"{shared}.mlp.linear_fc1.weight", ("up",)),
                    _Entry(f"{hf}.mlp.shared_expert.down_proj.weight", f"{shared}.mlp.linear_fc2.weight"),
                    _Entry(f"{hf}.mlp.shared_expert_gate.weight", f"{shared}.gate_weight")]
    for e in range(config.num_experts):
        entries += [_Entry(f"{hf}.{gate.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("gate",), expert=e),
                    _Entry(f"{hf}.{up.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("up",), expert=e),
                    _Entry(f"{hf}.{down.format(e=e)}.weight", f"{ours}.mlp.experts.fc2_weight", expert=e)]
    return entries


def _gpt2_entries(config: TransformerConfig) -> list:
    h = config.hidden_size
    entries = [
        _Entry("transformer.wte.weight", WORD_EMBEDDINGS, vocab=True),
        _Entry("transformer.wpe.weight", POSITION_EMBEDDINGS),
    ]
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}", f"decoder.layers.{i}"
        attention, mlp = f"{ours}.self_attention", f"{ours}.mlp"
        for suffix in ("weight", "bias"):
            conv1d = suffix == "weight"
            entries += [
                _Entry(f"{hf}.ln_1.{suffix}", f"{ours}.input_layernorm.{suffix}", norm=suffix == "weight"),
                _Entry(f"{hf}.attn.c_attn.{suffix}", f"{attention}.linear_qkv.{suffix}",
                       ("q", "k", "v"), (h, h, h), conv1d=conv1d),
                _Entry(f"{hf}.attn.c_proj.{suffix}", f"{attention}.linear_proj.{suffix}", conv1d=conv1d),
                _Entry(f"{hf}.ln_2.{suffix}", f"{ours}.pre_mlp_layernorm.{suffix}", norm=suffix == "weight"),
                _Entry(f"{hf}.mlp.c_fc.{suffix}", f"{mlp}.linear_fc1.{suffix}", conv1d=conv1d),
                _Entry(f"{hf}.mlp.c_proj.{suffix}", f"{mlp}.linear_fc2.{suffix}", conv1d=conv1d),
            ]
    entries += [_Entry(f"transformer.ln_f.{suffix}", f"{FINAL_NORM}.{suffix}", norm=suffix == "weight")
                for suffix in ("weight", "bias")]
    if config.untie_embeddings_and_output_weights:
        entries.append(_Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def _entries(config: TransformerConfig, arch: str) -> list:
    if arch in _LLAMA_LIKE:
        return _llama_entries(config)
    if arch == "gpt2":
        return _gpt2_entries(config)
    raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")


def _ignored_hf_key(key: str, config: TransformerConfig, arch: str) -> bool:
    """Keys HF state dicts may carry that hold no weights of their own."""
    if key == "lm_head.weight" and not config.untie_embeddings_and_output_weights:
        return True  # the tied copy of the embedding
    if arch == "gpt2" and (key.endswith(".attn.bias") or key.endswith(".attn.masked_bias")):
        return True  # causal-mask buffers of older transformers versions
    return key.endswith("rotary_emb.inv_freq")


def _normalize_gpt2_key(key: str) -> str:
    """Original GPT-2 checkpoints name the base model's tensors without the `transformer.` prefix."""
    if key.startswith("transformer.") or key.startswith("lm_head."):
        return key
    return f"transformer.{key}"


def hf_to_logical(hf_state_dict: dict, config: TransformerConfig, arch: str) -> dict:
    """{global param name: {part name: full tensor}} from a HF Llama or GPT-2 state dict.

    The vocabulary rows of the embedding (and untied output layer) are zero-padded to
    `config.vocab_size`. Raises on missing or unrecognized keys.
    """
    if arch == "gpt2":
        hf_state_dict = {_normalize_gpt2_key(k): v for k, v in hf_state_dict.items()}
    entries = _entries(config, arch)
    known = {entry.hf_name for entry in entries}
    unexpected = [k for k in hf_state_dict if k not in known and not _ignored_hf_key(k, config, arch)]
    missing = [name for name in known if name not in hf_state_dict]
    if unexpected or missing:
        raise KeyError(f"HF state dict does not match the {arch} config: missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    logical, experts = {}, {}
    for entry in entries:
        tensor = _to_ours(hf_state_dict[entry.hf_name], entry, config)
        if entry.expert is not None:  # stacked below, in expert order
            experts.setdefault((entry.name, entry.parts[0]), []).append(tensor)
            continue
        if entry.conv1d:
            tensor = tensor.t()
        if entry.vocab:
            tensor = _pad_rows(tensor, config.padded_vocab_size)
        pieces = tensor.split(list(entry.sizes)) if entry.sizes else (tensor,)
        parts = logical.setdefault(entry.name, {})
        for part, piece in zip(entry.parts, pieces, strict=True):
            parts[part] = piece.contiguous()
    for (name, part), tensors in experts.items():
        logical.setdefault(name, {})[part] = torch.stack(tensors)
    return logical


def logical_to_hf(logical: dict, config: TransformerConfig, arch: str, *,
                  vocab_size: Optional[int] = None) -> dict:
    """The HF state dict of a logical state (the inverse of `hf_to_logical`).

    `vocab_size`: the unpadded vocabulary size (HF's `config.vocab_size`); padded rows past it are
    dropped. None keeps all `config.padded_vocab_size` rows. A tied output layer is not emitted, as in
    the checkpoints `save_pretrained` writes.
    """
    out = {}
    for entry in _entries(config, arch):
        parts = logical[entry.name]
        tensor = torch.cat([parts[p] for p in entry.parts], dim=0) if len(entry.parts) > 1 else parts[entry.parts[0]]
        if entry.expert is not None:
            tensor = tensor[entry.expert]
        if entry.vocab and vocab_size is not None:
            tensor = tensor[:vocab_size]
        if entry.conv1d:
            tensor = tensor.t()
        out[entry.hf_name] = _to_hf(tensor, entry, config).contiguous()
    return out


def _rotary_permutation(config: TransformerConfig, heads: int) -> torch.Tensor:
    """Row order taking one head-stacked q or k projection from the interleaved RoPE layout to
    rotate-half: within each head's rotated channels, rotate-half position j < r/2 reads
    interleaved row 2j and position r/2 + j reads row 2j + 1 (r = rotary channels)."""
    d = config.kv_channels
    rotary = int(d * config.rotary_percent)
    within = torch.cat((torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, d)))
    return (torch.arange(heads).unsqueeze(1) * d + within).reshape(-1)


def _to_hf(tensor: torch.Tensor, entry: _Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.norm and config.apply_layernorm_1p:
        tensor = tensor + 1.0
    if entry.rotary_heads and config.rotary_interleaved:
        tensor = tensor[_rotary_permutation(config, entry.rotary_heads)]
    return tensor


def _to_ours(tensor: torch.Tensor, entry: _Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.norm and config.apply_layernorm_1p:
        tensor = tensor - 1.0
    if entry.rotary_heads and config.rotary_interleaved:
        tensor = tensor[torch.argsort(_rotary_permutation(config, entry.rotary_heads))]
    return tensor


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] > rows:
        raise ValueError(f"vocabulary of {tensor.shape[0]} rows exceeds the padded vocab size {rows}")
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat((tensor, padding), dim=0)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def load_logical_into_model(model, logical: dict) -> None:
    """Copies each parameter's slice of the logical state into `model` (any TP rank / PP stage)."""
    for name, param in model.named_parameters():
        global_name = model.global_param_name(name)
        if global_name not in logical:
            raise KeyError(f"logical state has no {global_name!r} (parameter {name!r})")
        full = logical[global_name]
        if hasattr(param, "expert_offset"):  # this rank's experts of the stacked tensors
            full = {part: tensor[param.expert_offset:param.expert_offset + param.shape[0]] for part, tensor in full.items()}
        local = param.tp_layout.full_to_local(full)
        if local.shape != param.shape:
            raise ValueError(f"{global_name}: logical state gives shape {tuple(local.shape)} for this rank, "
                             f"the parameter is {tuple(param.shape)}")
        param.copy_(local)
    for name, buffer in model.named_buffers():
        # A Megatron-LM import's MoE router biases (--moe-router-enable-expert-bias): trained state
        # without gradients, whole on every rank; absent from Hugging Face checkpoints (zeros).
        global_name = model.global_param_name(name)
        if name.endswith(".router.expert_bias") and global_name in logical:
            buffer.copy_(logical[global_name][""])


@torch.no_grad()
def model_to_logical(model) -> dict:
    """The logical state of `model` (collective over its TP group; single process: group None)."""
    logical = {}
    for name, param in model.named_parameters():
        full = param.tp_layout.local_to_full(param, group=model.groups.tp)
        logical[model.global_param_name(name)] = {part: tensor.clone() for part, tensor in full.items()}
    return logical
