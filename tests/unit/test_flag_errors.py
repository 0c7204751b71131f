"""A flag mistake reads in one line: `pretrain_gpt.py: error: ...` and a pointer to --help, never
argparse's usage; an unknown flag names the closest known one; ranks other than each node's first
stay silent, since every rank hits the same error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]


def _parse_error(capsys, argv: list, local_rank: str = "0") -> str:
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = local_rank
    try:
        with pytest.raises(SystemExit) as stop:
            parse_args(MINIMAL + argv)
    finally:
        if old is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = old
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize("argv, message", [
    (["--save-intreval", "20"], "unrecognized arguments: --save-intreval (did you mean --save-interval?)"),
    (["--save_interval=20"], "unrecognized arguments: --save_interval (did you mean --save-interval?)"),
    (["--tensor-model-paralel-size", "2"],
     "unrecognized arguments: --tensor-model-paralel-size (did you mean --tensor-model-parallel-size?)"),
    (["--no-such-flag-at-all"], "unrecognized arguments: --no-such-flag-at-all"),
    (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
])
def test_a_flag_error_is_one_line_and_a_pointer_to_help(capsys, argv, message):
    lines = _parse_error(capsys, argv).splitlines()
    assert lines == [f"{Path(sys.argv[0]).name}: error: {message}",
                     f"{Path(sys.argv[0]).name}: see {Path(sys.argv[0]).name} --help for the flags"]


def test_a_megatron_lm_flag_is_suggested_too(capsys):
    """The hidden Megatron-LM flags are known flags: a typo of one is matched to it."""
    assert "(did you mean --use-mcore-models?)" in _parse_error(capsys, ["--use-mcore-model"])


def test_only_the_first_rank_of_a_node_prints(capsys):
    assert _parse_error(capsys, ["--save-intreval", "20"], local_rank="1") == ""


@pytest.mark.parametrize("local_rank, printed", [("0", 1), ("1", 0)])
def test_a_validation_error_is_one_line_from_the_first_rank(local_rank, printed):
    result = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *MINIMAL, "--hidden-size", "66"],
                            capture_output=True, text=True, env=dict(os.environ, LOCAL_RANK=local_rank), cwd=ROOT)
    assert result.returncode == 2
    expected = "error: --hidden-size (66) must be divisible by --num-attention-heads (4), or pass --kv-channels\n"
    assert result.stderr == expected * printed
