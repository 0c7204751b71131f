"""What a checkpoint says about the model, read from TransformerConfig's field metadata.

A checkpoint saves the architecture twice: the given fields (`saved_args`, the model flags as the
run gave them, Megatron-LM's names: what --use-checkpoint-args restores) and the derived record
(`record`: every field that defines the model, resolved, plus the unpadded vocabulary). On --load
the record of the checkpoint's saved arguments is compared with the run's (`check`): an
ARCHITECTURE field that differs is an error naming its flag, a NUMERICS field a note. RUN fields
(dropout, initialization) are neither restored nor checked.
"""
import dataclasses
from types import SimpleNamespace
from typing import Optional

from megatron.core.transformer.config import TransformerConfig, derive
from megatron.core.transformer.config.fields import ARCHITECTURE, RUN, compared_value, default_of, flag_of, role_of

VOCAB_SIZE = "vocab_size"  # the record's unpadded vocabulary (the tokenizer's)
_FIELDS = {field.name: field for field in dataclasses.fields(TransformerConfig)}


def restored_fields() -> tuple:
    """Names of the fields --use-checkpoint-args takes from a checkpoint (every role but RUN)."""
    return tuple(name for name, field in _FIELDS.items() if field.metadata["role"] != RUN)


def saved_args(config) -> dict:
    """The given architecture fields of `config` (a TransformerConfig, or the flags' model section)."""
    return {name: getattr(config, name) for name in _FIELDS}


def restore(config, saved: dict) -> tuple:
    """(config with the restored fields taken from a checkpoint's `saved` arguments, notes)."""
    changes, notes = {}, []
    for name in restored_fields():
        if name in saved and getattr(config, name) != saved[name]:
            notes.append(f"--use-checkpoint-args: {name} = {saved[name]!r} (was {getattr(config, name)!r})")
            changes[name] = saved[name]
    return dataclasses.replace(config, **changes), notes


def record(derived: TransformerConfig, vocab_size: Optional[int]) -> dict:
    """{field: value} of every field of a derived config that defines the model, plus the vocabulary."""
    fields = {name: compared_value(field, derived) for name, field in _FIELDS.items() if role_of(field, derived) != RUN}
    fields[VOCAB_SIZE] = vocab_size
    return fields


def config_of_checkpoint(common: dict, padded_vocab_size: Optional[int] = None) -> TransformerConfig:
    """The derived TransformerConfig of a checkpoint's saved arguments (common.json of any version
    of this framework: the model flags' names have not changed)."""
    args = common.get("args", {})
    given = TransformerConfig(**{name: value for name, value in args.get("model", {}).items() if name in _FIELDS})
    given.padded_vocab_size = padded_vocab_size
    return derive(given, seq_length=args.get("training", {}).get("seq_length"))


def record_of_checkpoint(common: dict) -> dict:
    """The record of a checkpoint's saved arguments, to `check` a run against."""
    return record(config_of_checkpoint(common), common.get("model", {}).get(VOCAB_SIZE))


def check(directory: str, saved: dict, current: dict) -> list:
    """Raises ValueError naming the flag and both values when the checkpoint is of another model;
    returns notes for what differs without changing a shape."""
    notes = []
    config = SimpleNamespace(**current)
    for name, value in current.items():
        if saved.get(name) is None or value is None or saved[name] == value:
            continue
        if name == VOCAB_SIZE or role_of(_FIELDS[name], config) == ARCHITECTURE:
            raise ValueError(f"the checkpoint {directory} is of another model: it has {name} = {saved[name]!r} "
                             f"({_how_set(name)}), this run has {value!r}; pass the checkpoint's value "
                             "(or --use-checkpoint-args)")
        notes.append(f"{name} differs from the checkpoint's ({saved[name]!r} there, {value!r} here)")
    return notes


def _how_set(name: str) -> str:
    if name == VOCAB_SIZE:
        return "--vocab-size / the tokenizer's vocabulary size"
    return flag_of(_FIELDS[name]) or "no flag sets it: --use-checkpoint-args restores it"


def check_trainable(config: TransformerConfig) -> None:
    """Raises when `config` sets a field that no flag can restate (the checkpoint would train as
    another model unless every run restores it)."""
    for name in restored_fields():
        field = _FIELDS[name]
        if flag_of(field) is None and getattr(config, name) != default_of(field):
            raise ValueError(f"{name} = {getattr(config, name)} cannot be trained here: no flag sets it (Megatron-LM "
                             f"has none; its value is {default_of(field)})")
