"""tools/dev/upstream_flags.py on a file source: a parser file plus the files of the config dataclasses
its ArgumentGroupFactory groups come from, each given with its commit. Small made-up sources stand in
for the ROCm fork's files (the real ones are saved from the public code index, outside the repository)."""
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARSER_COMMIT, CONFIG_COMMIT, BASE_COMMIT = "a" * 40, "b" * 40, "c" * 40

PARSER = '''
import argparse

def add_megatron_arguments(parser):
    parser = _add_network_size_args(parser)
    parser = _add_straggler_detector_args(parser)
    return parser

def _add_network_size_args(parser):
    exclude = ["timers"]
    transformer_factory = ArgumentGroupFactory(TransformerConfig, exclude=exclude)
    transformer_group = transformer_factory.build_group(parser, "transformer configuration")
    group = parser.add_argument_group(title='network size')
    group.add_argument('--swiglu', action='store_true')
    return parser

def _add_straggler_detector_args(parser):
    from megatron.training.resilience_config import StragglerDetectionConfig
    straggler_factory = ArgumentGroupFactory(StragglerDetectionConfig)
    group = straggler_factory.build_group(parser, "straggler")
    return parser
'''
TRANSFORMER_CONFIG = '''
from dataclasses import dataclass, field
from typing import Literal, Optional

@dataclass
class TransformerConfig(ModelParallelConfig):
    num_layers: int = field(default=0, metadata={"argparse_meta": {"default": None}})
    add_bias_linear: bool = field(default=True, metadata={"argparse_meta": {"arg_names": ["--disable-bias-linear"]}})
    attention_backend: AttnBackend = AttnBackend.auto
    moe_flex_dispatcher_backend: Literal['deepep', 'mori'] = "deepep"
    moe_mori_max_tokens_per_rank: Optional[int] = None
'''
MODEL_PARALLEL_CONFIG = '''
from dataclasses import dataclass

@dataclass
class ModelParallelConfig:
    tensor_model_parallel_size: int = 1
    perform_initialization: bool = True
    timers: object = None
'''
ENUMS = '''
import enum

class AttnBackend(enum.Enum):
    flash = 1
    auto = 5
'''
FILES = {"megatron/core/transformer/transformer_config.py": (TRANSFORMER_CONFIG, CONFIG_COMMIT),
         "megatron/core/model_parallel_config.py": (MODEL_PARALLEL_CONFIG, BASE_COMMIT),
         "megatron/core/transformer/enums.py": (ENUMS, BASE_COMMIT)}


@pytest.fixture
def tool(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("upstream_flags", ROOT / "tools" / "dev" / "upstream_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUTPUT", str(tmp_path / "upstream_flags.json"))
    monkeypatch.setattr(module, "SOURCES", {"fork": (PARSER_COMMIT, "a fork's parser file", "file")})
    monkeypatch.setattr(module, "EXTRA_PROVIDERS", {})
    monkeypatch.setattr(module, "DATACLASS_FILES", {"fork": {
        "files": {path: commit for path, (_, commit) in FILES.items()},
        "unread_files": {"megatron/training/resilience_config.py": "not saved"}}})
    return module


def _arguments(tmp_path, commits: dict = None) -> list:
    """NAME=FILE@COMMIT for the parser, NAME:PATH=FILE@COMMIT for each dataclass file."""
    (tmp_path / "arguments.py").write_text(textwrap.dedent(PARSER))
    argv = [f"fork={tmp_path / 'arguments.py'}@{PARSER_COMMIT[:8]}"]
    for index, (path, (text, commit)) in enumerate(FILES.items()):
        saved = tmp_path / f"dataclasses_{index}.py"
        saved.write_text(textwrap.dedent(text))
        argv.append(f"fork:{path}={saved}@{(commits or {}).get(path, commit)[:8]}")
    return argv


def test_a_file_source_reads_the_groups_generated_from_its_dataclass_files(tool, tmp_path):
    assert tool.main(_arguments(tmp_path)) == 0
    document = json.loads((tmp_path / "upstream_flags.json").read_text())
    flags = {flag["name"]: flag for flag in document["flags"]}
    # the factory's rules on the dataclasses (base class first), the exclusions, then the add_argument calls
    assert list(flags) == ["--tensor-model-parallel-size", "--no-perform-initialization",
                           "--disable-perform-initialization", "--num-layers", "--disable-bias-linear",
                           "--attention-backend", "--moe-flex-dispatcher-backend", "--moe-mori-max-tokens-per-rank",
                           "--swiglu"]
    assert flags["--num-layers"]["default"] is None and flags["--num-layers"]["type"] == "int"
    assert flags["--disable-bias-linear"]["action"] == "store_false"
    assert flags["--attention-backend"]["choices"] == ["flash", "auto"]
    assert flags["--moe-flex-dispatcher-backend"]["choices"] == ["deepep", "mori"]
    assert all(flag["sources"] == ["fork"] for flag in flags.values())
    source = document["sources"]["fork"]
    assert source["commit"] == PARSER_COMMIT and source["read_from"] == "file"
    assert source["dataclass_files"] == [{"file": path, "commit": commit} for path, (_, commit) in FILES.items()]
    # the group whose dataclass file was not given stays named, with the file and why
    assert source["unread_groups"] == [{"group": "straggler", "class": "StragglerDetectionConfig"}]
    assert source["unread_files"] == {"megatron/training/resilience_config.py": "not saved"}
    assert f"fork:megatron/core/transformer/transformer_config.py=FILE@{CONFIG_COMMIT}" in document["generated_by"]


def test_every_dataclass_file_is_given_at_its_pinned_commit(tool, tmp_path, capsys):
    argv = _arguments(tmp_path)
    with pytest.raises(SystemExit):
        tool.main(argv[:-1])
    assert "missing fork:megatron/core/transformer/enums.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(_arguments(tmp_path, {"megatron/core/model_parallel_config.py": "d" * 40}))
    assert f"give the file saved at commit {BASE_COMMIT}" in capsys.readouterr().err
    assert not (tmp_path / "upstream_flags.json").exists()
