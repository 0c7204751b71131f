"""Command-line flags generated from the config dataclasses.

A field `tensor_model_parallel_size` becomes `--tensor-model-parallel-size`; the string literal
under a field is its help text. Booleans are switches (`store_true`); lists take several values.
A flag spelled otherwise (`--disable-bias-linear` for `add_bias_linear`) says so in its field's
metadata (a `Flag`), and a field with no flag (`padded_vocab_size`) is not parsed. The model
section's architecture fields are megatron.core's TransformerConfig. Every other flag of
Megatron-LM's pretrain_gpt.py parses too (megatron.training.megatron_lm): validation turns it into a
start-up note or an error naming it. Unknown flags are errors.

The library (megatron.core) names the config fields in its messages, in backquotes (`num_experts`);
`as_flags` spells them as this command line does (--num-experts) wherever such a message reaches
the user (validation, the exit handling).
"""
import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
import textwrap
import typing
from typing import Optional

from megatron.core.transformer.config.fields import Flag, flag_of
from megatron.training import megatron_lm
from megatron.training.config import SECTIONS, Config
from megatron.training.megatron_lm.registry import REFUSED_VALUES

# Switches kept for older Megatron-LM scripts: flag -> (field, help). They set a field to True that
# is already True by default.
ACCEPTED_SWITCHES = {
    "--overlap-p2p-communication": ("overlap_p2p_comm", "Accepted for older scripts: p2p overlap is on by "
                                                        "default (see --no-overlap-p2p-communication)."),
}

# epfLLM Megatron-LLM's spelling of multi-query attention (and Megatron-LM's dashes): it sets
# --group-query-attention --num-query-groups 1, which checkpoints and conversions record.
MULTIQUERY_FLAGS = ("--use_multiquery_attn", "--use-multiquery-attn")

_MISSING = dataclasses.MISSING


def is_first_rank() -> bool:
    """Whether this process prints the errors that every rank hits alike: local rank 0 under torchrun
    (so each node's log has the line once), or a single process."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with errors of one line: `prog: error: ...` (an unknown flag names the closest known
    one) and a pointer to --help, instead of the full usage; printed by the first rank of each node
    only, since every rank parses the same command line."""

    def error(self, message: str):
        if is_first_rank():
            self._print_message(f"{self.prog}: error: {self._suggest(message)}\n"
                                f"{self.prog}: see {self.prog} --help for the flags\n", sys.stderr)
        self.exit(2)

    def _suggest(self, message: str) -> str:
        """The message, with `(did you mean --x?)` after each unknown flag that is close to a known
        one; a value Megatron-LM accepts and this framework refuses says why."""
        refused = re.fullmatch(r"argument (--[a-z0-9-]+)(?:/[^:]*)?: invalid choice: '([^']*)'.*", message, re.S)
        if refused and refused[2] in REFUSED_VALUES.get(refused[1], {}):
            return f"{refused[1]} {refused[2]} is not supported: {REFUSED_VALUES[refused[1]][refused[2]]}"
        if not message.startswith("unrecognized arguments: "):
            return message
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        hints = []
        for word in message[len("unrecognized arguments: "):].split():
            flag = word.split("=", 1)[0]
            if not re.fullmatch(r"--[A-Za-z0-9_-]+", flag):
                continue
            close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1, cutoff=0.75)
            hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        return f"unrecognized arguments: {' '.join(hints)}" if hints else message


def field_docs(cls) -> dict:
    """{field name: the string literal written under it} from the source of the class and of the
    dataclasses it extends."""
    docs = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls) -> dict:
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
    irregular = field.metadata.get("flag")
    flags = (flag_of(field), *(irregular.aliases if isinstance(irregular, Flag) else ()))
    if isinstance(irregular, Flag):
        help_text = irregular.help or help_text
    help_text = help_text.replace("%", "%%")  # argparse formats help with %: a "5%" is text here
    if isinstance(irregular, Flag):
        if irregular.action is not None:
            group.add_argument(*flags, dest=name, action=irregular.action, default=default, help=help_text)
            return
    kind = _unwrap_optional(annotation)
    kwargs = dict(dest=name, help=help_text)
    if kind is bool:
        group.add_argument(*flags, action="store_true", **kwargs)
        return
    if kind is list or typing.get_origin(kind) is list:
        item = (typing.get_args(kind) or (str,))[0]
        group.add_argument(*flags, nargs="*", default=default, type=item, **kwargs)
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
    group.add_argument(*flags, **kwargs)


