"""tools/dev/upstream_scripts.py on the ROCm fork's scripts saved from the public code index: each runs
in a copy of the saved folder with the launchers stood in, and its pretrain_gpt.py launch is recorded
with the sizes shrunk; a script that checks for the fork's pretrain_gpt.py before launching it finds
the stand-in; one that starts its training in a container says so. Made-up scripts stand in for the
fork's."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "e" * 40
CHECKING = """#!/bin/bash
PRETRAIN_SCRIPT_PATH="pretrain_gpt.py"
if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Error: pretrain_gpt.py not found at $PRETRAIN_SCRIPT_PATH"
    exit 1
fi
TP=${TP:-2}
torchrun --nproc_per_node 8 --nnodes 1 "$PRETRAIN_SCRIPT_PATH" --num-layers 32 --hidden-size 4096 \\
    --num-attention-heads 32 --tensor-model-parallel-size $TP --save /checkpoints/run
"""
CONTAINER = """#!/bin/bash
if docker ps; then export container_command=docker; else exit 1; fi
srun bash -c '${container_command} exec training_env bash -c "bash examples/llama/train_llama2.sh"'
"""


@pytest.fixture
def tool(monkeypatch):
    spec = importlib.util.spec_from_file_location("upstream_scripts", ROOT / "tools" / "dev" / "upstream_scripts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROCM_INDEX", {"examples/llama/train_checking.sh": COMMIT,
                                               "examples/llama/not_saved.sh": COMMIT,
                                               "examples/llama/train_in_container.sh": COMMIT})
    return module


def test_saved_scripts_are_read_as_they_launch(tool, tmp_path):
    script = tmp_path / "examples" / "llama" / "train_checking.sh"
    script.parent.mkdir(parents=True)
    script.write_text(CHECKING)
    (script.parent / "train_in_container.sh").write_text(CONTAINER)
    unread, read, container = tool.read_saved("ROCm-index", str(tmp_path))  # sorted by path
    assert read["path"] == "examples/llama/train_checking.sh" and read["commit"] == COMMIT
    assert read["entry_point"] == "pretrain_gpt.py", read
    assert read["argv"] == ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
                            "--tensor-model-parallel-size", "2", "--save", "PATH1"]
    assert read["world_size"] == 2 and read["script_world_size"] == 8
    assert unread["path"] == "examples/llama/not_saved.sh" and unread["why"].startswith("not read: ")
    assert not (tmp_path / "pretrain_gpt.py").exists()  # the stand-in lives in the scratch copy only
    assert container["entry_point"] is None
    assert container["why"] == ("launches no Python program here: it starts its training in a container "
                                "(docker exec), which is not run")
