"""Zero and negative values of every integer flag of the upstream parsers: where Megatron-LM's parser
and validate_args accept the value (the `validated` bounds of upstream_flags.json say where they do
not), this framework accepts it too, or refuses it in one error naming the flag whose reason the
registry documents (INTEGER_MINIMUMS, the flag's own error or only-these-values treatment)."""
import pytest

from megatron.training import megatron_lm
from megatron.training.arguments import build_parser, parse_args
from megatron.training.megatron_lm.integer_bounds import INTEGER_MINIMUMS
from megatron.training.validation import ConfigError, validate

MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]
SAMPLES = ["--train-samples", "12"]  # replaces --train-iters for the sample-based flags
# The companions a flag needs before its value is looked at, as Megatron-LM needs them:
# (flags added, world size, flags of MINIMAL dropped).
COMPANIONS = {
    "--train-samples": ([], 1, ["--train-iters"]),
    "--lr-decay-samples": (SAMPLES, 1, ["--train-iters"]),
    "--lr-warmup-samples": (SAMPLES, 1, ["--train-iters"]),
    "--lr-wsd-decay-samples": (SAMPLES + ["--lr-decay-style", "WSD"], 1, ["--train-iters"]),
    "--lr-wsd-decay-iters": (["--lr-decay-style", "WSD"], 1, []),
    "--ckpt-step": (["--load", "/nonexistent-checkpoint-dir"], 1, []),
    "--expert-model-parallel-size": (["--num-experts", "2"], 1, []),
    "--expert-tensor-parallel-size": (["--num-experts", "2"], 1, []),
    "--moe-router-topk": (["--num-experts", "2"], 1, []),
    "--decoder-first-pipeline-num-layers": (["--pipeline-model-parallel-size", "2"], 2, []),
    "--decoder-last-pipeline-num-layers": (["--pipeline-model-parallel-size", "2"], 2, []),
    "--num-layers-per-virtual-pipeline-stage": (["--pipeline-model-parallel-size", "2", "--num-layers", "4"], 2,
                                                ["--num-layers"]),
    "--num-virtual-stages-per-pipeline-rank": (["--pipeline-model-parallel-size", "2", "--num-layers", "4"], 2,
                                               ["--num-layers"]),
}
# A list flag's value: the one integer put where the flag takes it.
LIST_VALUES = {"--rampup-batch-size": lambda v: ["2", "2", v]}


def _without(flags: list, dropped: list) -> list:
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in dropped:
            skip = True
        else:
            kept.append(flag)
    return kept


def _upstream_refuses(entry, value: int) -> bool:
    """Whether every upstream run refuses the value: outside the flag's choices, or below a bound
    that upstream's validate_args asserts on every start."""
    if entry.choices is not None and value not in entry.choices and str(value) not in map(str, entry.choices):
        return True
    bound = entry.validated
    return bound is not None and bound["when"] is None and value < bound["minimum"]


def _cases() -> list:
    cases = []
    for flag in megatron_lm.megatron_flags():
        if flag.type != "int" or flag.arity == "switch":
            continue
        cases += [(flag.name, value) for value in (0, -1) if not _upstream_refuses(flag, value)]
    return cases


def _command_line(flag: str, value: int) -> tuple:
    added, world, dropped = COMPANIONS.get(flag, ([], 1, []))
    if flag == "--rampup-batch-size":
        added, dropped = SAMPLES + ["--global-batch-size", "8"], ["--train-iters"]
    values = LIST_VALUES.get(flag, lambda v: [v])(str(value))
    base = _without(MINIMAL, dropped + [flag])
    return base + added + [flag, *values], world


def _documented(flag: str, value: int, message: str) -> bool:
    """Whether the registry gives the reason of this refusal."""
    ours = {o for a in build_parser(megatron_lm_flags=False)._actions for o in a.option_strings}
    entry = next(f for f in megatron_lm.megatron_flags() if f.name == flag)
    rule = None if flag in ours else megatron_lm.treatment(entry)
    if rule is not None and rule.kind == "error":
        return f"{flag} (a Megatron-LM flag) is not supported: {rule.text}" in message
    if rule is not None and rule.kind == "only":
        return str(value) not in rule.values and f"{flag} {value} is not supported: {rule.text}" in message
    minimum = INTEGER_MINIMUMS.get(flag)
    return minimum is not None and value < minimum[0] and flag in message and str(value) in message


def test_the_cases_cover_the_integer_flags_this_framework_defines():
    flags = {flag for flag, _ in _cases()}
    assert len(flags) > 200 and {"--eval-iters", "--save-interval", "--exit-interval", "--num-layers"} <= flags


@pytest.mark.parametrize("flag, value", _cases())
def test_zero_and_negative_integers_upstream_accepts(flag, value, capsys):
    argv, world = _command_line(flag, value)
    try:
        validate(parse_args(argv), world)
    except SystemExit:
        pytest.fail(f"{flag} {value}: the parser refuses it: {capsys.readouterr().err.strip()}")
    except ConfigError as error:
        assert _documented(flag, value, str(error)), (
            f"{flag} {value} is accepted by Megatron-LM's parser and validation but refused here without a reason "
            f"in the registry: {error}")
        return
    minimum = INTEGER_MINIMUMS.get(flag)
    assert minimum is None or value >= minimum[0], f"{flag} {value} runs, but INTEGER_MINIMUMS says it is refused"


def test_upstream_bounds_are_read_from_validate_args():
    """The bounds come from upstream's asserts: unconditional ones skip the value, conditional ones
    (--save-interval > 0 only with --save) do not."""
    flags = {f.name: f for f in megatron_lm.megatron_flags()}
    assert flags["--micro-batch-size"].validated == {"minimum": 1, "when": None}
    assert flags["--save-interval"].validated == {"minimum": 1, "when": "(args.save is not None)"}
    assert ("--save-interval", 0) in _cases() and ("--micro-batch-size", 0) not in _cases()


def test_save_interval_without_save_is_any_integer_and_checked_with_save():
    validate(parse_args(MINIMAL + ["--save-interval", "0"]), 1)
    with pytest.raises(ConfigError, match="--save-interval must be positive, got 0"):
        validate(parse_args(MINIMAL + ["--save-interval", "0", "--save", "/tmp/unused-save-dir"]), 1)
