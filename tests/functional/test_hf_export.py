"""Hugging Face export end to end: a run trained with a real tokenizer, exported with
tools/checkpoint/convert.py --target-format hf, loads in `transformers` as a whole: AutoTokenizer
encodes as the run's tokenizer did, config.json and generation_config.json carry that tokenizer's
bos/eos/pad ids, `pipeline("text-generation", model=DIR)` generates, and verify_correctness.py
--text runs on it as the docs show."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from megatron.core.tokenizers import build_tokenizer
from tests.functional.test_pretrain_gpt import ROOT, TINY_LLAMA, pretrain_env, run_pretrain
from tests.optional import require_module
from tests.unit.data.conftest import sentencepiece_model  # noqa: F401 (a fixture)

transformers = require_module("transformers")
sys.path.insert(0, str(ROOT / "tools" / "checkpoint"))
import convert  # noqa: E402

TEXT = "The quick brown fox jumps over a lazy dog."


def _tokenizer_flags(kind: str, bpe_dir: str, sentencepiece_model: str) -> list:
    if kind == "GPT2BPETokenizer":
        return ["--tokenizer-type", kind, "--vocab-file", os.path.join(bpe_dir, "vocab.json"),
                "--merge-file", os.path.join(bpe_dir, "merges.txt")]
    return ["--tokenizer-type", kind, "--tokenizer-model", sentencepiece_model]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "Llama2Tokenizer"])
def test_export_loads_as_a_whole_in_transformers(tmp_path, kind, bpe_dir, sentencepiece_model):
    flags = _tokenizer_flags(kind, bpe_dir, sentencepiece_model)
    base = [flag for flag in TINY_LLAMA]
    at = base.index("--tokenizer-type")
    del base[at:at + 4]  # NullTokenizer --vocab-size 255: this run has a real tokenizer
    result = run_pretrain(flags + ["--save", str(tmp_path / "ckpt"), "--train-iters", "2", "--eval-iters", "0"],
                          base=base)
    assert result.returncode == 0, result.stderr[-3000:]
    target = tmp_path / "hf"
    convert.convert(["--source-format", "torch_dist", "--source", str(tmp_path / "ckpt"), "--target-format", "hf",
                     "--target", str(target)])

    ours = build_tokenizer(kind, vocab_file=os.path.join(bpe_dir, "vocab.json"),
                           merge_file=os.path.join(bpe_dir, "merges.txt"), tokenizer_model=sentencepiece_model)
    config = json.loads((target / "config.json").read_text())
    generation = json.loads((target / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == ours.eod
    expected_bos = ours.eod if kind == "GPT2BPETokenizer" else ours.bos
    assert config["bos_token_id"] == generation["bos_token_id"] == expected_bos
    assert generation["pad_token_id"] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the documented path
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(target))
        assert tokenizer(TEXT).input_ids == ours.tokenize(TEXT)
        generator = transformers.pipeline("text-generation", model=str(target))
        out = generator(TEXT, max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith(TEXT)
    check = subprocess.run([sys.executable, str(ROOT / "tools" / "verify_correctness.py"), "--hf", str(target),
                            "--checkpoint", str(tmp_path / "ckpt"), "--text", TEXT, "--tolerance", "1e-4"],
                           capture_output=True, text=True, env=pretrain_env())
    assert check.returncode == 0, check.stdout + check.stderr


def test_missing_transformers_is_one_line_naming_the_extra(tmp_path):
    """Without transformers (hidden by a module that refuses the import): one line, the extra named."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'safetensors'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\")\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = dict(pretrain_env(), PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--source-format", "hf",
                             "--source", str(tmp_path), "--target", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: this conversion needs the `hf` extra, which is not installed (No module named 'transformers'): "
        'pip install -e ".[hf]" (transformers, safetensors, tokenizers, sentencepiece)']
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "verify_correctness.py"), "--hf", str(tmp_path),
                             "--checkpoint", str(tmp_path), "--text", TEXT], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: this comparison needs the `hf` extra, which is not installed (No module named 'transformers'): "
        'pip install -e ".[hf]" (transformers, safetensors, tokenizers, sentencepiece)']
