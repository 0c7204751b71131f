"""The fused cross entropy's backward is one pass that writes the gradient over the logits.

Counted on CPU in inductor's generated code and in the bytes allocated; the same graph compiles to
one Triton kernel on GPU. Writing the one-hot with `scatter_add_` (the old code) made inductor
allocate the probabilities as an fp32 [rows, V] buffer (12 bytes per logit of traffic instead of 4)
and pass over it three times: each test here fails on that code.
"""
import re

import torch

from megatron.core.tensor_parallel.cross_entropy import chunk_softmax_grad_, fused_vocab_parallel_cross_entropy
from megatron.core.transformer.fusions import compiled
from tests.unit.work_counting import generated_code, peak_bytes_allocated

VOCAB = 128256  # Llama 3's


def test_compiled_backward_is_one_pass_with_no_fp32_buffer():
    rows, vocab = 16, 1000
    generator = torch.Generator().manual_seed(0)
    chunk = torch.randn(rows, vocab, generator=generator).to(torch.bfloat16)
    lse = torch.randn(rows, generator=generator) + 7
    target = torch.randint(0, vocab, (rows,), generator=generator)
    outside = torch.zeros(rows, dtype=torch.bool)
    code = generated_code(compiled(chunk_softmax_grad_), chunk, lse, target, outside, torch.ones(rows))
    assert f"empty_strided_cpu(({rows}, {vocab})" not in code  # no [rows, V] buffer of any dtype
    loops_over_vocab = re.findall(rf"x1<static_cast<int64_t>\({vocab}L\)", code)
    assert len(loops_over_vocab) == 1, code


def _loss_peak_above_logits(tokens: int, compiled_loss: bool) -> tuple[int, int]:
    generator = torch.Generator().manual_seed(1)
    leaf = (torch.randn(tokens, 1, VOCAB, generator=generator) * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, VOCAB, (tokens, 1), generator=generator)
    logits = leaf * 1  # a non-leaf, as the output layer's logits are

    def loss_forward_backward():
        loss = fused_vocab_parallel_cross_entropy(logits, target, None, compiled=compiled_loss)
        grad, = torch.autograd.grad(loss.mean(), logits)
        assert grad.data_ptr() == logits.data_ptr()  # written over the logits

    loss_forward_backward()  # compiles
    return peak_bytes_allocated(loss_forward_backward), logits.numel() * logits.element_size()


def test_compiled_loss_on_a_128k_vocabulary_needs_under_a_tenth_of_the_logits_more():
    peak, logits_bytes = _loss_peak_above_logits(64, compiled_loss=True)
    assert peak <= 0.1 * logits_bytes, f"{peak / 2**20:.2f} MiB above {logits_bytes / 2**20:.2f} MiB of logits"
