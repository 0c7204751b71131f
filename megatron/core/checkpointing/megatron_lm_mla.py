"""Megatron-Core's multi-latent attention and multi-token prediction tensors, for megatron_lm.py's reader.

Multi-latent attention (`--multi-latent-attention`), in layer i (`decoder.layers.i.self_attention.`):
- `linear_q_proj.weight` [heads x (qk_head_dim + qk_pos_emb_head_dim), h] without --q-lora-rank;
  with it `linear_q_down_proj.weight` [q_lora_rank, h], `q_layernorm.weight` [q_lora_rank] and
  `linear_q_up_proj.weight` [heads x (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank];
- `linear_kv_down_proj.weight` [kv_lora_rank + qk_pos_emb_head_dim, h], `kv_layernorm.weight`
  [kv_lora_rank], `linear_kv_up_proj.weight` [heads x (qk_head_dim + v_head_dim), kv_lora_rank];
- `linear_proj.weight` [h, heads x v_head_dim].
The names, the row orders (per head: [no-position part; rotated part] and [key; value]) and the
torch_dist shapes are ours. Megatron-Core's local spec builds the latents' norms as modules of their
own (with --qk-layernorm) and every projection but linear_proj column-parallel, the down projections
included (its legacy files split them over the TP ranks); Transformer Engine's spec fuses the norms
into the up projections (`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`)
and keeps the down projections whole on every TP rank (duplicated linears). A legacy shard of a down
projection is therefore whole when it has the full rows the arguments give, a piece otherwise.

Megatron-Core's multi-latent attention de-interleaves the rotated channels before it rotates halves
(rope_utils, `multi_latent_attention=True`): channel 2i turns with 2i+1, which is ours with
--rotary-interleaved (DeepSeek-V3's order); the permutation of the output, the same for queries and
keys, leaves the attention unchanged.

Multi-token prediction (`--mtp-num-layers`): depth k's `mtp.layers.k.{enorm,hnorm,final_layernorm}.
weight` (whole on every rank), `mtp.layers.k.eh_proj.weight` [h, 2h] (column-parallel) and its layer
`mtp.layers.k.transformer_layer.*`, built as the last decoder layer (read as one: megatron_lm_moe's
LAYER_PREFIX). torch_dist saves each depth under its own names, not stacked. In legacy files of a
pipeline-parallel run the last stage also holds a copy of the word embedding for the prediction
depths, which megatron_lm.py does not read (Megatron-Core keeps it equal to the first stage's).
"""
import re

import torch

# Transformer Engine's names of the latents' norms (fused into the up projections) -> ours.
FUSED_NORMS = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
}
# Legacy TP split, keyed by the name after the layer's prefix: the dim the shards are concatenated
# along (None: whole on every rank). The down projections: see DOWN_PROJECTIONS.
LAYER_SPLIT = {
    "self_attention.linear_q_proj.weight": 0, "self_attention.linear_q_up_proj.weight": 0,
    "self_attention.linear_kv_up_proj.weight": 0,
    "self_attention.linear_q_down_proj.weight": 0, "self_attention.linear_kv_down_proj.weight": 0,
    "self_attention.kv_layernorm.weight": None, "self_attention.kv_layernorm.bias": None,
}
# The down projections and the arguments whose sum is their full rows.
DOWN_PROJECTIONS = {"self_attention.linear_q_down_proj.weight": ("q_lora_rank",),
                    "self_attention.linear_kv_down_proj.weight": ("kv_lora_rank", "qk_pos_emb_head_dim")}
# A prediction depth's own tensors (its layer's are the decoder layers' tables), by the name after
# `mtp.layers.k.`.
MTP_MODULE = re.compile(r"mtp\.layers\.\d+\.(.+)")
MTP_SPLIT = {"enorm.weight": None, "enorm.bias": None, "hnorm.weight": None, "hnorm.bias": None,
             "eh_proj.weight": 0, "final_layernorm.weight": None, "final_layernorm.bias": None}
# (argument, Megatron flag, what it is) for options GPTModel does not build: refused when set.
UNSUPPORTED = (
    ("mla_down_proj_fusion", "--mla-down-proj-fusion", "multi-latent attention's down projections fused"),
    ("mtp_use_repeated_layer", "--mtp-use-repeated-layer", "one multi-token prediction layer for every depth"),
)
_LAYER_NAME = re.compile(r".+\.(self_attention\.linear_(?:q|kv)_down_proj\.weight)")


def down_projection_rows(args: dict) -> dict:
    """{name within a layer: full rows} of the down projections (empty without multi-latent attention)."""
    if not args.get("multi_latent_attention"):
        return {}
    return {name: sum(args.get(arg) or 0 for arg in rows_from) for name, rows_from in DOWN_PROJECTIONS.items()}


def is_whole(name: str, piece: torch.Tensor, whole_rows: dict) -> bool:
    """A down projection held whole by each TP rank (Transformer Engine's spec), from one legacy shard."""
    match = _LAYER_NAME.fullmatch(name)
    return match is not None and match.group(1) in whole_rows and piece.shape[0] == whole_rows[match.group(1)]


def rotary_interleaved(args: dict, source: str) -> bool:
    """Our --rotary-interleaved for Megatron-Core's multi-latent attention: always (see above). With
    --rotary-interleaved set too Megatron-Core would rotate the de-interleaved channels in pairs
    again, an order GPTModel does not build."""
    if args.get("rotary_interleaved"):
        raise ValueError(f"{source}: --multi-latent-attention with --rotary-interleaved cannot be imported: "
                         "Megatron-Core then de-interleaves the rotated channels and rotates them in pairs, an "
                         "order GPTModel does not build")
    return True
