"""Shared pieces of the --sft tests: a tiny word-level Hugging Face tokenizer with a ChatML-style
chat template, and a generated conversation task ("repeat my words") a small model can learn."""
import json
from functools import partial
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


def pair_conversation(rng: random.Random) -> list:
    """The user says one word of the first half of WORDS, then one of the second half; the assistant
    repeats both. Each answer word can be found by what it is, not where it is, which a tiny model
    learns in a few hundred steps, and 144 pairs leave room for held-out prompts."""
    half = len(WORDS) // 2
    said = f"{rng.choice(WORDS[:half])} {rng.choice(WORDS[half:])}"
    return [{"role": "system", "content": "repeat"}, {"role": "user", "content": said},
            {"role": "assistant", "content": said}]


def write_jsonl(path: str, lines: list) -> str:
    with open(path, "w") as file:
        for line in lines:
            file.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


# ------------------------------------------------------------------------------------------------
# One training step of pretrain_gpt.py's forward step on SFT batches, at any TP/SP/PP layout

SEQ, LAYERS, SEED = 32, 2, 1234


def conversation_batches(tokenizer_dir: str, count: int = 6, seed: int = 0, cp_size: int = 1) -> tuple:
    """(packed, unpacked): the same conversations packed first-fit into --seq-length sequences (each
    padded to a multiple of 2 x cp_size), and one per sequence; each a list of [1, s] micro-batches
    as the data loader yields them."""
    from megatron.core.datasets.sft import PackedConversations, Tokenized, pack_sequence, tokenize_conversation
    from megatron.core.tokenizers import build_tokenizer
    from megatron.training.data import collate

    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    rng = random.Random(seed)
    conversations = []
    for index in range(count):
        messages = repeat_conversation(rng, words=1 + index % 4)
        tokens, assistant = tokenize_conversation(messages, tokenizer, "chat-template")
        conversations.append(Tokenized(tokens, assistant, "generated", index + 1))
    packed = PackedConversations(conversations, SEQ, cp_size, pad_token=tokenizer.pad)
    assert len(packed) < count  # several conversations share a sequence
    unpacked = [pack_sequence([c], SEQ, cp_size, tokenizer.pad) for c in conversations]
    return [collate([packed[i]]) for i in range(len(packed))], [collate([sample]) for sample in unpacked]


def sft_model_config(family: str = "llama"):
    """Llama (rotary positions, which see only distances within a conversation) or GPT-2 (learned
    absolute positions, which see where each conversation's positions start)."""
    from tests.distributed.parity import gpt2_config, llama_config

    config = llama_config if family == "llama" else gpt2_config
    return config(num_layers=LAYERS, max_position_embeddings=SEQ)


def sft_step(groups, micro_batches: list, sequence_parallel: bool = False, family: str = "llama") -> dict:
    """One forward-backward with pretrain_gpt.forward_step and --calculate-per-token-loss (the loss
    of each micro-batch is its sum over assistant tokens). Returns the summed loss and assistant
    token count (last stage) and this rank's full gradients by global name."""
    import torch

    import pretrain_gpt
    from megatron.core.distributed import comm
    from megatron.core.distributed.ddp import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.layout import stage_layer_numbers
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import build_tracker
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import gather_full_grads

    config = sft_model_config(family)
    (layers,) = stage_layer_numbers(LAYERS, groups.pp_size, groups.pp_rank)
    model = GPTModel(config, groups, execution=ExecutionConfig(sequence_parallel=sequence_parallel),
                     rng_tracker=build_tracker(SEED, groups.tp_rank, groups.pp_rank, groups.device),
                     pre_process=groups.is_first_stage, post_process=groups.is_last_stage, layer_numbers=layers)
    model.initialize_parameters(SEED)
    ddp = DistributedDataParallel(model, groups)
    seq = SEQ // groups.cp_size // (groups.tp_size if sequence_parallel else 1)
    schedule = get_forward_backward_func(groups.pp_size)
    reported = schedule(forward_step_func=partial(pretrain_gpt.forward_step, calculate_per_token_loss=True),
                        data_iterator=iter(micro_batches), model_chunks=[ddp], num_microbatches=len(micro_batches),
                        groups=groups, forward_only=False, tensor_shape=(seq, 1, config.hidden_size),
                        dtype=torch.float32, loss_divisor=1)
    finalize_model_grads([ddp], groups)
    # --calculate-per-token-loss: the reduction averaged the sums over the data x context ranks;
    # training multiplies by their count (and divides by the tokens, left out here: sums compared).
    for param in model.parameters():
        param.main_grad.mul_(groups.dp_size * groups.cp_size)
    total = torch.stack([r["lm loss"] for r in reported]).sum(dim=0) if reported else None
    if total is not None:  # each context-parallel rank reported its chunks' sum and count
        comm.all_reduce(total, groups.dp_cp)
    return {"loss": None if total is None else total[0].item(), "count": None if total is None else total[1].item(),
            "grads": {(name, part): grad for name, parts in gather_full_grads(model, groups).items()
                      for part, grad in parts.items()}}


def assert_same_step(run: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Summed loss and every gradient, both divided by the same assistant-token count."""
    import torch

    count = reference["count"]
    if run["loss"] is not None:
        assert run["count"] == count
        assert abs(run["loss"] - reference["loss"]) <= rtol * abs(reference["loss"]), (run["loss"], reference["loss"])
    for key, grad in run["grads"].items():
        torch.testing.assert_close(grad / count, reference["grads"][key] / count, rtol=rtol, atol=1e-7,
                                   msg=lambda m: f"{key}: {m}")
