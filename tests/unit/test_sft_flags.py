"""--sft flags: Megatron-LM's --sft and --sft-tokenizer-prompt-format parse and are implemented;
what --sft cannot run with is one startup error naming the flags."""
import pytest

from megatron.training.arguments import parse_args
from megatron.training.validation import ConfigError, validate

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1",
        "--seq-length", "32", "--train-iters", "3", "--lr", "1e-3", "--sft", "--data-path", "conversations.jsonl",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tok"]


def test_sft_flags_parse_with_their_defaults():
    config = parse_args(BASE)
    d = config.data
    assert d.sft and d.sft_tokenizer_prompt_format == "chat-template"
    assert not d.sft_skip_bad_lines and d.sft_truncation
    config = parse_args(BASE + ["--sft-tokenizer-prompt-format", "identity", "--sft-skip-bad-lines",
                                "--sft-no-truncation"])
    assert (config.data.sft_tokenizer_prompt_format, config.data.sft_skip_bad_lines,
            config.data.sft_truncation) == ("identity", True, False)
    validate(config, 1)
    validate(parse_args(BASE + ["--context-parallel-size", "2", "--attention-dropout", "0"]), 2)  # packed under CP


@pytest.mark.parametrize("flags, message", [
    (["--sft-tokenizer-prompt-format", "nemotron-h-aligned"], "nemotron-h-aligned .*not built here"),
    (["--sft-tokenizer-prompt-format", "chatml"], "must be one of chat-template, default, identity"),
    (["--reset-attention-mask"], "--reset-attention-mask.*drop them"),
    (["--no-create-attention-mask-in-dataloader"], "attend to each other"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"],
     "--sft needs --tokenizer-type HuggingFaceTokenizer"),
])
def test_what_sft_cannot_run_with_is_one_startup_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(BASE + flags), 1)
