"""Megatron-LM's pretrain_gpt.py flags: every one has a status, the generated table is the committed
one, and each kind of treatment does what the table says."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training import megatron_lm
from megatron.training.arguments import build_parser, parse_args
from megatron.training.megatron_lm.registry import FLAGS, GROUPS, PREFIXES, REFUSED_VALUES
from megatron.training.validation import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
           "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128"]


def test_committed_table_is_the_generated_one():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "megatron_compatibility.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr + " (regenerate: python tools/megatron_compatibility.py)"


def _ours() -> set:
    return {o for a in build_parser(megatron_lm_flags=False)._actions for o in a.option_strings}


def test_the_upstream_flag_file_is_pinned_and_complete():
    """The three parsers, each at a full commit; every flag says which parser defines it. The ROCm
    fork's newest parser is read from its file and the files of the config dataclasses it generates
    groups from (each at its own full commit); the groups whose file is missing are named as not read."""
    sources = megatron_lm.upstream_sources()
    assert set(sources) == {"NVIDIA", "ROCm", "ROCm-dbdea573"}
    assert all(re.fullmatch(r"[0-9a-f]{40}", info["commit"]) for info in sources.values())
    fork = sources["ROCm-dbdea573"]
    assert fork["read_from"] == "file"
    files = {f["file"]: f["commit"] for f in fork["dataclass_files"]}
    assert {"megatron/core/transformer/transformer_config.py", "megatron/training/training_config.py"} <= set(files)
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for commit in files.values())
    unread = {g["class"] for g in fork["unread_groups"]}
    assert unread == {"StragglerDetectionConfig", "RerunStateMachineConfig"} and fork["unread_files"]
    flags = {f.name: f for f in megatron_lm.megatron_flags()}
    upstream = [f for f in flags.values() if f.sources]
    assert len(upstream) > 800 and all(set(f.sources) <= set(sources) for f in upstream)
    assert flags["--disable-te-fused-rope"].sources == ("ROCm", "ROCm-dbdea573")  # the fork's own
    assert flags["--keep-fp8-weight-transpose-cache-te"].sources == ("ROCm-dbdea573",)
    assert flags["--fused-single-qkv-rope"].sources == ()  # passed by the fork's script, defined by no parser read
    assert flags["--rl-partial-rollouts"].arity == flags["--no-rl-partial-rollouts"].arity == "switch"
    # the fork's pretrain_gpt.py adds its PAI-Megatron-Patch group, which also offers --optimizer hybridadam
    assert flags["--max-padding-length"].group == "patch" and flags["--max-padding-length"].sources == (
        "ROCm-dbdea573",)
    assert "hybridadam" in flags["--optimizer"].choices
    assert flags["--dataloader-type"].choices == ("single", "cyclic", "external")
    assert flags["--eval-iters"].default == 100 and flags["--eval-iters"].type == "int"
    # read from the fork's TransformerConfig, LoggerConfig and CheckpointConfig (its dataclass files)
    assert flags["--moe-mori-max-tokens-per-rank"].sources == ("ROCm-dbdea573",)
    assert "mori" in flags["--moe-flex-dispatcher-backend"].choices
    assert "ROCm-dbdea573" in flags["--num-layers"].sources and "ROCm-dbdea573" in flags["--log-interval"].sources
    assert flags["--save-interval"].sources == ("NVIDIA", "ROCm", "ROCm-dbdea573")


def test_every_megatron_flag_is_implemented_or_treated():
    ours = _ours()
    flags = megatron_lm.megatron_flags()
    assert len(flags) == len({f.name for f in flags}) > 800
    untreated = [f.name for f in flags if f.name not in ours and megatron_lm.twin(f.name) not in ours
                 and megatron_lm.treatment(f) is None]
    assert untreated == []


def _choice_cases() -> list:
    """(flag, value) for every choice an upstream parser offers, except on flags that are errors here
    and values outside an `only` treatment (both refused with their reason by design)."""
    ours, cases = _ours(), []
    for flag in megatron_lm.megatron_flags():
        rule = None if flag.name in ours else megatron_lm.treatment(flag)
        if not flag.choices or (rule is not None and rule.kind == "error"):
            continue
        cases += [(flag.name, str(value)) for value in flag.choices
                  if rule is None or rule.kind != "only" or str(value) in rule.values]
    return cases


@pytest.mark.parametrize("flag, value", _choice_cases())
def test_every_value_upstream_accepts_is_accepted_or_refused_with_its_reason(flag, value, capsys):
    """Either the run goes on, or the value is in REFUSED_VALUES and the one-line error gives that
    reason, or validation asks for the value's companion flag (as Megatron-LM does)."""
    reason = REFUSED_VALUES.get(flag, {}).get(value)
    try:
        _validate([flag, value])
    except SystemExit:
        assert reason is not None, f"{flag} {value}: refused by the parser without a reason in REFUSED_VALUES"
        assert f"{flag} {value} is not supported: {reason}" in capsys.readouterr().err
        return
    except ConfigError as error:
        assert reason is not None or " needs " in str(error), f"{flag} {value}: refused without a reason: {error}"
        return
    assert reason is None, f"{flag} {value} is listed as refused but runs"


# Features a note or error text may call absent, and the flag that builds each here: a text claiming
# one of them is "not built" or "not supported" while its flag exists is false.
FEATURE_FLAGS = {"FP8": "--fp8-format", "mixture-of-experts": "--num-experts", "sliding-window": "--window-size",
                 "context parallelism": "--context-parallel-size", "Megatron-FSDP": "--use-megatron-fsdp",
                 "distributed optimizer": "--use-distributed-optimizer", "Llama 3.1 scaling": "--use-rope-scaling",
                 "muP": "--use-mup", "multi-token prediction": "--mtp-num-layers",
                 "multi-latent attention": "--multi-latent-attention", "Muon": "--optimizer muon",
                 "cyclic": "--dataloader-type cyclic"}


