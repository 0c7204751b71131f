"""The metadata every field of the model description carries, and the loops that read it.

A field of `TransformerConfig` is declared with `arch_field`:

    qk_layernorm: bool = arch_field(False, ARCHITECTURE)
    \"\"\"Normalize each query and key head ... (the --help text).\"\"\"

- `role`: ARCHITECTURE (the shapes: saved in checkpoints, restored by --use-checkpoint-args, a
  mismatch on --load is an error), NUMERICS (same shapes, another function: saved and restored, a
  mismatch is a note) or RUN (how the model is trained: dropout, initialization; neither restored
  nor checked). A role may depend on the other fields (a callable of the config).
- `flag`: None for a field no flag sets; FROM_NAME (the default) for `--field-name`; a `Flag` for
  an irregular spelling (`--disable-bias-linear` sets `add_bias_linear` to False).
- `compared_as`: a callable (value, config) giving the form in which checkpoints and the Hugging
  Face round trip compare the value (--moe-layer-freq 2 and [1, 0] are the same two layers).
- `applies`: a callable of the config saying whether the field takes part in the model
  (`rope_scaling_factor` only with `use_rope_scaling`). `derive` puts a field that does not apply
  back to its default, so that equal models have equal derived descriptions.

The same `Flag` metadata serves the training flag dataclasses (megatron.training.config). A
field's Hugging Face keys are not here: each family holds its own (models.gpt.families).
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

ARCHITECTURE = "architecture"
NUMERICS = "numerics"
RUN = "run"
FROM_NAME = "from name"


@dataclass(frozen=True)
class Flag:
    """An irregular flag: its spelling, an argparse action (None: the field's typed handling under
    this name), --help text (None: the field's docstring), and other spellings it accepts
    (`aliases`: another project's, such as Megatron-LLM's `--parallel_attn` in Megatron-LM's dashes)."""

    name: str
    action: Any = None
    help: Optional[str] = None
    aliases: tuple = ()


@dataclass(frozen=True)
class HFKey:
    """A Hugging Face config entry of a family (models.gpt.families), with conversions:
    `to_hf(value)` on export (None: not written), `from_hf(value)` on import (given the entry, or
    None when the config lacks it). The key is an attribute of the `transformers` config
    ("num_hidden_layers") or a dotted path into one of its dict attributes ("rope_parameters.factor")."""

    key: str
    to_hf: Optional[Callable] = lambda value: value
    from_hf: Callable = lambda value: value


IN_WEIGHTS = HFKey("", to_hf=None, from_hf=lambda value: None)
"""A family's key for a setting it stores in the weights (hf_mapping transforms them on the way)."""


def arch_field(default=dataclasses.MISSING, role: Union[str, Callable] = ARCHITECTURE, *, flag=FROM_NAME,
               applies: Optional[Callable] = None, compared_as: Optional[Callable] = None,
               default_factory=dataclasses.MISSING):
    """A field of the model description (see the module docstring); `default_factory` for a list."""
    metadata = {"role": role, "flag": flag, "applies": applies, "compared_as": compared_as}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_field(default=dataclasses.MISSING, flag: Optional[Flag] = None, **kwargs):
    """A field of a training flag dataclass whose flag is spelled irregularly."""
    return dataclasses.field(default=default, metadata={"flag": flag or FROM_NAME}, **kwargs)


def flag_of(field: dataclasses.Field) -> Optional[str]:
    """The flag that sets `field` (its irregular spelling, or --field-name), or None."""
    flag = field.metadata.get("flag", FROM_NAME)
    if flag is None:
        return None
    return flag.name if isinstance(flag, Flag) else "--" + field.name.replace("_", "-")


def role_of(field: dataclasses.Field, config) -> str:
    role = field.metadata.get("role", RUN)
    return role(config) if callable(role) else role


def applies(field: dataclasses.Field, config) -> bool:
    condition = field.metadata.get("applies")
    return condition is None or bool(condition(config))


def compared_value(field: dataclasses.Field, config):
    """`field`'s value in `config` in the form checkpoints and conversions compare (`compared_as`)."""
    value = getattr(config, field.name)
    convert = field.metadata.get("compared_as")
    return value if convert is None or value is None else convert(value, config)


def default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def setting(field: dataclasses.Field, value) -> str:
    """How a user writes `field = value`: `--qk-layernorm`, `--disable-bias-linear`,
    `--rotary-percent 0.5`, or `name = value` for a field no flag sets."""
    flag = flag_of(field)
    if flag is None:
        return f"{field.name} = {value}"
    if isinstance(value, bool):
        action = getattr(field.metadata.get("flag"), "action", None)
        return flag if value == (action != "store_false") else f"{field.name} = {value} (without {flag})"
    return f"{flag} {value}"
