"""Mapping between Hugging Face `transformers` checkpoints and GPTModel, for any family of
`models.gpt.families` (Llama, Qwen3, GPT-2, Mixtral, Qwen3-MoE, Qwen2-MoE, Falcon, DeepSeek-V3).

The meeting point is the *logical* state: {global parameter name: {part name: full tensor}}, the
unsharded tensors a `TPLayout` cuts each rank's parameter from (see tensor_parallel.layers). So:

    HF state dict --hf_to_logical--> logical --load_logical_into_model--> any TP rank / PP stage
    single-process model --model_to_logical--> logical --logical_to_hf--> HF state dict

Everything here is pure tensor manipulation: no file I/O, no communication beyond `local_to_full`.
What differs between families is data, in the family's module: its config keys (a loop over
TransformerConfig's fields reads them) and its weight entries (a loop over them moves tensors).

Differences the mapping absorbs, whatever the family:
- HF keeps q/k/v and gate/up as separate tensors or fuses them otherwise; GPTModel fuses them, and
  the fused parameters' layouts carry the parts by name ("q", "k", "v", "gate", "up").
- GPT-2 uses `Conv1D`, whose weight is [in, out]: the transpose of `nn.Linear`. Falcon's fused
  query/key/value goes group by group (a group's query heads, its key, its value): reordered.
- The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp_size` (as Megatron
  does); padded rows are zeros going in and dropped coming out.
- HF checkpoints are in the rotate-half rotary convention. A model trained with
  --rotary-interleaved pairs channels (2i, 2i+1) instead: its q/k rows are permuted within each
  head on the way out (and back on the way in), which gives the same attention scores.
- With --apply-layernorm-1p a norm scales by (1 + weight): HF stores the scale itself, so 1 is
  added on the way out and subtracted on the way in.
- Mixtures of experts: HF files hold one tensor per expert (`experts.{e}.w1` ...); GPTModel stacks
  them, `experts.fc1_weight` [E, 2F, h] (gate; up) and `experts.fc2_weight` [E, h, F].
"""
import dataclasses
from typing import Optional

import torch

from megatron.core.models.gpt import families
from megatron.core.models.gpt.families.base import IN_WEIGHTS, Entry, Family, HFKey
from megatron.core.models.gpt.families.gpt2 import POSITION_EMBEDDINGS
from megatron.core.models.gpt.families.llama import FINAL_NORM, OUTPUT_LAYER
from megatron.core.transformer.config import RUN, TransformerConfig, derive, padded_vocab_size
from megatron.core.transformer.config.fields import applies, compared_value, role_of, setting

# Re-exported: the vocabulary padding is the config's (config.derive), the names the families'.
__all__ = ["padded_vocab_size", "POSITION_EMBEDDINGS", "FINAL_NORM", "OUTPUT_LAYER"]
FAMILIES = {family.name: family for family in families.registry()}  # the registry by name, at import
_FIELDS = dataclasses.fields(TransformerConfig)


# ------------------------------------------------------------------------------------------------
# Config: a loop over TransformerConfig's fields, each looked up in the family's key map
# ------------------------------------------------------------------------------------------------
def architecture_of(hf_config) -> str:
    """The name of the family claiming a `transformers` config (its `architectures` entry, else its
    model_type); one error listing the families when none does."""
    return families.of_hf_config(hf_config).name


def hf_config_to_transformer_config(hf_config, *, make_vocab_size_divisible_by: int = 128,
                                    tp_size: int = 1) -> TransformerConfig:
    """The (derived) TransformerConfig of a `transformers` config of a registered family.

    Raises ValueError for options GPTModel does not implement, rather than converting them silently.
    """
    family = families.of_hf_config(hf_config)
    for key, expected in family.extra.items():
        found = getattr(hf_config, key, expected)
        if found != expected:
            raise ValueError(f"{family.title} {key}={found!r} is not supported by GPTModel (only {expected!r})")
    config = _from_entries(lambda key: _read(hf_config, key), family, make_vocab_size_divisible_by,
                           hf_config.vocab_size, tp_size)
    config.check_tensor_parallel(tp_size)
    return config


def architecture_for_hf(config: TransformerConfig) -> str:
    """The name of the first registered family that computes exactly this model (up to the weight
    transforms in the module docstring). Raises ValueError naming the first setting the first
    family with the model's layer choices cannot express."""
    config = derive(config)
    registered = families.registry()
    candidates = [family for family in registered if _implied(config, family)]
    if not candidates:
        raise ValueError("this model has no Hugging Face equivalent here: its `normalization`, "
                         "`position_embedding_type`, `swiglu` and other layer choices match none of the families "
                         f"{tuple(f.name for f in registered)} (docs/models.md lists what each implies)")
    refusals = [_unexpressed(config, family) for family in candidates]
    for family, refusal in zip(candidates, refusals):
        if refusal is None:
            return family.name
    raise ValueError(refusals[0])


