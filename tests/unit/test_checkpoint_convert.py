"""tools/checkpoint/convert.py and tools/verify_correctness.py against real `transformers` models
(tiny, random, saved with save_pretrained): Hugging Face -> this framework -> Hugging Face gives
identical tensors and config, the converted checkpoint's logits equal the HF model's, and training
continues from it with --finetune --use-checkpoint-args."""
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")
safetensors_torch = require_module("safetensors.torch")

from tests.functional.test_pretrain_gpt import ROOT, run_pretrain  # noqa: E402
from tests.unit.test_hf_parity import gpt2_config, llama_config, randomize  # noqa: E402


def _tool(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem + "_tool", ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _tool("tools/checkpoint/convert.py")
verify = _tool("tools/verify_correctness.py")

MODELS = {
    "llama3.1-gqa": lambda: transformers.LlamaForCausalLM(llama_config(
        vocab_size=1000, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "llama2-tied": lambda: transformers.LlamaForCausalLM(llama_config(vocab_size=1000, tie=True)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config(vocab_size=1000)),
}


def _weights(directory: Path) -> dict:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(safetensors_torch.load_file(str(file)))
    return state


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("tokens") / "tokens")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(np.random.default_rng(0).integers(0, 1000, 200))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_round_trip_is_identical_and_logits_match(tmp_path, name, token_file):
    torch.manual_seed(0)
    model = MODELS[name]()
    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    ours, back = tmp_path / "ours", tmp_path / "back"
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(ours)])
    assert (ours / "latest_checkpointed_iteration.txt").read_text() == "0"
    convert.convert(["--source-format", "torch_dist", "--source", str(ours), "--target-format", "hf",
                     "--target", str(back)])
    original, returned = _weights(tmp_path / "hf"), _weights(back)
    assert sorted(returned) == sorted(k for k in original if not k.endswith((".attn.bias", ".attn.masked_bias")))
    for key, tensor in returned.items():
        assert torch.equal(tensor, original[key]), key
    before = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    after = transformers.AutoConfig.from_pretrained(back).to_dict()
    for field in ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
                  "num_key_value_heads", "intermediate_size", "tie_word_embeddings", "rope_parameters",
                  "max_position_embeddings", "n_positions", "rms_norm_eps", "layer_norm_epsilon"):
        assert before.get(field) == after.get(field), field
    result = verify.compare(["--hf", str(tmp_path / "hf"), "--checkpoint", str(ours), "--data-path", token_file,
                             "--num-samples", "2", "--seq-length", "24"])
    assert result["max_logit_difference"] < 1e-4
    assert result["loss"] == pytest.approx(result["hf_loss"], rel=1e-5)


def test_missing_hf_directory_and_unexpressible_models_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a local Hugging Face model directory"):
        convert.convert(["--source-format", "hf", "--source", str(tmp_path / "nope"), "--target", str(tmp_path / "x")])
    transformers.LlamaForCausalLM(llama_config(rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="rope_original_max_position_embeddings = 32 cannot be trained here"):
        convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(tmp_path / "x")])


def test_finetune_from_a_converted_checkpoint(tmp_path):
    """--load <converted> --finetune --use-checkpoint-args: the model flags come from the checkpoint
    and training starts from the Hugging Face weights."""
    torch.manual_seed(0)
    model = MODELS["llama3.1-gqa"]()
    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(tmp_path / "ours")])
    flags = ["--load", str(tmp_path / "ours"), "--finetune", "--use-checkpoint-args", "--seq-length", "32",
             "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "999", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
             "--hidden-dropout", "0", "--attention-dropout", "0"]
    result = run_pretrain([], base=flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded weights of iteration 0" in result.stdout
    assert "--use-checkpoint-args: num_query_groups = 2" in result.stdout
    assert len(re.findall(r" iteration +\d+/ +2 \|", result.stdout)) == 2
