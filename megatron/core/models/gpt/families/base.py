"""What a Hugging Face model family is to this framework: a `Family` (its config-key map, the
settings it implies, its weight-name map) and the `Entry` rows of the weight map.

A family module of this package defines `FAMILIES`, a list of `Family` (usually one); the
registry (`families.registry()`) is the list of every module's families. Nothing else names a
family: TransformerConfig's fields carry their role and flag only, and the conversion
(`models.gpt.hf_mapping`) is one loop over the family's keys and one over its weight entries.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron.core.transformer.config.fields import IN_WEIGHTS, HFKey

__all__ = ["Entry", "Family", "HFKey", "IN_WEIGHTS", "TIED"]

TIED = HFKey("tie_word_embeddings", to_hf=lambda untie: not untie, from_hf=lambda tie: not tie)


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and where it lives in the logical state.

    `parts`: the logical parts the HF tensor is split into along dim 0 (after the Conv1D
    transpose), with their `sizes`; most tensors are one part. `conv1d`: stored as [in, out].
    `vocab`: rows are vocabulary entries (padded in the logical state). `norm`: a norm's scale
    (shifted by one for zero-centered norms). `rotary_heads`: query/key rows of this many heads,
    permuted for an interleaved-RoPE model. `expert`: this tensor is expert `expert` of a stacked
    logical tensor. `qkv_groups`: a fused query/key/value projection whose rows go group by group
    (each key/value group's query heads, then its key head, then its value head: Falcon), of this
    many groups; its rows are put in [q; k; v] order before the split into parts.
    """

    hf_name: str
    name: str
    parts: tuple = ("",)
    sizes: Optional[tuple] = None
    conv1d: bool = False
    vocab: bool = False
    norm: bool = False
    rotary_heads: int = 0
    expert: Optional[int] = None
    qkv_groups: int = 0


def _no_extra_tensors(key: str, config) -> bool:
    return False


def _same_key(key: str) -> str:
    return key


def _same_entries(entries):
    return entries


def _no_changes(config) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family GPTModel computes exactly (up to the weight transforms of
    hf_mapping).

    `name`: the `transformers` model_type. `architecture`: the `architectures` entry (model class)
    it claims. `keys`: {TransformerConfig field: its HF key (a str, an `HFKey` or IN_WEIGHTS)};
    a field without a key cannot take a value other than the one the family implies.
    `implies`: the values of fields it has no key for. `selects`: the fields whose implied values
    pick the family of a model on export (any other field it cannot express is then named in the
    error); `experts`: whether it is a mixture-of-experts family (--num-experts set; None: either, as
    DeepSeek-V3, whose config says which layers are). `extra`:
    config entries it has that GPTModel has no field for, written on export and required on import.
    `copies`: entries written on export from a field ({key: field}). `layer_pattern`: the family
    keeps --moe-layer-freq as `mlp_only_layers` and `decoder_sparse_step` (Qwen-MoE).
    `weights(config)`: the weight-name map, a list of `Entry`. `ignored(key, config)`: state-dict
    keys holding no weights of their own (buffers); `normalize_key`: a key's canonical spelling.
    `reader(read)`: given `read(key)` of the HF config's entries, the `read` the keys use (a family
    whose config spells one setting several ways puts it in one form: Falcon's attention layouts);
    `writer(entries)`: the exported entries from those the keys wrote (its inverse).
    `expressible(config)`: for a family that expresses only some values of fields it has keys for
    (DeepSeek-V3: dense layers first only), the changes taking a derived config to the nearest it
    expresses (the random round-trip tests draw through it)."""

    name: str
    title: str
    config_class: str
    architecture: str
    keys: dict
    implies: dict
    weights: Callable
    selects: tuple = ("normalization", "position_embedding_type", "swiglu")
    extra: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)
    context: str = ""  # placed after a setting it cannot express ("with LayerNorm ")
    experts: Optional[bool] = False
    layer_pattern: bool = False
    note: str = ""  # appended to the error naming a setting it cannot express
    ignored: Callable = _no_extra_tensors
    normalize_key: Callable = _same_key
    reader: Callable = _same_entries
    writer: Callable = _same_entries
    expressible: Callable = _no_changes

    def key(self, spec: dataclasses.Field) -> Optional[HFKey]:
        """The HF key of a TransformerConfig field in this family, or None."""
        key = self.keys.get(spec.name)
        return HFKey(key) if isinstance(key, str) else key
