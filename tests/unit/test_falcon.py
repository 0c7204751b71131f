"""Falcon: attention and MLP in parallel (--parallel_attn), from one norm (Falcon-7B, multi-query)
or two (Falcon-40B's new decoder architecture, --parallel_layernorm, grouped-query), against
`transformers`' FalconForCausalLM on tiny models built here (fp32, random weights): equal logits,
the round trip gives the files back (also through tools/checkpoint/convert.py, and
tools/verify_correctness.py agrees), 5 training steps track transformers + torch AdamW; the flags
under Megatron-LLM's names, and examples/falcon/train_falcon.sh."""
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.optional import require_module

transformers = require_module("transformers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.checkpointing.conversion import read_hf  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.hf_mapping import (  # noqa: E402
    architecture_for_hf,
    architecture_of,
    hf_config_from_transformer_config,
    hf_config_to_transformer_config,
    hf_to_logical,
    load_logical_into_model,
    logical_to_hf,
    model_to_logical,
)
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.validation import validate  # noqa: E402
from tests.unit.test_arguments import MINIMAL  # noqa: E402
from tests.unit.test_hf_parity import randomize  # noqa: E402
from tests.hf_training import assert_training_tracks_transformers  # noqa: E402

FalconForCausalLM = transformers.FalconForCausalLM
VOCAB, BATCH, SEQ, TOLERANCE = 128, 2, 24, 1e-4  # 128: no padded rows in the training loss
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96,
             max_position_embeddings=64, parallel_attn=True, bias=False, alibi=False, hidden_dropout=0.0,
             attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
# (new_decoder_architecture, num_kv_heads, num_ln_in_parallel_attn) -> (query groups, --parallel_layernorm)
CASES = {
    "7b": (dict(new_decoder_architecture=False, multi_query=True), (1, False)),
    "40b": (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2), (2, True)),
    "40b-one-norm": (dict(new_decoder_architecture=True, num_kv_heads=4, num_ln_in_parallel_attn=1), (4, False)),
    "40b-multi-query": (dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=2), (1, True)),
}


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved_pair(case, tmp_path):
    hf = randomize(FalconForCausalLM(transformers.FalconConfig(**SHAPE, **CASES[case][0]))).eval()
    hf.save_pretrained(tmp_path)
    hf_config, files = read_hf(str(tmp_path))
    config = hf_config_to_transformer_config(hf_config)
    ours = GPTModel(config, parallel_state.single_process()).eval()
    load_logical_into_model(ours, hf_to_logical(files, config, architecture_of(hf_config)))
    return hf, ours, hf_config, files


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_falcon_logits_equal_transformers(case, tmp_path):
    hf, ours, _, _ = saved_pair(case, tmp_path)
    config = ours.config
    assert (config.num_query_groups, config.parallel_layernorm) == CASES[case][1]
    assert config.parallel_attn and not config.add_bias_linear and config.normalization == "LayerNorm"
    assert not config.untie_embeddings_and_output_weights and config.activation == "gelu"
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    expected = hf(input_ids=tokens).logits
    got = ours(tokens, torch.arange(SEQ).expand(BATCH, SEQ)).transpose(0, 1)[..., :VOCAB]
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_falcon_round_trip_gives_the_files_back(case, tmp_path):
    _, ours, hf_config, files = saved_pair(case, tmp_path)
    config = ours.config
    assert architecture_for_hf(config) == "falcon"
    back = logical_to_hf(model_to_logical(ours), config, "falcon", vocab_size=VOCAB)
    assert back.keys() == files.keys()
    for key, tensor in files.items():
        torch.testing.assert_close(back[key], tensor, rtol=0, atol=0, msg=key)
    exported = hf_config_from_transformer_config(config, VOCAB)
    for key in ("new_decoder_architecture", "multi_query", "num_ln_in_parallel_attn", "parallel_attn", "bias",
                "alibi", "activation", "tie_word_embeddings", "ffn_hidden_size", "rope_parameters"):
        assert getattr(exported, key) == getattr(hf_config, key), key
    if hf_config.new_decoder_architecture:
        assert exported.num_kv_heads == hf_config.num_kv_heads
    assert hf_config_to_transformer_config(exported) == config


