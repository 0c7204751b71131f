"""`derive`: the values the flags leave to defaults, computed once, and the checks of the result."""
import dataclasses
from typing import Optional

from megatron.core.transformer.config.architecture import TransformerConfig
from megatron.core.transformer.config.fields import applies, default_of
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern
from megatron.core.utils import divide

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp_size: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of make_vocab_size_divisible_by * tp_size (as Megatron)."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's --ffn-hidden-size default with --swiglu: 8h/3 rounded down to a multiple of 64
    (two input projections of that size hold about as many weights as one of 4h)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def derive(config, *, vocab_size: Optional[int] = None, tp_size: int = 1,
           seq_length: Optional[int] = None) -> TransformerConfig:
    """The TransformerConfig the layers build, from the given one (or from any object with its
    fields, such as the flags' model section): defaults filled in (kv channels, FFN size, query
    groups, max positions from `seq_length`, the expert FFN size, which layers are mixtures of
    experts, the vocabulary padded from `vocab_size`), fields that do not apply put back to their
    defaults, and the result checked. Equal models give equal results; deriving twice changes
    nothing. Raises ValueError naming the flags."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(TransformerConfig)}
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if values["kv_channels"] is None:
        values["kv_channels"] = divide(hidden, heads, "--hidden-size by --num-attention-heads")
    if values["ffn_hidden_size"] is None:
        values["ffn_hidden_size"] = swiglu_ffn_hidden_size(hidden) if values["swiglu"] else 4 * hidden
    groups = values["num_query_groups"] if values["group_query_attention"] else heads
    divide(heads, groups, "--num-attention-heads by --num-query-groups")
    values.update(num_query_groups=groups, group_query_attention=groups != heads)
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = seq_length
    if values["multi_latent_attention"] and values["rope_type"] is None:
        # Megatron-LM's multi-latent attention defaults to YaRN, which at factor 1 is plain RoPE.
        values["rope_type"] = "rope" if values["rotary_scaling_factor"] == 1 else "yarn"
    if values["num_experts"] is not None:  # mixture of experts: the expert size and which layers
        if values["moe_ffn_hidden_size"] is None:
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]
        values["moe_layers"] = tuple(moe_layer_pattern(values["moe_layer_freq"], values["num_layers"]))
    if values["mtp_num_layers"] == 0:  # Megatron-Core builds no prediction module for 0
        values["mtp_num_layers"] = None
    if values["padded_vocab_size"] is None and vocab_size is not None:
        values["padded_vocab_size"] = padded_vocab_size(vocab_size, values["make_vocab_size_divisible_by"], tp_size)
    _check(values)
    derived = TransformerConfig(**values)
    for field in dataclasses.fields(TransformerConfig):
        if not applies(field, derived):
            setattr(derived, field.name, default_of(field))
    return derived


def _check(values: dict) -> None:
    if (values["multi_latent_attention"] and values["rope_type"] == "rope" and values["rotary_scaling_factor"] > 1
            and values["mscale_all_dim"]):
        # Megatron-Core scales multi-latent attention's softmax by YaRN's mscale whatever the rope type.
        raise ValueError("--rotary-scaling-factor with --mscale-all-dim and --rope-type rope: Megatron-Core then "
                         "scales the attention by YaRN's factor on plain RoPE, which is not built here; use "
                         "--rope-type yarn, or drop --rotary-scaling-factor and --mscale-all-dim")
    if values["normalization"] not in NORMALIZATIONS:
        raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {values['normalization']!r}")
    if values["position_embedding_type"] not in POSITION_EMBEDDINGS:
        raise ValueError("--position-embedding-type must be rope, learned_absolute or none, "
                         f"got {values['position_embedding_type']!r}")
    if values["mtp_num_layers"] is not None and values["mtp_num_layers"] < 0:
        raise ValueError(f"--mtp-num-layers must be >= 0, got {values['mtp_num_layers']} (0 or unset: no "
                         "multi-token prediction)")
