"""The start-up attention probe times the kernels on the layout the model passes, and a fallback
happens only when no kernel takes the inputs (on the CPU; the GPU race itself is in tests/gpu).

Planted bugs these fail on: contiguous probe tensors with a summed (stride-0) gradient (the old
probe), and a fallback on any RuntimeError (the old `except RuntimeError`, which also switched a
layer to expanded key/value heads for good after an out-of-memory or shape error)."""
from types import SimpleNamespace

import pytest
import torch

from megatron.core.parallel_state import single_process
from megatron.core.transformer.attention import CoreAttention, _time_backend, no_kernel_for, probe_inputs


@pytest.mark.parametrize("hidden", [64, 16], ids=["sequence-first", "batch-first"])
def test_probe_inputs_have_the_strides_the_model_passes(hidden):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.attention import runs_batch_first
    from tests.distributed.parity import llama_config

    config = llama_config(hidden_size=hidden, kv_channels=8)  # RoPE, grouped key/value heads
    model = GPTModel(config, single_process())
    model.initialize_parameters(1)
    seen = {}
    attention = model.decoder.layers[0].self_attention.core_attention
    attention.register_forward_pre_hook(lambda module, args: seen.setdefault("qkv", args[:3]))
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(16).expand_as(tokens))
    q, k, v = seen["qkv"]
    heads, groups, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    batch_first = runs_batch_first(3, 16, hidden)
    assert batch_first == (hidden == 16)
    probe = probe_inputs(3, heads, groups, 16, head_dim, torch.float32, torch.device("cpu"), batch_first)
    for name, got, want in zip("qkv", probe[:3], (q, k, v)):
        assert got.shape == want.shape and got.stride() == want.stride(), (name, got.stride(), want.stride())
    grad = probe[3]
    assert grad.shape == q.shape and 0 not in grad.stride() and grad.stride() == q.stride()


def test_only_a_missing_kernel_is_a_fallback():
    assert no_kernel_for(RuntimeError("No available kernel. Aborting execution."))
    assert not no_kernel_for(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not no_kernel_for(RuntimeError("The size of tensor a (8) must match the size of tensor b (9)"))
    cpu = torch.device("cpu")
    assert _time_backend("efficient", 1, 4, 2, 16, 8, torch.float32, cpu).seconds is None  # no such kernel on CPU
    assert _time_backend("math", 1, 4, 2, 16, 8, torch.float32, cpu).seconds > 0


def test_an_error_that_is_not_a_missing_kernel_propagates_and_changes_nothing():
    attention = CoreAttention(SimpleNamespace(attention_backend="math", attention_dropout=0.0), None)
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 9)  # head dims disagree
    with pytest.raises(RuntimeError):
        attention(q, k, k)
    assert not attention.expand_kv  # grouped key/value heads are still passed as they are
