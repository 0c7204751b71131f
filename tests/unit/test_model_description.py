"""The one model description (megatron.core.transformer.config) over many random architectures:
flags -> architecture -> checkpoint -> --use-checkpoint-args -> architecture is the identity, and
architecture -> Hugging Face config -> architecture is the identity for every family that can
express the model, with an error naming the setting where the family cannot.

The architectures are drawn field by field from TransformerConfig's own fields (every field a flag
sets, from its type), so a field added to the description is covered without changing this file;
only the shape fields (sizes that must divide one another) are drawn together."""
import dataclasses
import json
import random
import typing

import pytest

from megatron.core.checkpointing import architecture as ckpt_architecture
from megatron.core.checkpointing.architecture import record_of_checkpoint, saved_args
from megatron.core.transformer.config import RUN, TransformerConfig, derive
from megatron.core.transformer.config.fields import IN_WEIGHTS, Flag, applies, default_of, flag_of, role_of, setting
from megatron.training.arguments import parse_args
from megatron.training.builders import transformer_config
from megatron.training.checkpointing import apply_checkpoint_args, architecture, check_architecture

VOCAB = 1000
RUN_FLAGS = ["--micro-batch-size", "1", "--seq-length", "32", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
             "--vocab-size", str(VOCAB - 1)]
FIELDS = dataclasses.fields(TransformerConfig)
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
         "num_query_groups", "ffn_hidden_size", "max_position_embeddings", "num_experts", "moe_layer_freq",
         "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


def random_architecture(rng: random.Random, **fixed) -> TransformerConfig:
    """A valid given architecture: every field a flag sets drawn from its type, the shape drawn
    together, `fixed` fields as given."""
    values = {field.name: _draw(field, rng) for field in FIELDS if flag_of(field) is not None}
    heads = rng.choice([1, 2, 4, 8])
    values.update(num_layers=rng.randint(1, 4), num_attention_heads=heads, hidden_size=heads * rng.choice([8, 16]),
                  kv_channels=rng.choice([None, 8, 16]), group_query_attention=rng.random() < 0.5,
                  num_query_groups=rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0]),
                  ffn_hidden_size=rng.choice([None, 32, 96]), max_position_embeddings=rng.choice([None, 64, 128]))
    # Mixture of experts: the expert count (at least the largest top-k drawn), which layers, their sizes.
    values.update(num_experts=rng.choice([None, 4, 8]), moe_layer_freq=rng.choice(["1", "2", "[0]*1+[1]*3"]),
                  moe_ffn_hidden_size=rng.choice([None, 16, 48]),
                  moe_shared_expert_intermediate_size=rng.choice([None, 32]))
    if values["moe_layer_freq"].startswith("["):
        values["num_layers"] = 4
    values.update(fixed)
    return TransformerConfig(**values)


def _draw(field: dataclasses.Field, rng: random.Random):
    default = default_of(field)
    kind = typing.get_type_hints(TransformerConfig)[field.name]
    if typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if kind is bool:
        return rng.random() < 0.5
    if typing.get_origin(kind) is typing.Literal:
        return rng.choice(typing.get_args(kind))
    if kind in (int, float) and default is not None:
        return rng.choice([default, kind(default * (2 if kind is int else 0.5))])
    return default


def flags_of(config: TransformerConfig) -> list:
    """The command line that states `config`'s flag-set fields."""
    argv = []
    for field in FIELDS:
        flag, value = flag_of(field), getattr(config, field.name)
        if flag is None or value is None:
            continue
        if isinstance(value, bool):
            store_false = isinstance(field.metadata["flag"], Flag) and field.metadata["flag"].action == "store_false"
            argv += [flag] if value != store_false else []
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


