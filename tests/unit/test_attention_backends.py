"""Attention backends and document-aware attention (--reset-attention-mask), on the CPU.

References: a per-head softmax written here, and each packed document run through the model on its
own (a document must not see its neighbours, so its tokens' losses equal a separate run's).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.attention import (
    CoreAttention,
    document_attention_mask,
    document_block_mask,
    resolve_attention_backend,
)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_attention(q, k, v, allowed):
    """q [b, nq, s, d], k/v [b, nkv, s, d], allowed [b, s, s] bool."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return scores.softmax(-1) @ v


def core(backend):
    return CoreAttention(SimpleNamespace(attention_dropout=0.0), None,
                         execution=SimpleNamespace(attention_backend=backend))


@pytest.mark.parametrize("backend", ["auto", "flash", "unfused", "local", "math"])
def test_cpu_backends_match_the_reference_with_grouped_kv(backend):
    q, k, v = randn(2, 4, 9, 8, seed=1), randn(2, 2, 9, 8, seed=2), randn(2, 2, 9, 8, seed=3)
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9)
    torch.testing.assert_close(core(backend)(q, k, v), reference_attention(q, k, v, causal), atol=1e-5, rtol=1e-5)


def test_unknown_backend_names_the_flag():
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        core("sdpa")


def test_resolution_on_cpu_names_what_runs():
    shape = dict(batch=1, heads=4, groups=2, seq=16, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    assert resolve_attention_backend("auto", **shape) == ("auto", "attention: SDPA, kernel chosen by PyTorch (CPU)")
    backend, line = resolve_attention_backend("fused", **shape)  # GPU-only kernels: what the CPU has runs
    assert backend == "auto" and "fused (CUDNN_ATTENTION, EFFICIENT_ATTENTION) needs a GPU" in line
    assert resolve_attention_backend("math", **shape)[0] == "math"
    assert resolve_attention_backend("flash", **shape)[0] == "flash"  # the CPU flash kernel
    q = torch.randn(1, 4, 16, 8)
    k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    for name in ("flash", "math", "auto"):  # each choice the CPU resolves to runs there
        core(name)(q, k, v)
    backend, line = resolve_attention_backend("flash_attn", **shape)
    if backend == "flash":
        assert "flash-attn not installed" in line


def test_document_masks_dense_and_block_sparse_match_the_reference():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3],
                                 [0] * 7 + [1] * 9])
    s = document_ids.shape[1]
    allowed = (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)) & torch.ones(s, s, dtype=torch.bool).tril()
    dense = document_attention_mask(document_ids)
    assert dense.shape == (2, 1, s, s) and torch.equal(dense[:, 0], allowed)
    q, k, v = randn(2, 4, s, 8, seed=1), randn(2, 2, s, 8, seed=2), randn(2, 2, s, 8, seed=3)
    want = reference_attention(q, k, v, allowed)
    torch.testing.assert_close(core("auto")(q, k, v, dense), want, atol=1e-5, rtol=1e-5)
    # The GPU path: a FlexAttention block mask (here run by FlexAttention's eager CPU fallback).
    block = document_block_mask(document_ids)
    torch.testing.assert_close(core("auto")(q, k, v, block), want, atol=1e-5, rtol=1e-5)


def test_packed_documents_equal_separate_runs():
    """GPT with document_ids and reset positions: each document's token losses equal running it alone."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from tests.distributed.parity import llama_config

    model = GPTModel(llama_config(), single_process())
    model.initialize_parameters(3)
    lengths = [5, 8, 3]
    tokens = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(tokens, positions, labels=tokens, document_ids=document_ids)
    start = 0
    for n in lengths:
        alone = model(tokens[:, start:start + n], torch.arange(n).unsqueeze(0), labels=tokens[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, atol=1e-5, rtol=1e-5)
        start += n
    plain = model(tokens, positions, labels=tokens)  # without the mask, later documents see earlier ones
    assert not torch.allclose(plain[:, 5:13], packed[:, 5:13], atol=1e-3)