def _texts() -> list:
    texts = [(name, rule.text) for name, rule in {**FLAGS, **PREFIXES, **GROUPS}.items()]
    return texts + [(f"{flag} {value}", reason) for flag, values in REFUSED_VALUES.items()
                    for value, reason in values.items()]


def _exists(spec: str) -> bool:
    """Whether the flag (and value, if given) is implemented here."""
    flag, _, value = spec.partition(" ")
    actions = {o: a for a in build_parser(megatron_lm_flags=False)._actions for o in a.option_strings}
    if flag not in actions:
        return False
    return not value or actions[flag].choices is None or value in actions[flag].choices


def test_no_note_or_error_calls_absent_what_is_built():
    """A claim is a clause that starts with the feature's name and says it 'is/are not built' (or
    supported, implemented)."""
    false_claims = []
    for name, text in _texts():
        for feature, spec in FEATURE_FLAGS.items():
            claim = (rf"(?:^|[;:(]\s*)(?:the\s+)?{re.escape(feature)}\b[\w\s/-]{{0,20}}"
                     r"\b(is|are) not (built|supported|implemented)")
            if re.search(claim, text, re.IGNORECASE) and _exists(spec):
                false_claims.append(f"{name}: '{text}' but {spec} exists")
    assert false_claims == []


def test_older_spellings_set_what_megatron_lm_sets():
    config = parse_args(MINIMAL + ["--recompute-activations", "--use-rotary-position-embeddings"])
    assert config.training.recompute_granularity == "selective"
    assert config.model.position_embedding_type == "rope"
    assert not [n for n in validate(config, 1) if n.startswith("--recompute-activations")]


def test_the_rocm_forks_transformer_config_spellings_set_what_megatron_lm_sets(capsys):
    """The fork's TransformerConfig spells two pipeline options after their fields; each sets the
    option that NVIDIA's spelling sets, the value one with the given value (a bad one is one line)."""
    pipeline = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                "1"]
    config = parse_args(_without_layers(MINIMAL) + pipeline + ["--overlap-p2p-comm-warmup-flush",
                                                               "--microbatch-group-size-per-vp-stage", "3"])
    assert config.parallel.overlap_p2p_comm_warmup_flush is True
    assert config.parallel.microbatch_group_size_per_vp_stage == 3
    assert parse_args(MINIMAL).parallel.microbatch_group_size_per_vp_stage is None
    with pytest.raises(SystemExit):
        parse_args(MINIMAL + ["--microbatch-group-size-per-vp-stage", "three"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "argument --microbatch-group-size-per-vp-stage: invalid int value: 'three'" in err[0] and len(err) == 2


def _without_layers(argv: list) -> list:
    at = argv.index("--num-layers")
    return argv[:at] + argv[at + 2:]


def test_the_disable_spelling_is_the_same_switch():
    assert parse_args(MINIMAL + ["--disable-manual-gc-eval"]).training.manual_gc_eval is False
    assert parse_args(MINIMAL).training.manual_gc_eval is True


def test_the_rocm_forks_own_flags_run_with_notes():
    notes = _validate(["--fused-single-qkv-rope", "--disable-te-fused-rope", "--keep-fp8-weight-transpose-cache-te",
                       "--use-contiguous-parameters-in-local-ddp"])
    assert [n.split(":")[0] for n in notes if n.startswith("--")] == [
        "--fused-single-qkv-rope", "--disable-te-fused-rope", "--keep-fp8-weight-transpose-cache-te",
        "--use-contiguous-parameters-in-local-ddp"]


@pytest.mark.parametrize("flags, expected", [
    (["--fp8-interval", "1"], "note"), (["--fp8-param-gather"], "note"),
    (["--no-fp8-wgrad"], "error"), (["--fp4-format", "e2m1"], "error"),
])
def test_the_transformer_engine_group_follows_what_is_built(flags, expected):
    if expected == "note":
        assert any(n.startswith(flags[0] + ":") for n in _validate(flags))
    else:
        with pytest.raises(ConfigError, match=flags[0]):
            _validate(flags)


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
    (["--moe-use-upcycling"], "--moe-use-upcycling (a Megatron-LM flag) is not supported: upcycling"),
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
    assert "docs/megatron-compatibility.md" in out and "--moe-use-upcycling" not in out


@pytest.mark.parametrize("flags, note", [
    (["--save-interval", "20"], "--save-interval without --save: no checkpoint is saved (as in Megatron-LM)"),
    (["--async-save"], "--async-save without --save: no checkpoint is saved (as in Megatron-LM)"),
    (["--eval-iters", "-1"], "--eval-iters -1: no evaluation (as in Megatron-LM"),
    (["--exit-interval", "0"], "--exit-interval 0: off (as in Megatron-LM)"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins 0: off (as in Megatron-LM)"),
])
def test_what_megatron_lm_accepts_without_its_companion_runs_with_a_note(flags, note):
    """The ROCm fork's train_llama3.sh passes --save-interval with its --save line commented out,
    and --eval-iters -1: Megatron-LM saves nothing and evaluates nothing, and so does this framework."""
    assert any(n.startswith(note) for n in _validate(flags))


def test_negative_eval_iters_asks_for_no_evaluation_samples():
    from megatron.training.state import batch_schedule
    from megatron.training.training import dataset_sizes

    config = parse_args(MINIMAL + ["--eval-iters", "-1", "--eval-interval", "1"])
    validate(config, 1)
    assert dataset_sizes(config, batch_schedule(config.training, 1)) == (6, 0, 0)