def build_parser(extra_sections: Optional[dict] = None, megatron_lm_flags: bool = True) -> argparse.ArgumentParser:
    """The flags of the config dataclasses; with `megatron_lm_flags`, also every other flag of
    Megatron-LM's pretrain_gpt.py (not listed in --help)."""
    parser = ArgumentParser(
        description="Megatron-style GPT/Llama pretraining. Flags follow Megatron-LM's names; the other flags of "
                    "Megatron-LM's pretrain_gpt.py are accepted with a note or refused with the reason "
                    "(docs/megatron-compatibility.md).",
        allow_abbrev=False)
    for section, cls in {**SECTIONS, **(extra_sections or {})}.items():
        group = parser.add_argument_group(section)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if flag_of(field) is not None:
                _add_field(group, field, hints[field.name], docs.get(field.name, ""))
    for flag, (name, help_text) in ACCEPTED_SWITCHES.items():
        parser.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
    parser.add_argument(*MULTIQUERY_FLAGS, dest="use_multiquery_attn", action="store_true",
                        default=argparse.SUPPRESS, help="Multi-query attention: one key/value head shared by "
                        "all query heads (--group-query-attention --num-query-groups 1; Megatron-LLM's flag).")
    if megatron_lm_flags:
        megatron_lm.add_to_parser(parser)
    return parser


def parse_args(argv: Optional[list] = None) -> Config:
    """Parses flags into a Config. Unknown flags are an error (argparse exits with a message).
    With --use-checkpoint-args the model's shape flags may be left out: they come from the
    checkpoint in --load."""
    parser = build_parser()
    if "--use-checkpoint-args" in (sys.argv[1:] if argv is None else argv):
        from megatron.core.checkpointing.architecture import restored_fields

        for action in parser._actions:
            if action.dest in restored_fields():
                action.required = False
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    if values.pop("use_multiquery_attn", False):
        if values["group_query_attention"] and values["num_query_groups"] != 1:
            parser.error(f"--use_multiquery_attn is --num-query-groups 1, but --num-query-groups "
                         f"{values['num_query_groups']} was given: drop one of them")
        values.update(group_query_attention=True, num_query_groups=1)
    try:
        megatron_lm.apply_aliases(megatron_lm.given(namespace), values)
    except ValueError as error:
        parser.error(str(error))
    sections = {section: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                for section, cls in SECTIONS.items()}
    return Config(**sections, megatron_lm_flags=megatron_lm.given(namespace))


def all_flags() -> list:
    """Every flag the config defines, sorted (the frozen public surface; Megatron-LM's other flags
    are frozen by megatron/training/megatron_lm)."""
    parser = build_parser(megatron_lm_flags=False)
    return sorted(s for action in parser._actions for s in action.option_strings if s.startswith("--"))


@functools.lru_cache(maxsize=None)
def field_flags() -> dict:
    """{config field: the flag that sets it}, from the same field metadata the parser is built from."""
    return {field.name: flag_of(field) for cls in SECTIONS.values() for field in dataclasses.fields(cls)
            if flag_of(field) is not None}


_NAMED_FIELD = re.compile(r"`([a-z][a-z0-9_]*)`")


def as_flags(message: str) -> str:
    """A library message as the command line's user reads it: each config field it names in
    backquotes (`num_experts`) becomes its flag (--num-experts); a name no flag sets stays as written."""
    flags = field_flags()
    return _NAMED_FIELD.sub(lambda match: flags.get(match[1], match[0]), message)


def format_config(config: Config) -> str:
    """The resolved arguments, one per line, as Megatron prints them at start."""
    lines = ["------------------------ arguments ------------------------"]
    for section in SECTIONS:
        for key, value in sorted(dataclasses.asdict(getattr(config, section)).items()):
            lines.append(f"  {key} {'.' * max(2, 48 - len(key))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
