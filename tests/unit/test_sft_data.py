"""--sft data: JSONL conversations, the assistant-only loss mask (checked against transformers' own
assistant mask), bad lines named by file and line, first-fit packing with per-conversation
positions and document ids, CP padding and truncation."""
import json
import random

import numpy as np
import pytest

from megatron.core.datasets.sft import (PackedConversations, SFTDataError, SFTDatasetConfig, Tokenized,
                                        build_sft_datasets, check_chat_tokenizer, check_prompt_format,
                                        conversation_pairs, pack_first_fit, read_conversations,
                                        tokenize_conversation)
from megatron.core.tokenizers import build_tokenizer
from tests.sft_data import GENERATION_TEMPLATE, repeat_conversation, write_jsonl, write_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def two_turns(seed: int = 0) -> list:
    rng = random.Random(seed)
    return repeat_conversation(rng) + repeat_conversation(rng, words=2, system=False)[0:2]


def test_a_line_holds_conversations_each_starting_at_a_system_turn(tmp_path):
    rng = random.Random(0)
    first, second = repeat_conversation(rng), repeat_conversation(rng)
    path = write_jsonl(str(tmp_path / "a.jsonl"), [{"messages": first + second}, {"messages": first}])
    conversations, skipped = read_conversations(path)
    assert [list(c.messages) for c in conversations] == [first, second, first]
    assert [c.line for c in conversations] == [1, 1, 2] and skipped == 0


@pytest.mark.parametrize("line, what", [
    ("{not json", "not JSON"),
    (json.dumps({"text": "hello"}), 'no "messages"'),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}), "role 'tool'"),
    (json.dumps({"messages": [{"role": "user", "content": "  "}]}), "empty"),
])
def test_bad_lines_are_named_by_file_and_line_and_can_be_skipped_and_counted(tmp_path, line, what):
    good = {"messages": repeat_conversation(random.Random(1))}
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [good, line, good])
    with pytest.raises(SFTDataError, match=rf"bad.jsonl:2: .*{what}.*--sft-skip-bad-lines"):
        read_conversations(path)
    conversations, skipped = read_conversations(path, skip_bad_lines=True)
    assert len(conversations) == 2 and skipped == 1


def test_chat_template_tokens_and_assistant_mask_equal_transformers(tokenizer):
    """Tokens as transformers renders and tokenizes the whole conversation; the assistant mask as
    transformers' return_assistant_tokens_mask on the same template with {% generation %} markers."""
    conversation = two_turns()
    conversation = conversation + [{"role": "assistant", "content": conversation[-1]["content"]}]
    tokens, assistant = tokenize_conversation(conversation, tokenizer, "chat-template")
    hf = tokenizer.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True,
                                                 chat_template=GENERATION_TEMPLATE)
    assert tokens.tolist() == hf["input_ids"]  # ends with <|im_end|>, the EOS: no extra EOD
    assert assistant.astype(int).tolist() == hf["assistant_masks"]
    assert assistant.sum() > 0


def test_loss_mask_marks_pairs_whose_label_is_an_assistant_token(tokenizer):
    conversation = repeat_conversation(random.Random(2))
    tokens, assistant = tokenize_conversation(conversation, tokenizer, "chat-template")
    pairs = conversation_pairs(Tokenized(tokens, assistant, "f", 1))
    np.testing.assert_array_equal(pairs["tokens"], tokens[:-1])
    np.testing.assert_array_equal(pairs["labels"], tokens[1:])
    answer = tokenizer.encode_text(conversation[-1]["content"]) + [tokenizer.eod]
    trained = pairs["labels"][pairs["loss_mask"] == 1].tolist()
    assert trained == answer  # the answer's words and its end-of-turn, nothing of the prompt


def test_identity_format_is_the_turns_text_and_appends_the_eod(tokenizer):
    conversation = repeat_conversation(random.Random(3))
    tokens, assistant = tokenize_conversation(conversation, tokenizer, "identity")
    words = [tokenizer.encode_text(turn["content"]) for turn in conversation]
    assert tokens.tolist() == sum(words, []) + [tokenizer.eod]
    assert assistant.tolist() == [False] * (len(words[0]) + len(words[1])) + [True] * (len(words[2]) + 1)


def test_prompt_format_errors(tmp_path):
    with pytest.raises(ValueError, match="nemotron-h-aligned .*not built here; use chat-template"):
        check_prompt_format("nemotron-h-aligned")
    with pytest.raises(ValueError, match="must be one of chat-template, default, identity"):
        check_prompt_format("chatml")
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(str(tmp_path), chat_template=""))
    with pytest.raises(ValueError, match="has no chat_template.*identity"):
        check_chat_tokenizer(plain, "chat-template")
    check_chat_tokenizer(plain, "identity")


