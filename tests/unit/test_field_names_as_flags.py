"""The library names config fields in its messages (`num_experts`); the command line's user reads
the flags (--num-experts): `as_flags` spells them where a library error reaches that user (the
start-up checks and the exit handling)."""
import ast
import re
from pathlib import Path

import pytest

from megatron.core.datasets.sft import check_prompt_format
from megatron.training.arguments import as_flags, field_flags
from megatron.training.errors import ConfigError
from megatron.training.reliability.exits import exit_on_error

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`([a-z][a-z0-9_]*)`")


def test_each_named_field_becomes_its_flag_and_other_names_stay():
    message = ("4 is not divisible by 3 (`num_experts` by `expert_model_parallel_size`); `add_bias_linear`, "
               "`fp8`, `padded_vocab_size`, num_experts")
    assert as_flags(message) == ("4 is not divisible by 3 (--num-experts by --expert-model-parallel-size); "
                                 "--disable-bias-linear, --fp8-format, `padded_vocab_size`, num_experts")


def test_a_library_error_reaches_the_command_line_as_flags(capsys):
    with pytest.raises(ValueError, match="`sft_tokenizer_prompt_format` must be one of"):
        check_prompt_format("chatml")

    def main(argv):
        check_prompt_format(argv[0])

    with pytest.raises(SystemExit) as stop:
        exit_on_error(main, ["chatml"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: --sft-tokenizer-prompt-format must be one of ")

    def bad_flags(argv):
        raise ConfigError("`moe_layer_freq` pattern [1] must have one 0 or 1 per layer (`num_layers` 2)")

    with pytest.raises(SystemExit):
        exit_on_error(bad_flags, [])
    assert capsys.readouterr().err == "error: --moe-layer-freq pattern [1] must have one 0 or 1 per layer (--num-layers 2)\n"


def _named_in_core_messages():
    """(file:line, name) of each backquoted name in megatron/core's string literals, docstrings left out."""
    for path in sorted((ROOT / "megatron" / "core").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for name in NAMED.findall(node.value):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", name


def test_every_name_the_library_quotes_in_a_message_is_a_field_with_a_flag():
    """A misspelled field would reach the user in backquotes instead of as a flag."""
    flags = field_flags()
    unknown = [f"{where}: `{name}`" for where, name in _named_in_core_messages() if name not in flags]
    assert unknown == [], "\n".join(unknown)
