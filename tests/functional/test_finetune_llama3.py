"""examples/llama/finetune_llama3.sh end to end on CPU: a tiny Llama made here with `transformers`
(random weights, a word-level tokenizer with a ChatML chat template) is converted in, fine-tuned with
--sft for 250 steps on a task it can only do after learning (the assistant repeats the user's two
words, one from each half of the vocabulary; 12 of the 144 pairs are held out), and exported;
`transformers` then loads the export, whose tokenizer keeps the chat template, and generates the
right answer for every held-out prompt, greedily, through apply_chat_template and through
pipeline("text-generation") with chat messages. The validation loss (assistant tokens only) falls
from about 3 to near zero."""
import json
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.optional import require_executable
from tests.sft_data import pair_conversation, write_jsonl, write_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = 12


def _tiny_llama(directory: Path) -> None:
    """A random 2-layer Llama and its tokenizer, as a Hugging Face directory."""
    write_tokenizer(str(directory))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))


def _conversations(tmp_path: Path) -> tuple:
    """(training JSONL, held-out conversations whose user words never occur in training)."""
    rng = random.Random(0)
    unseen = {}
    while len(unseen) < HELD_OUT:
        conversation = pair_conversation(rng)
        unseen[conversation[1]["content"]] = conversation
    held_out = list(unseen.values())
    training = []
    while len(training) < 2000:
        conversation = pair_conversation(rng)
        if conversation[1]["content"] not in unseen:
            training.append({"messages": conversation})
    return write_jsonl(str(tmp_path / "chat.jsonl"), training), held_out


def _answer(model, tokenizer, conversation: list) -> list:
    inputs = tokenizer.apply_chat_template(conversation[:2], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split()


def test_finetune_script_trains_a_transformers_llama_that_then_chats(tmp_path):
    _tiny_llama(tmp_path / "hf_model")
    data, held_out = _conversations(tmp_path)
    env = dict(HF_MODEL=str(tmp_path / "hf_model"), DATA=data, WORK_DIR=str(tmp_path / "work"), NPROC="1",
               SEQ_LENGTH="64", MBS="8", BS="16", TOTAL_ITERS="250", LR="5e-3", TEE_OUTPUT="0",
               LOG_DIR=str(tmp_path / "logs"), PYTHON=sys.executable, PATH=require_executable("torchrun"),
               MASTER_PORT="29741", EXTRA_ARGS="--num-workers 0", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(["bash", str(ROOT / "examples/llama/finetune_llama3.sh")], capture_output=True,
                            text=True, env=env, timeout=300, cwd=tmp_path)
    (log,) = (tmp_path / "logs").glob("finetune_llama_*.log")
    assert result.returncode == 0, (result.stdout + result.stderr + log.read_text())[-3000:]
    text = log.read_text()
    assert re.search(r"> sft train: 1960 conversations packed into \d+ sequences of 64", text), text[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", text)]
    validation = float(re.findall(r"validation loss at iteration 250 on validation set \| lm loss value: ([0-9.E+-]+)",
                                  text)[0])
    assert losses[0] > 3.0 and validation < 0.05, (losses[0], validation)

    export = tmp_path / "work" / "hf"
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == 3  # <|im_end|>
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the documented path
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(export))
        generator = transformers.pipeline("text-generation", model=str(export))
    original = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf_model"))
    assert tokenizer.chat_template == original.chat_template
    answers = [_answer(model, tokenizer, conversation) for conversation in held_out]
    assert answers == [conversation[2]["content"].split() for conversation in held_out]
    chat = generator(held_out[0][:2], max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert chat[-1] == {"role": "assistant", "content": held_out[0][2]["content"]}
