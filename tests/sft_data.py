"""Shared pieces of the --sft tests: a tiny word-level Hugging Face tokenizer with a ChatML-style
chat template, and a generated conversation task ("repeat my words") a small model can learn."""
import json
import os
import random

WORDS = [f"w{i}" for i in range(24)]
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
ROLE_WORDS = ["system", "user", "assistant", "repeat"]
# ChatML, as transformers renders it; the turns are appended one after the other.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same text with transformers' {% generation %} markers: its assistant mask is the reference for ours.
GENERATION_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                       "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
                       "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(directory: str, chat_template: str = CHAT_TEMPLATE) -> str:
    """A word-level tokenizer (whitespace split) saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS + ROLE_WORDS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    if chat_template:
        tokenizer.chat_template = chat_template
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory


def repeat_conversation(rng: random.Random, words: int = 3, system: bool = True) -> list:
    """The user says some words; the assistant repeats them."""
    said = " ".join(rng.choice(WORDS) for _ in range(words))
    turns = [{"role": "system", "content": "repeat"}] if system else []
    return turns + [{"role": "user", "content": said}, {"role": "assistant", "content": said}]


def write_jsonl(path: str, lines: list) -> str:
    with open(path, "w") as file:
        for line in lines:
            file.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
