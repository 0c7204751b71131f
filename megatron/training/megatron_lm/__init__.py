"""The flags of Megatron-LM's pretrain_gpt.py (NVIDIA's and the ROCm fork's), how the ones this
framework does not define are treated (`registry.py`), and their place in the command line.

The flags come from `upstream_flags.json`, generated from the upstream argument parsers at pinned
commits (NVIDIA's main, the ROCm fork's rocm_dev, and the fork's newest parser file with the config
dataclass files it generates argument groups from) by
`python tools/dev/upstream_flags.py` (its docstring says how to regenerate it), and from
`pretrain_gpt_flags.txt`, the flags of earlier Megatron-LM versions that the current parsers dropped
(kept so that older launch scripts still parse).

Every flag parses. One our config defines is implemented; any other is added to the parser here, so
that a Megatron-LM launch script is read whole: `check` then turns what was given into start-up
notes, or into one error naming the flag.
"""
import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from megatron.training.megatron_lm.registry import FLAGS, GROUPS, PREFIXES, Treatment

HERE = os.path.dirname(__file__)
UPSTREAM_FILE = os.path.join(HERE, "upstream_flags.json")
LIST_FILE = os.path.join(HERE, "pretrain_gpt_flags.txt")
DEST_PREFIX = "megatron_lm:"


@dataclass(frozen=True)
class MegatronFlag:
    name: str                # "--num-layers"
    group: str               # Megatron-LM's argument group
    arity: str               # "switch", "value", "optional" (nargs='?') or "list"
    type: Optional[str] = None       # upstream's type, as written in its source ("int", "str", ...)
    choices: Optional[tuple] = None  # upstream's choices
    default: object = None
    sources: tuple = ()      # the upstream parsers that define it ("NVIDIA", "ROCm"); () for older versions'
    validated: Optional[dict] = None  # upstream validate_args' bound: {"minimum": N, "when": condition or None}


def _arity(entry: dict) -> str:
    if entry["action"] in ("store_true", "store_false", "store_const") or str(entry["action"]).endswith(
            "BooleanOptionalAction"):
        return "switch"
    if entry["nargs"] == "?":
        return "optional"
    if entry["nargs"] in ("+", "*") or isinstance(entry["nargs"], int):
        return "list"
    return "value"


def _older_flags() -> dict:
    """{flag: (group, arity)} of pretrain_gpt_flags.txt."""
    flags, group = {}, None
    with open(LIST_FILE) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                group = line.strip("[]")
                continue
            name, _, value = line.partition("=")
            flags[name] = (group, "switch" if not value else ("list" if value.endswith("...") else "value"))
    return flags


def upstream_sources() -> dict:
    with open(UPSTREAM_FILE) as handle:
        return json.load(handle)["sources"]


def megatron_flags() -> list:
    """Every flag of the upstream parsers, then those of older versions. A flag keeps the argument
    group an older Megatron-LM gave it (the registry's groups are those)."""
    older = _older_flags()
    with open(UPSTREAM_FILE) as handle:
        entries = json.load(handle)["flags"]
    flags = []
    for entry in entries:
        group = older[entry["name"]][0] if entry["name"] in older else entry["group"]
        choices = tuple(entry["choices"]) if isinstance(entry["choices"], list) else None
        flags.append(MegatronFlag(entry["name"], group, _arity(entry), entry["type"], choices, entry["default"],
                                  tuple(entry["sources"]), entry.get("validated")))
    known = {flag.name for flag in flags}
    flags += [MegatronFlag(name, group, arity) for name, (group, arity) in older.items() if name not in known]
    return flags


def twin(name: str) -> Optional[str]:
    """Megatron-LM spells an off switch both `--no-x` and `--disable-x`: the other spelling."""
    for first, second in (("--no-", "--disable-"), ("--disable-", "--no-")):
        if name.startswith(first):
            return second + name[len(first):]
    return None


def treatment(flag: MegatronFlag) -> Optional[Treatment]:
    """The registry's treatment of a flag our parser does not define: its own (or its twin
    spelling's), else its name prefix's, else its group's."""
    prefix = next((PREFIXES[p] for p in PREFIXES if flag.name.startswith(p)), None)
    return FLAGS.get(flag.name) or FLAGS.get(twin(flag.name)) or prefix or GROUPS.get(flag.group)


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    """Adds every Megatron-LM flag the parser does not already define, hidden from --help (the table
    is docs/megatron-compatibility.md). A given one lands in the namespace as DEST_PREFIX + name."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    group = parser.add_argument_group("Megatron-LM flags not built here (docs/megatron-compatibility.md)")
    for flag in megatron_flags():
        if flag.name in actions:
            continue
        same = actions.get(twin(flag.name))
        if same is not None and flag.arity == "switch":  # --disable-x for our --no-x: the same switch
            group.add_argument(flag.name, dest=same.dest, action="store_const",
                               const=False if same.const is None else same.const,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        kwargs = dict(dest=DEST_PREFIX + flag.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if flag.arity == "switch":
            group.add_argument(flag.name, action="store_const", const=True, **kwargs)
        else:
            nargs = {"list": "*", "optional": "?"}.get(flag.arity)
            group.add_argument(flag.name, nargs=nargs, **kwargs)


def given(namespace: argparse.Namespace) -> dict:
    """{flag: value} of the Megatron-LM flags given that our parser does not define."""
    return {dest[len(DEST_PREFIX):]: value for dest, value in vars(namespace).items() if dest.startswith(DEST_PREFIX)}


def check(flags: dict) -> list:
    """Start-up notes for `flags` ({flag: value} from `given`); raises ValueError naming the first
    flag that would change the result and is not implemented."""
    by_name = {flag.name: flag for flag in megatron_flags()}
    notes = []
    for name, value in flags.items():
        rule = treatment(by_name[name])
        if rule is not None and rule.kind == "alias":  # applied by apply_aliases
            continue
        if rule is None or rule.kind == "error":
            reason = rule.text if rule is not None else "it is not implemented"
            raise ValueError(f"{name} (a Megatron-LM flag) is not supported: {reason}")
        if rule.kind == "only":
            values = value if isinstance(value, list) else [value]
            if any(str(v) not in rule.values for v in values):
                raise ValueError(f"{name} {' '.join(map(str, values))} is not supported: {rule.text}; "
                                 f"accepted: {', '.join(rule.values)}")
            continue
        notes.append(f"{name}: {rule.text}")
    return notes


def apply_aliases(flags: dict, values: dict) -> None:
    """Sets in `values` ({field: value} of the parsed flags) what each given older spelling in
    `flags` stands for, as Megatron-LM does (e.g. --recompute-activations is --recompute-granularity
    selective); raises ValueError naming the flag when its value is not of the field's type."""
    by_name = {flag.name: flag for flag in megatron_flags()}
    for name, given_value in flags.items():
        rule = treatment(by_name[name])
        if rule is None or rule.kind != "alias":
            continue
        for field, value in rule.values:
            if isinstance(value, type):  # the flag's own value
                try:
                    value = value(given_value)
                except (TypeError, ValueError):
                    raise ValueError(f"argument {name}: invalid {value.__name__} value: {given_value!r}") from None
            values[field] = value
