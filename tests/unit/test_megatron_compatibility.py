"""Megatron-LM's pretrain_gpt.py flags: every one has a status, the generated table is the committed
one, and each kind of treatment does what the table says."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training import megatron_lm
from megatron.training.arguments import build_parser, parse_args
from megatron.training.megatron_lm.registry import FLAGS, GROUPS
from megatron.training.validation import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]


def test_committed_table_is_the_generated_one():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "megatron_compatibility.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr + " (regenerate: python tools/megatron_compatibility.py)"


def test_every_megatron_flag_is_implemented_or_treated():
    ours = {o for a in build_parser(megatron_lm_flags=False)._actions for o in a.option_strings}
    flags = megatron_lm.megatron_flags()
    assert len(flags) == len({f.name for f in flags}) > 500
    untreated = [f.name for f in flags if f.name not in ours and megatron_lm.treatment(f) is None]
    assert untreated == []


def test_registry_names_only_megatron_flags_and_groups():
    flags = megatron_lm.megatron_flags()
    assert set(FLAGS) <= {f.name for f in flags}
    assert set(GROUPS) <= {f.group for f in flags}


def _validate(extra: list) -> list:
    return validate(parse_args(MINIMAL + extra), 1)


def test_a_noted_flag_trains_with_one_note():
    notes = _validate(["--use-mcore-models", "--attention-softmax-in-fp32", "--tp-comm-overlap-cfg", "x.yaml",
                       "--recompute-modules", "core_attn"])
    assert [n.split(":")[0] for n in notes if n.startswith("--")] == [
        "--use-mcore-models", "--attention-softmax-in-fp32", "--tp-comm-overlap-cfg"]


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "8"], "--num-experts (a Megatron-LM flag) is not supported: mixture-of-experts"),
    (["--fp32-residual-connection"], "--fp32-residual-connection (a Megatron-LM flag) is not supported"),
    (["--recompute-modules", "core_attn", "mlp"], "--recompute-modules core_attn mlp is not supported"),
    (["--softmax-type", "off-by-one"], "--softmax-type off-by-one is not supported: only the standard softmax"),
])
def test_a_flag_that_would_change_the_result_is_an_error_naming_it(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        _validate(flags)


def test_no_position_embedding_goes_with_rope_only():
    assert any(n.startswith("--no-position-embedding") for n in _validate(
        ["--position-embedding-type", "rope", "--no-position-embedding"]))
    with pytest.raises(ConfigError, match="--no-position-embedding is deprecated"):
        _validate(["--no-position-embedding"])


def test_megatron_default_values_are_accepted():
    assert not [n for n in _validate(["--softmax-type", "vanilla", "--dataloader-type", "single"]) if n.startswith("--")]


def test_hidden_from_help_but_help_points_to_the_table(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "docs/megatron-compatibility.md" in out and "--num-experts" not in out


@pytest.mark.parametrize("flags, note", [
    (["--save-interval", "20"], "--save-interval without --save: no checkpoint is saved (as in Megatron-LM)"),
    (["--async-save"], "--async-save without --save: no checkpoint is saved (as in Megatron-LM)"),
    (["--eval-iters", "-1"], "--eval-iters -1: no evaluation (as in Megatron-LM"),
])
def test_what_megatron_lm_accepts_without_its_companion_runs_with_a_note(flags, note):
    """The ROCm fork's train_llama3.sh passes --save-interval with its --save line commented out,
    and --eval-iters -1: Megatron-LM saves nothing and evaluates nothing, and so does this framework."""
    assert any(n.startswith(note) for n in _validate(flags))


def test_negative_eval_iters_asks_for_no_evaluation_samples():
    from megatron.training.batch_schedule import batch_schedule
    from megatron.training.training import dataset_sizes

    config = parse_args(MINIMAL + ["--eval-iters", "-1", "--eval-interval", "1"])
    validate(config, 1)
    assert dataset_sizes(config, batch_schedule(config.training, 1)) == (6, 0, 0)
