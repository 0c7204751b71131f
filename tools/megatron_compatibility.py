"""Writes docs/megatron-compatibility.md: every flag of Megatron-LM's pretrain_gpt.py and what this
framework does with it, generated from the parser and megatron/training/megatron_lm (so the table
cannot drift from the code).

    python tools/megatron_compatibility.py           # rewrite the file
    python tools/megatron_compatibility.py --check   # exit 1 if the committed file is stale
"""
import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training import megatron_lm  # noqa: E402
from megatron.training.arguments import build_parser  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "megatron-compatibility.md")
STATUS = {"note": "accepted, with a note", "only": "only {values}", "error": "error"}
HEADER = """\
# Megatron-LM flag compatibility

Every flag of Megatron-LM's `pretrain_gpt.py` and what `pretrain_gpt.py` here does with it. Generated
by `python tools/megatron_compatibility.py` from the parser and `megatron/training/megatron_lm/`;
`tests/unit/test_megatron_compatibility.py` fails when this file differs from what it generates.

- **implemented**: the flag has Megatron-LM's meaning (the text is its `--help`).
- **accepted, with a note**: the run goes on and prints one start-up note saying what runs instead
  (kernel or communication choices, settings that do not change the trained model, flags that are
  deprecated no-ops in Megatron-LM).
- **only `X`**: accepted with the value(s) shown, which are Megatron-LM's defaults; any other value is
  an error.
- **error**: the flag would change the result and is not implemented: the run stops at start-up with
  one line naming the flag and the way out.

"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def native_help() -> dict:
    """{flag: help text} of every flag the config defines."""
    parser = build_parser(megatron_lm_flags=False)
    return {option: action.help for action in parser._actions for option in action.option_strings
            if option.startswith("--")}


def render() -> str:
    ours = native_help()
    flags = megatron_lm.megatron_flags()
    rows = collections.OrderedDict()
    counts = collections.Counter()
    for flag in flags:
        if flag.name in ours:
            status, text = "implemented", ours[flag.name]
        else:
            rule = megatron_lm.treatment(flag)
            status = STATUS[rule.kind].format(values=", ".join(f"`{v}`" for v in rule.values))
            text = rule.text
        counts[status.split(" ")[0]] += 1
        rows.setdefault(flag.group, []).append(f"| `{flag.name}` | {status} | {_cell(text)} |")
    lines = [HEADER.rstrip("\n"), "",
             f"{len(flags)} flags: {counts['implemented']} implemented, {counts['accepted,']} accepted with a note, "
             f"{counts['only']} accepted with Megatron-LM's default value only, {counts['error']} errors.", ""]
    for group, group_rows in rows.items():
        lines += [f"## {group}", "", "| flag | status | here |", "|---|---|---|", *group_rows, ""]
    own = sorted(set(ours) - {flag.name for flag in flags} - {"--help"})
    lines += ["## Flags of this framework's own", "", "| flag | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(ours[name])} |" for name in own]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = open(OUTPUT).read() if os.path.exists(OUTPUT) else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python tools/megatron_compatibility.py", file=sys.stderr)
            return 1
        return 0
    with open(OUTPUT, "w") as handle:
        handle.write(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
