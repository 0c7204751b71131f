"""Command-line flags generated from the config dataclasses.

A field `tensor_model_parallel_size` becomes `--tensor-model-parallel-size`; the string literal
under a field is its help text. Booleans are switches (`store_true`); lists take several values.
The few flags whose name is not the field name are in IRREGULAR_FLAGS. Unknown flags are errors.
"""
import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from typing import Optional

from megatron.training.config import SECTIONS, Config

# field name -> (flag, argparse action): flags that invert or rename a field.
IRREGULAR_FLAGS = {
    "add_bias_linear": ("--disable-bias-linear", "store_false"),
    "check_for_nan_in_loss_and_grad": ("--no-check-for-nan-in-loss-and-grad", "store_false"),
}

_MISSING = dataclasses.MISSING


def field_docs(cls) -> dict:
    """{field name: the string literal written under it} from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = following.value.value
    return docs


def _unwrap_optional(annotation):
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _add_field(group, field: dataclasses.Field, annotation, help_text: str) -> None:
    name = field.name
    has_default = field.default is not _MISSING or field.default_factory is not _MISSING
    default = field.default if field.default is not _MISSING else (
        field.default_factory() if field.default_factory is not _MISSING else None)
    if name in IRREGULAR_FLAGS:
        flag, action = IRREGULAR_FLAGS[name]
        group.add_argument(flag, dest=name, action=action, help=help_text)
        return
    flag = "--" + name.replace("_", "-")
    kind = _unwrap_optional(annotation)
    kwargs = dict(dest=name, help=help_text)
    if kind is bool:
        group.add_argument(flag, action="store_true", **kwargs)
        return
    if kind is list or typing.get_origin(kind) is list:
        item = (typing.get_args(kind) or (str,))[0]
        group.add_argument(flag, nargs="*", default=default, type=item, **kwargs)
        return
    if typing.get_origin(kind) is typing.Literal:
        choices = list(typing.get_args(kind))
        kwargs.update(choices=choices, type=type(choices[0]))
    else:
        kwargs["type"] = kind
    if has_default:
        kwargs["default"] = default
    else:
        kwargs["required"] = True
    group.add_argument(flag, **kwargs)


def build_parser(extra_sections: Optional[dict] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT/Llama pretraining. Flags follow Megatron-LM's names.",
        allow_abbrev=False)
    for section, cls in {**SECTIONS, **(extra_sections or {})}.items():
        group = parser.add_argument_group(section)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            _add_field(group, field, hints[field.name], docs.get(field.name, ""))
    return parser


def parse_args(argv: Optional[list] = None) -> Config:
    """Parses flags into a Config. Unknown flags are an error (argparse exits with a message).
    With --use-checkpoint-args the model's shape flags may be left out: they come from the
    checkpoint in --load."""
    parser = build_parser()
    if "--use-checkpoint-args" in (sys.argv[1:] if argv is None else argv):
        from megatron.training.checkpointing import CHECKPOINT_MODEL_ARGS

        for action in parser._actions:
            if action.dest in CHECKPOINT_MODEL_ARGS:
                action.required = False
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    sections = {section: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
                for section, cls in SECTIONS.items()}
    return Config(**sections)


def all_flags() -> list:
    """Every flag the parser accepts, sorted (the frozen public surface)."""
    parser = build_parser()
    return sorted(s for action in parser._actions for s in action.option_strings if s.startswith("--"))


def format_config(config: Config) -> str:
    """The resolved arguments, one per line, as Megatron prints them at start."""
    lines = ["------------------------ arguments ------------------------"]
    for section in SECTIONS:
        for key, value in sorted(dataclasses.asdict(getattr(config, section)).items()):
            lines.append(f"  {key} {'.' * max(2, 48 - len(key))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
