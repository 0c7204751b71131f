"""Every example script of Megatron-LM (NVIDIA d98e8a64) and of Megatron-LM for ROCm (rocm_dev
2b855baf, and the fork's newer scripts in the public code index, each at its own commit), as data:
tests/functional/upstream_scripts/launches.json, written by `python tools/dev/upstream_scripts.py`
(sizes shrunk, paths replaced; an index script not saved for the regeneration is listed as not read). Each launch of pretrain_gpt.py
parses and validates here at its world size, or is refused with the reason listed below, which is
the registry's documented reason or what Megatron-LM itself does with the same command line; every
other script names the entry point it launches (out of scope: BERT, T5, multimodal, inference,
export, post-training) or why it launches nothing."""
import json
from pathlib import Path

import pytest

from megatron.training import megatron_lm
from megatron.training.arguments import parse_args
from megatron.training.megatron_lm.registry import REFUSED_VALUES
from megatron.training.validation import ConfigError, validate

DATA = Path(__file__).resolve().parents[2] / "tests" / "functional" / "upstream_scripts" / "launches.json"
SCRIPTS = json.loads(DATA.read_text())["scripts"]
GPT = [s for s in SCRIPTS if s["entry_point"] == "pretrain_gpt.py"]


def _flag_error(flag: str) -> str:
    rule = megatron_lm.treatment(next(f for f in megatron_lm.megatron_flags() if f.name == flag))
    return f"{flag} (a Megatron-LM flag) is not supported: {rule.text}"


_SC21 = "the following arguments are required: --num-layers"  # CONFIG.sh ships with <placeholders>
# (source, path) -> the text the one-line refusal holds, and why that is right
REFUSED = {
    ("NVIDIA", "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh"):
        _flag_error("--use-megatron-fsdp"),
    ("NVIDIA", "examples/post_training/modelopt/train.sh"):
        f"--tokenizer-type SFTTokenizer is not supported: {REFUSED_VALUES['--tokenizer-type']['SFTTokenizer']}",
    # the unquoted schedule splits into words: Megatron-LM's parser stops at them too
    ("NVIDIA", "examples/gpt3/train_gpt3_175b_distributed.sh"):
        "unrecognized arguments: 2.4B:320 4.8B:624",
    # --rampup-batch-size with --train-iters: Megatron-LM asserts 'expected no batch-size rampup for
    # iteration-based training' too
    ("ROCm", "examples/gpt3/train_gpt3_175b_distributed.sh"):
        "--rampup-batch-size needs sample-based training",
    # flags of Megatron-LM's model-optimizer extension (megatron/post_training), which pretrain_gpt.py
    # adds only with nvidia-modelopt installed; the parsers read for upstream_flags.json do not define them
    ("NVIDIA", "examples/gptoss/02_train.sh"):
        "unrecognized arguments: --export-force-local-attention --enable-gpt-oss",
    # the fork's DeepSeek V3 script: its tokenizer is the one thing refused (with another tokenizer it
    # validates: test_deepseek_v3_validates_with_another_tokenizer)
    ("ROCm-index", "examples/deepseek_v3/train_deepseekv3.sh"):
        f"--tokenizer-type DeepSeekV3Tokenizer is not supported: "
        f"{REFUSED_VALUES['--tokenizer-type']['DeepSeekV3Tokenizer']}",
    **{(source, f"examples/academic_paper_scripts/sc21/{name}.sh"): _SC21
       for source in ("NVIDIA", "ROCm")
       for name in ["SBATCH", "SRUN", "run_table_1"] + [f"run_figure_{n}" for n in range(11, 19)]},
}


def test_every_script_of_both_repositories_is_listed_once():
    keys = [(s["source"], s["path"]) for s in SCRIPTS]
    assert len(keys) == len(set(keys))
    by_source = {r: sum(1 for s in SCRIPTS if s["source"] == r) for r in {s["source"] for s in SCRIPTS}}
    assert by_source["NVIDIA"] > 100 and by_source["ROCm"] > 40 and by_source["ROCm-index"] == 51
    assert {s["commit"] for s in SCRIPTS if s["source"] != "ROCm-index"} == {
        "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "2b855bafe238ab0949d49609131d2da87fb09000"}
    assert set(REFUSED) <= {(s["source"], s["path"]) for s in GPT}


def test_every_other_script_names_its_entry_point_or_why_it_launches_nothing():
    for script in SCRIPTS:
        if script["entry_point"] is None:
            assert script["why"].startswith(("launches no Python program", "not read: ")), script
        elif script["entry_point"] != "pretrain_gpt.py":
            assert "argv" not in script and script["why"].startswith(f"launches {script['entry_point']}, not "), script


@pytest.mark.parametrize("script", GPT, ids=[f"{s['source']}:{s['path']}" for s in GPT])
def test_a_pretrain_gpt_launch_is_a_valid_configuration_or_refused_with_its_reason(script, capsys):
    expected = REFUSED.get((script["source"], script["path"]))
    try:
        validate(parse_args(script["argv"]), script["world_size"])
    except SystemExit:
        message = capsys.readouterr().err
    except ConfigError as error:
        message = str(error)
    else:
        assert expected is None, f"{script['path']} runs, but is listed as refused ({expected})"
        return
    assert expected is not None, f"{script['path']} is refused: {message}"
    assert expected in message


def test_deepseek_v3_validates_with_another_tokenizer():
    """With a tokenizer built here in place of the fork's DeepSeek one, the script's model validates:
    multi-latent attention with its YaRN scaling (--rotary-scaling-factor 40, --mscale, --mscale-all-dim:
    YaRN, as Megatron-LM's multi-latent attention defaults to), shared experts, and
    --moe-router-num-groups 1 without --moe-router-group-topk (no group-limited routing, as in
    Megatron-Core); the fork's own switches are accepted with a note."""
    script = next(s for s in GPT if s["source"] == "ROCm-index" and s["path"].endswith("train_deepseekv3.sh"))
    argv = ["HuggingFaceTokenizer" if word == "DeepSeekV3Tokenizer" else word for word in script["argv"]]
    config = parse_args(argv)
    notes = validate(config, script["world_size"])
    assert config.model.multi_latent_attention and config.model.rotary_scaling_factor == 40
    assert any(note.startswith("--enable-shared-expert") for note in notes)