@pytest.mark.parametrize("seed", range(60))
def test_flags_checkpoint_and_checkpoint_args_are_the_identity(seed):
    given = random_architecture(random.Random(seed))
    config = parse_args(RUN_FLAGS + flags_of(given))
    assert saved_args(config.model) == saved_args(given)  # flags -> architecture
    derived = transformer_config(config, VOCAB)
    # What a checkpoint's common.json holds (through JSON, as written), then a run that names no model flag.
    common = json.loads(json.dumps({"args": dataclasses.asdict(config), "model": architecture(derived, VOCAB)},
                                   default=str))
    restored, notes = apply_checkpoint_args(parse_args(RUN_FLAGS + ["--use-checkpoint-args", "--load", "ckpt"]),
                                            common)
    restored_fields = ckpt_architecture.restored_fields()  # the architecture; dropout and init are the run's
    assert {name: getattr(restored.model, name) for name in restored_fields} == \
        {name: getattr(given, name) for name in restored_fields}
    assert architecture(transformer_config(restored, VOCAB), VOCAB) == architecture(derived, VOCAB)
    assert check_architecture("ckpt", record_of_checkpoint(common), architecture(derived, VOCAB)) == []
    assert derive(derived) == derived  # deriving is idempotent


transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[test]'")
from megatron.core.models.gpt import hf_mapping  # noqa: E402


def _family_architecture(rng: random.Random, name: str) -> TransformerConfig:
    """A random architecture the family can express: its selecting values, the fields it has no key
    for at their defaults, and the fields it expresses only some values of at the nearest
    (`Family.expressible`)."""
    family = hf_mapping.FAMILIES[name]
    experts = dict(num_experts=rng.choice([4, 8])) if family.experts else {}
    given = random_architecture(rng, **family.implies, **experts)
    fixed = {field.name: default_of(field) for field in FIELDS
             if role_of(field, given) != RUN and hf_mapping._key(field, family) is None and field.name not in family.implies}
    if given.max_position_embeddings is None:
        fixed["max_position_embeddings"] = 128
    config = derive(dataclasses.replace(given, **fixed), vocab_size=VOCAB)
    return derive(dataclasses.replace(config, **family.expressible(config)), vocab_size=VOCAB)


def _compared(config: TransformerConfig, family) -> list:
    return [field for field in FIELDS
            if role_of(field, config) != RUN and hf_mapping._key(field, family) is not IN_WEIGHTS]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", sorted(hf_mapping.FAMILIES))
def test_hugging_face_config_round_trip_is_the_identity(name, seed):
    family = hf_mapping.FAMILIES[name]
    config = _family_architecture(random.Random(seed), name)
    assert hf_mapping.architecture_for_hf(config) == name
    back = hf_mapping.hf_config_to_transformer_config(hf_mapping.hf_config_from_transformer_config(config, VOCAB),
                                                      make_vocab_size_divisible_by=config.make_vocab_size_divisible_by)
    for field in _compared(config, family):
        assert getattr(back, field.name) == getattr(config, field.name), field.name


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", sorted(hf_mapping.FAMILIES))
def test_a_setting_the_family_cannot_express_is_named(name, seed):
    """Each field the family has no key for, set otherwise: the error names the setting."""
    family = hf_mapping.FAMILIES[name]
    rng = random.Random(seed)
    config = _family_architecture(rng, name)
    checked = 0
    for field in FIELDS:
        if (field.name in family.selects or role_of(field, config) == RUN or hf_mapping._key(field, family) is not None
                or field.name in SHAPE[:3]):
            continue
        changed = _another_value(config, field)
        if changed is None:
            continue
        first = next(f for f in _compared(changed, family) if getattr(changed, f.name) != getattr(config, f.name))
        with pytest.raises(ValueError, match="has no Hugging Face") as error:
            hf_mapping.architecture_for_hf(changed)
        assert setting(first, getattr(changed, first.name)) in str(error.value), str(error.value)
        checked += 1
    assert checked > 0


def _another_value(config: TransformerConfig, field: dataclasses.Field):
    """`config` (derived) with `field` set to another value that changes the model, or None."""
    value = getattr(config, field.name)
    if field.name == "group_query_attention":
        changes = dict(group_query_attention=True, num_query_groups=1) if config.num_attention_heads > 1 else None
    elif field.name == "num_query_groups":
        changes = None  # its own key in every family, or changed with group_query_attention
    elif isinstance(value, bool):
        changes = {field.name: not value}
    elif isinstance(value, (int, float)):
        changes = {field.name: type(value)(value * 2) if field.name != "rotary_percent" else 0.5}
    else:
        changes = None
    if changes is None:
        return None
    changed = derive(dataclasses.replace(config, **changes))
    return changed if applies(field, changed) and getattr(changed, field.name) != value else None
