"""tools/verify_correctness.py on mixture-of-experts exports: a tiny Mixtral, a tiny Qwen3-MoE
(with a dense first layer) and a tiny Qwen2-MoE (shared expert and its gate), built with `transformers` and saved with save_pretrained, go through
tools/checkpoint/convert.py into this framework's format and back out to Hugging Face; the tool,
run as users run it, compares our checkpoint with `transformers` on the export and on the
original directory, and must find the logits within 1e-4 and the losses equal."""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from tests.functional.test_pretrain_gpt import ROOT  # noqa: E402
from tests.unit.test_checkpoint_convert import _weights, convert  # noqa: E402
from tests.unit.test_hf_moe import VOCAB, mixtral, qwen2_moe, qwen3_moe  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402

TOLERANCE = 1e-4
CASES = {"mixtral": (mixtral, transformers.MixtralForCausalLM),
         "qwen3_moe": (qwen3_moe, transformers.Qwen3MoeForCausalLM),
         "qwen2_moe": (qwen2_moe, transformers.Qwen2MoeForCausalLM)}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("tokens") / "tokens")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(np.random.default_rng(0).integers(0, VOCAB, 200))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def verify(hf_dir, checkpoint, token_file) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "verify_correctness.py"), "--hf", str(hf_dir), "--checkpoint",
         str(checkpoint), "--data-path", token_file, "--num-samples", "2", "--seq-length", "24", "--tolerance",
         str(TOLERANCE)], capture_output=True, text=True, timeout=300)


def _figures(output: str) -> tuple:
    difference = float(re.search(r"max \|logit difference\|: (\S+)", output).group(1))
    ours = float(re.search(r"loss \(this framework\): (\S+)", output).group(1))
    theirs = float(re.search(r"loss \(Hugging Face\): +(\S+)", output).group(1))
    return difference, ours, theirs


@pytest.mark.parametrize("case", list(CASES))
def test_verify_correctness_on_moe_export(case, tmp_path, token_file):
    make_config, cls = CASES[case]
    torch.manual_seed(0)
    randomize(cls(make_config())).save_pretrained(tmp_path / "hf")
    ours, export = tmp_path / "ours", tmp_path / "export"
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(ours)])
    convert.convert(["--source-format", "torch_dist", "--source", str(ours), "--target-format", "hf",
                     "--target", str(export)])
    original, exported = _weights(tmp_path / "hf"), _weights(export)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    for hf_dir in (export, tmp_path / "hf"):
        result = verify(hf_dir, ours, token_file)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Warning" not in result.stderr, result.stderr
        difference, loss, hf_loss = _figures(result.stdout)
        assert difference < TOLERANCE
        assert loss == pytest.approx(hf_loss, rel=1e-5)


def test_verify_correctness_fails_on_a_wrong_expert(tmp_path, token_file):
    """The tool tells a broken MoE checkpoint: one expert of our copy swapped with another."""
    from megatron.core.checkpointing.conversion import read_weights, write_weights

    torch.manual_seed(0)
    randomize(transformers.MixtralForCausalLM(mixtral())).save_pretrained(tmp_path / "hf")
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(tmp_path / "ours")])
    logical, config, vocab_size, _ = read_weights(str(tmp_path / "ours"))
    fc1 = logical["decoder.layers.0.mlp.experts.fc1_weight"]
    fc1["gate"] = fc1["gate"][[1, 0, 2, 3]]
    write_weights(str(tmp_path / "broken"), logical, config, vocab_size)
    result = verify(tmp_path / "hf", tmp_path / "broken", token_file)
    assert result.returncode == 1 and "FAIL: the logits differ by more than --tolerance" in result.stdout
