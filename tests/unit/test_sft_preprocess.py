"""tools/preprocess_sft.py: conversations tokenized once into Megatron's .bin/.idx (tokens) plus a
uint8 assistant mask with the same sequence lengths, equal to what the JSONL path tokenizes; --sft
trains from them exactly as from the JSONL file (the same samples, the same dtypes)."""
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.sft import SFTDataError, SFTDatasetConfig, build_sft_datasets, load_tokenized
from megatron.core.tokenizers import build_tokenizer
from tests.sft_data import repeat_conversation, write_jsonl, write_tokenizer

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_sft  # noqa: E402


def _tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_sft.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_preprocessed_conversations_give_the_jsonl_samples(tmp_path):
    tokenizer_dir = write_tokenizer(str(tmp_path / "tok"))
    rng = random.Random(5)
    lines = [{"messages": repeat_conversation(rng, words=1 + i % 3) + repeat_conversation(rng)} for i in range(12)]
    jsonl = write_jsonl(str(tmp_path / "chat.jsonl"), lines + ["{broken"])
    with pytest.raises(SFTDataError, match="chat.jsonl:13: not JSON"):  # in this process: one start-up less
        preprocess_sft.main(["--input", jsonl, "--output-prefix", str(tmp_path / "chat"),
                             "--tokenizer-model", tokenizer_dir])
    assert not list(tmp_path.glob("chat_*"))  # nothing half-written left behind
    result = _tool("--input", jsonl, "--output-prefix", tmp_path / "chat", "--tokenizer-model", tokenizer_dir,
                   "--sft-skip-bad-lines")
    assert result.returncode == 0, result.stderr
    assert "1 bad lines skipped" in result.stderr and "24 conversations written" in result.stderr
    prefix = str(tmp_path / "chat_messages_document")
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_assistant")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    config = SFTDatasetConfig(seq_length=32, seed=3, skip_bad_lines=True)
    expected = load_tokenized(jsonl, tokenizer, config, log=lambda _line: None)
    assert len(tokens) == len(masks) == len(expected) == 24
    assert tokens.sequence_lengths.tolist() == masks.sequence_lengths.tolist() == [len(c.tokens) for c in expected]
    assert tokens[0].dtype == np.uint16 and masks[0].dtype == np.uint8
    for index, conversation in enumerate(expected):
        np.testing.assert_array_equal(tokens[index], conversation.tokens)
        np.testing.assert_array_equal(masks[index], conversation.assistant)
    from_jsonl = build_sft_datasets(SFTDatasetConfig(seq_length=32, seed=3, data_path=[jsonl], skip_bad_lines=True),
                                    tokenizer, (20, 0, 0), log=lambda _line: None)[0]
    from_files = build_sft_datasets(SFTDatasetConfig(seq_length=32, seed=3, data_path=[prefix]), tokenizer,
                                    (20, 0, 0), log=lambda _line: None)[0]
    for index in range(20):
        for key, value in from_jsonl[index].items():
            np.testing.assert_array_equal(from_files[index][key], value, err_msg=key)
            assert from_files[index][key].dtype == value.dtype