def test_five_training_steps_track_transformers_and_adamw(tmp_path):
    """The same 5 AdamW steps (lr 1e-3, no weight decay, no clipping) on the same batch: our model
    with our optimizer against `transformers` with torch.optim.AdamW (Falcon-40B's shape)."""
    hf, ours, _, _ = saved_pair("40b", tmp_path)
    assert_training_tracks_transformers(hf, ours, VOCAB, BATCH, SEQ)


@pytest.mark.parametrize("spelling", ["--parallel_attn --parallel_layernorm --use_multiquery_attn",
                                      "--parallel-attn --parallel-layernorm --use-multiquery-attn"])
def test_megatron_llm_flags_in_both_spellings(spelling):
    model = parse_args(MINIMAL + spelling.split()).model
    assert model.parallel_attn and model.parallel_layernorm
    assert model.group_query_attention and model.num_query_groups == 1


def test_multiquery_with_another_group_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(MINIMAL + ["--use_multiquery_attn", "--group-query-attention", "--num-query-groups", "2"])
    error = capsys.readouterr().err
    assert "--use_multiquery_attn is --num-query-groups 1, but --num-query-groups 2 was given" in error


def test_unsupported_falcon_layouts_and_settings_are_named():
    with pytest.raises(ValueError, match="multi_query false and new_decoder_architecture false"):
        hf_config_to_transformer_config(transformers.FalconConfig(**SHAPE, new_decoder_architecture=False,
                                                                  multi_query=False))
    with pytest.raises(ValueError, match="alibi=True is not supported"):
        hf_config_to_transformer_config(transformers.FalconConfig(**{**SHAPE, "alibi": True}))
    config = hf_config_to_transformer_config(transformers.FalconConfig(**SHAPE, new_decoder_architecture=True,
                                                                       num_kv_heads=2))
    config.qk_layernorm = True
    with pytest.raises(ValueError, match="--qk-layernorm with --parallel_attn has no Hugging Face Falcon "):
        architecture_for_hf(config)
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    config = hf_config_to_transformer_config(llama)
    config.parallel_attn = True
    with pytest.raises(ValueError, match="--parallel_attn has no Hugging Face Llama equivalent"):
        architecture_for_hf(config)


def test_falcon_converts_and_verifies_through_the_tools(tmp_path):
    from tests.unit.test_checkpoint_convert import convert, verify

    hf = randomize(FalconForCausalLM(transformers.FalconConfig(**SHAPE, **CASES["40b"][0])))
    hf.save_pretrained(tmp_path / "hf")
    convert.convert(["--source-format", "hf", "--source", str(tmp_path / "hf"), "--target", str(tmp_path / "ours")])
    convert.convert(["--source-format", "torch_dist", "--source", str(tmp_path / "ours"), "--target-format", "hf",
                     "--target", str(tmp_path / "back")])
    back = FalconForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    tokens = tmp_path / "tokens"
    builder = IndexedDatasetBuilder(f"{tokens}.bin", dtype=np.uint16)
    builder.add_item(np.random.default_rng(0).integers(0, VOCAB, 60))
    builder.end_document()
    builder.finalize(f"{tokens}.idx")
    result = verify.compare(["--hf", str(tmp_path / "hf"), "--checkpoint", str(tmp_path / "ours"), "--data-path",
                             str(tokens), "--num-samples", "2", "--seq-length", "24"])
    assert result["max_logit_difference"] < TOLERANCE


@pytest.mark.parametrize("env, world", [({}, 1), ({"MODEL_SIZE": "7B", "NPROC": "8"}, 8),
                                        ({"MODEL_SIZE": "40B", "TP": "8", "NPROC": "8", "NNODES": "4"}, 32)])
def test_example_script_passes_valid_falcon_flags(env, world):
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(["bash", str(root / "examples/falcon/train_falcon.sh")], capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1", "PATH": os.environ["PATH"], **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    config = parse_args(command[next(i for i, c in enumerate(command) if c.endswith("pretrain_gpt.py")) + 1:])
    validate(config, world)
    model = config.model
    assert model.parallel_attn and model.parallel_layernorm == (env.get("MODEL_SIZE") == "40B")
    assert model.num_query_groups == (8 if env.get("MODEL_SIZE") == "40B" else 1)
