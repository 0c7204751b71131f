"""Packed conversations train exactly as unpacked ones (--sft): the summed loss and every gradient
of a step over packed sequences equal those of the same conversations one per sequence, over the
same count of assistant tokens (fp32, CPU, rtol 1e-5), through pretrain_gpt.py's forward step; and a
conversation's tokens get no gradient from the loss of the conversation packed after them."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import single_process
from tests.sft_data import SEED, assert_same_step, conversation_batches, sft_model_config, sft_step, write_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return conversation_batches(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_step_equals_unpacked_step(batches, family):
    """Llama's rotary positions and GPT-2's learned ones: with the latter, positions that do not
    restart at each conversation change the result."""
    packed, unpacked = batches
    reference = sft_step(single_process(), unpacked, family=family)
    assert reference["count"] == sum(float(b["loss_mask"].sum()) for b in packed) > 0
    assert_same_step(sft_step(single_process(), packed, family=family), reference)


def test_no_gradient_crosses_from_one_conversation_to_another(batches):
    """The loss of the second conversation of a packed sequence, differentiated with respect to the
    embeddings of every token: exactly zero on the first conversation's tokens."""
    packed, _ = batches
    batch = next(b for b in packed if int(b["document_ids"].max()) >= 2)  # two conversations and padding
    model = GPTModel(sft_model_config(), single_process())
    model.initialize_parameters(SEED)
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["embeddings"] = output  # [s, b, h]

    model.embedding.register_forward_hook(keep)
    losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], document_ids=batch["document_ids"])
    second = (batch["document_ids"] == 1).float() * batch["loss_mask"]
    assert second.sum() > 0
    (losses * second).sum().backward()
    grad = captured["embeddings"].grad[:, 0].abs().sum(dim=-1)  # [s]
    first = batch["document_ids"][0] == 0
    assert torch.all(grad[first] == 0), grad[first]
    assert torch.all(grad[batch["document_ids"][0] == 1] > 0)