def first_fit_by_scanning(lengths: list, capacity: int) -> list:
    """The definition, bin by bin (quadratic): the reference for the tree search."""
    bins, room = [], []
    for item, length in enumerate(lengths):
        target = next((b for b, free in enumerate(room) if free >= length), len(bins))
        if target == len(bins):
            bins.append([])
            room.append(capacity)
        bins[target].append(item)
        room[target] -= length
    return bins


def test_first_fit_puts_each_conversation_into_the_first_sequence_with_room():
    assert pack_first_fit([6, 5, 3, 2, 4], 8) == [[0, 3], [1, 2], [4]]
    assert pack_first_fit([], 8) == [] and pack_first_fit([8, 8], 8) == [[0], [1]]
    rng = np.random.default_rng(0)
    for count, capacity in ((1, 5), (7, 16), (300, 64), (1000, 4096)):
        lengths = rng.integers(0, capacity + 1, count).tolist()
        assert pack_first_fit(lengths, capacity) == first_fit_by_scanning(lengths, capacity)


def tokenized(lengths: list, trained_from: int = 1) -> list:
    """Conversations of the given token counts; tokens 10*k + j, assistant from token `trained_from`."""
    out = []
    for k, n in enumerate(lengths):
        assistant = np.arange(n) >= trained_from
        out.append(Tokenized(np.arange(n, dtype=np.int64) + 10 * (k + 1), assistant, "f.jsonl", k + 1))
    return out


def test_packed_sequence_restarts_positions_and_keeps_each_conversation_apart():
    packed = PackedConversations(tokenized([4, 3, 5]), seq_length=8, pad_token=0)
    assert packed.bins == [[0, 1], [2]]
    sample = packed[0]
    np.testing.assert_array_equal(sample["tokens"], [10, 11, 12, 20, 21, 0, 0, 0])
    np.testing.assert_array_equal(sample["labels"], [11, 12, 13, 21, 22, 0, 0, 0])
    np.testing.assert_array_equal(sample["loss_mask"], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(sample["position_ids"], [0, 1, 2, 0, 1, 0, 1, 2])
    np.testing.assert_array_equal(sample["document_ids"], [0, 0, 0, 1, 1, 2, 2, 2])


def test_context_parallel_padding_makes_every_conversation_a_multiple_of_2cp():
    packed = PackedConversations(tokenized([4, 3]), seq_length=8, cp_size=2, pad_token=0)
    sample = packed[0]  # 3 pairs -> 4, 2 pairs -> 4
    np.testing.assert_array_equal(sample["document_ids"], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(sample["position_ids"], [0, 1, 2, 3, 0, 1, 2, 3])
    np.testing.assert_array_equal(sample["loss_mask"], [1, 1, 1, 0, 1, 1, 0, 0])


def test_over_long_conversations_are_truncated_and_counted_or_named():
    packed = PackedConversations(tokenized([12, 3]), seq_length=8, pad_token=0)
    assert packed.stats.truncated == 1
    np.testing.assert_array_equal(packed[0]["labels"], np.arange(11, 19))
    with pytest.raises(SFTDataError, match=r"f.jsonl:1: a conversation of 12 tokens is longer than --seq-length \(8\)"):
        PackedConversations(tokenized([12, 3]), seq_length=8, truncate=False)


def test_datasets_from_split_and_per_split_files(tmp_path, tokenizer):
    rng = random.Random(4)
    path = write_jsonl(str(tmp_path / "c.jsonl"), [{"messages": repeat_conversation(rng)} for _ in range(20)])
    lines = []
    config = SFTDatasetConfig(seq_length=32, seed=1, data_path=[path], split="90,10,0")
    train, valid, test = build_sft_datasets(config, tokenizer, (50, 5, 5), log=lines.append)
    assert len(train) == 50 and len(valid) == 5 and test is None
    assert any("sft train: 18 conversations packed into" in line for line in lines), lines
    sample = train[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    assert all(value.shape == (32,) for value in sample.values())
    per_split = SFTDatasetConfig(seq_length=32, seed=1, train_data_path=["2", path, "1", path],
                                 valid_data_path=[path])
    train, valid, test = build_sft_datasets(per_split, tokenizer, (7, 3, 0), log=lines.append)
    assert len(train) == 7 and len(valid) == 3 and test is None
