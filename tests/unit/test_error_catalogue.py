"""docs/errors.md is true: its flags table runs as written, every test it names exists, and the
mistakes that need more than flags have their tests here."""
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from megatron.core.checkpointing import CheckpointFormatError
from megatron.training import validation
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import read_common, read_tracker
from megatron.training.validation import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "docs" / "errors.md"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3"]
DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
DATA_FLAGS = {"--mock-data", "--data-path", "--train-data-path", "--tokenizer-type", "--vocab-size"}


def _cells(line: str) -> list:
    """The cells of a Markdown table row (`\\|` is a | inside a cell), without backticks."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [cell.strip().replace("\\|", "|").strip("`") for cell in cells]


def flag_rows() -> list:
    """(flags, ranks, message) of the first table under 'Flags and the parallel layout'."""
    text = CATALOGUE.read_text()
    section = text[text.index("## Flags and the parallel layout"):]
    table = section[section.index("| flags | ranks | message |"):section.index("Checks that need more than flags")]
    rows = [_cells(line) for line in table.splitlines()[2:] if line.startswith("|")]
    return [(shlex.split(flags), int(ranks), message) for flags, ranks, message in rows]


@pytest.mark.parametrize("flags, ranks, message", flag_rows(), ids=lambda value: str(value)[:40])
def test_flag_errors_in_the_catalogue(flags, ranks, message):
    data = [] if DATA_FLAGS & set(flags) else DATA
    with pytest.raises(ConfigError) as raised:
        validate(parse_args(MODEL + data + flags), ranks)
    assert message in str(raised.value)


def test_every_test_the_catalogue_names_exists():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`((?:, `::\w+`)*)", CATALOGUE.read_text())
    assert len(named) > 40
    for path, name, more in named:
        source = (ROOT / path).read_text()
        for test in [name] + re.findall(r"::(\w+)", more):
            assert re.search(rf"^def {test}\(", source, re.M), f"{path}::{test} is named in docs/errors.md but missing"


def test_model_flags_without_a_checkpoint_to_take_them_from(tmp_path):
    config = parse_args(MODEL[2:] + DATA + ["--use-checkpoint-args", "--load", str(tmp_path / "none")])
    with pytest.raises(ConfigError, match=r"--num-layers is required \(--use-checkpoint-args found no checkpoint to "
                                          r"take it from\)"):
        validate(config, 1)


def test_save_directory_that_cannot_be_written(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=f"--save {a_file} exists and is not a directory"):
        validate(parse_args(MODEL + DATA + ["--save", str(a_file)]), 1)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root could write anywhere
    with pytest.raises(ConfigError, match=f"--save {tmp_path / 'new' / 'ckpt'}: {tmp_path} is not writable"):
        validate(parse_args(MODEL + DATA + ["--save", str(tmp_path / "new" / "ckpt")]), 1)


def test_missing_packages_are_named(monkeypatch):
    real_find_spec = validation.importlib.util.find_spec
    monkeypatch.setattr(validation.importlib.util, "find_spec",
                        lambda name: None if name == "tensorboard" else real_find_spec(name))
    with pytest.raises(ConfigError, match="--tensorboard-dir needs the tensorboard package, which is not installed: "
                                          "pip install tensorboard"):
        validate(parse_args(MODEL + DATA + ["--tensorboard-dir", "tb"]), 1)
    # --profile without a GPU is not an error: the PyTorch profiler records instead (a start-up note).
    monkeypatch.setattr(validation, "_cuda_available", lambda: False)
    config = parse_args(MODEL + DATA + ["--profile", "--profile-step-start", "1", "--profile-step-end", "2"])
    assert any("the PyTorch profiler records instead" in note for note in validate(config, 1))


def test_checkpoint_files_that_are_not_ours(tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("release")
    with pytest.raises(ConfigError, match="says 'release': that is a Megatron-LM checkpoint; import it with "
                                          "tools/checkpoint/convert.py --source-format megatron"):
        read_tracker(str(tmp_path))
    tracker.write_text("twelve")
    with pytest.raises(ConfigError, match="holds 'twelve', not an iteration number; fix or delete the file"):
        read_tracker(str(tmp_path))
    common = tmp_path / "common.json"
    with pytest.raises(CheckpointFormatError, match="common.json is missing: .* is not a complete checkpoint"):
        read_common(str(tmp_path))
    common.write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=r"common.json is corrupt \("):
        read_common(str(tmp_path))
    common.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointFormatError, match="is not a megatron-lite torch_dist checkpoint"):
        read_common(str(tmp_path))
    common.write_text(json.dumps({"format": "megatron-lite torch_dist", "version": 2}))
    with pytest.raises(CheckpointFormatError, match="has format version 2; this version reads up to 1: upgrade"):
        read_common(str(tmp_path))