def _unexpressed(config: TransformerConfig, family: Family) -> Optional[str]:
    """The error naming the first setting of a derived config `family` cannot express, or None."""
    entries = _to_entries(config, family, vocab_size=config.padded_vocab_size)
    back = _from_entries(lambda key: _lookup(entries, key), family, config.make_vocab_size_divisible_by,
                         config.padded_vocab_size, 1)
    for spec in _FIELDS:
        if (role_of(spec, config) != RUN and _key(spec, family) is not IN_WEIGHTS
                and compared_value(spec, back) != compared_value(spec, config)):
            return (f"{setting(spec, getattr(config, spec.name))} {family.context}has no Hugging Face "
                    f"{family.title} equivalent{family.note}")
    return None


def hf_config_from_transformer_config(config: TransformerConfig, vocab_size: int):
    """The `transformers` config of a model (the inverse of `hf_config_to_transformer_config`);
    `vocab_size` is the unpadded vocabulary."""
    import transformers

    family = families.named(architecture_for_hf(config))
    entries = _to_entries(derive(config), family, vocab_size)
    return getattr(transformers, family.config_class)(architectures=[family.architecture], **entries)


def _key(spec: dataclasses.Field, family: Family) -> Optional[HFKey]:
    return family.key(spec)


def _implied(config: TransformerConfig, family: Family) -> bool:
    return ((family.experts is None or (config.num_experts is not None) == family.experts)
            and all(getattr(config, name) == family.implies[name] for name in family.selects))


def _from_entries(read, family: Family, make_vocab_size_divisible_by: int, vocab_size: int,
                  tp_size: int) -> TransformerConfig:
    """The derived config of a family's entries, `read(key)` giving each (None when absent)."""
    read = family.reader(read)
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
        entries.update(decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(config.moe_layers) if not moe])
    return family.writer(entries)


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
def _ignored_hf_key(key: str, config: TransformerConfig, family: Family) -> bool:
    """Keys HF state dicts may carry that hold no weights of their own."""
    if key == "lm_head.weight" and not config.untie_embeddings_and_output_weights:
        return True  # the tied copy of the embedding
    return key.endswith("rotary_emb.inv_freq") or family.ignored(key, config)


def hf_to_logical(hf_state_dict: dict, config: TransformerConfig, arch: str) -> dict:
    """{global param name: {part name: full tensor}} from the HF state dict of family `arch`.

    The vocabulary rows of the embedding (and untied output layer) are zero-padded to
    `config.vocab_size`. Raises on missing or unrecognized keys.
    """
    family = families.named(arch)
    hf_state_dict = {family.normalize_key(k): v for k, v in hf_state_dict.items()}
    entries = family.weights(config)
    known = {entry.hf_name for entry in entries}
    unexpected = [k for k in hf_state_dict if k not in known and not _ignored_hf_key(k, config, family)]
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
    for entry in families.named(arch).weights(config):
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


def _grouped_qkv_order(config: TransformerConfig, groups: int) -> torch.Tensor:
    """For each row of a [q; k; v] projection (q: heads x d rows, then k and v: groups x d each),
    its row in the group-by-group layout: group g holds its heads/groups query heads, then its key,
    then its value head (d = kv_channels)."""
    d, per_group = config.kv_channels, config.num_attention_heads // groups
    heads = torch.arange(config.num_attention_heads)
    slots = torch.cat((heads // per_group * (per_group + 2) + heads % per_group,  # query head h
                       torch.arange(groups) * (per_group + 2) + per_group,  # key of group g
                       torch.arange(groups) * (per_group + 2) + per_group + 1))  # value of group g
    return (slots.unsqueeze(1) * d + torch.arange(d)).reshape(-1)


def _to_hf(tensor: torch.Tensor, entry: Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.qkv_groups:
        tensor = tensor[torch.argsort(_grouped_qkv_order(config, entry.qkv_groups))]
    if entry.norm and config.apply_layernorm_1p:
        tensor = tensor + 1.0
    if entry.rotary_heads and config.rotary_interleaved:
        tensor = tensor[_rotary_permutation(config, entry.rotary_heads)]
    return tensor


def _to_ours(tensor: torch.Tensor, entry: Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.qkv_groups:
        tensor = tensor[_grouped_qkv_order(config, entry.qkv_groups)]
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
        # The MoE routers' expert biases (--moe-router-enable-expert-bias): trained state without
        # gradients, whole on every rank; from a Megatron-LM import or DeepSeek-V3's
        # e_score_correction_bias (absent from the other Hugging Face families: zeros).
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
    for name, buffer in model.named_buffers():  # the MoE routers' expert biases, as loaded above
        if name.endswith(".router.expert_bias"):
            logical[model.global_param_name(name)] = {"": buffer.clone()}
    return logical
