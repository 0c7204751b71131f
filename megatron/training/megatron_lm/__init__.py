"""Megatron-LM's pretrain_gpt.py flags: the list (`pretrain_gpt_flags.txt`), how the ones this
framework does not define are treated (`registry.py`), and their place in the command line.

Every flag of the list parses. One our config defines is implemented; any other is added to the
parser here, so that a Megatron-LM launch script is read whole: `check` then turns what was given
into start-up notes, or into one error naming the flag.
"""
import argparse
import os
from dataclasses import dataclass
from typing import Optional

from megatron.training.megatron_lm.registry import FLAGS, GROUPS, Treatment

LIST_FILE = os.path.join(os.path.dirname(__file__), "pretrain_gpt_flags.txt")
DEST_PREFIX = "megatron_lm:"


@dataclass(frozen=True)
class MegatronFlag:
    name: str     # "--num-layers"
    group: str    # Megatron-LM's argument group
    arity: str    # "switch", "value" or "list"


def megatron_flags() -> list:
    """Every flag of Megatron-LM's pretrain_gpt.py, in its order."""
    flags, group = [], None
    with open(LIST_FILE) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                group = line.strip("[]")
                continue
            name, _, value = line.partition("=")
            arity = "switch" if not value else ("list" if value.endswith("...") else "value")
            flags.append(MegatronFlag(name, group, arity))
    return flags


def treatment(flag: MegatronFlag) -> Optional[Treatment]:
    """The registry's treatment of a flag our parser does not define (its own, else its group's)."""
    return FLAGS.get(flag.name) or GROUPS.get(flag.group)


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    """Adds every Megatron-LM flag the parser does not already define, hidden from --help (the table
    is docs/megatron-compatibility.md). A given one lands in the namespace as DEST_PREFIX + name."""
    defined = {option for action in parser._actions for option in action.option_strings}
    group = parser.add_argument_group("Megatron-LM flags not built here (docs/megatron-compatibility.md)")
    for flag in megatron_flags():
        if flag.name in defined:
            continue
        kwargs = dict(dest=DEST_PREFIX + flag.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if flag.arity == "switch":
            group.add_argument(flag.name, action="store_const", const=True, **kwargs)
        else:
            group.add_argument(flag.name, nargs="*" if flag.arity == "list" else None, **kwargs)


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
