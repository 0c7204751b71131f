"""At micro-batch > 1 the attention output reaches the output projection, and its gradient the
attention kernel, without a copy: counted on CPU in a transformer layer's forward and backward.

Sequence-first, q is a [b, n, s, d] view of [s, b, n, d] memory; the flash kernels (CPU and CUDA)
and cuDNN write their output in q's layout, and PyTorch's flash backward makes the output and its
gradient contiguous as [b, s, n, d]: a copy of each at micro-batch > 1 (one on the CPU, which
copies only the gradient). Batch-first (`SelfAttention._batch_first`), the rotation writes q and k
[b, s, n, d], the kernel's output follows, the projection takes it as [b*s, nq*d] and hands its
result to the residual add as a transposed view; its backward forms the input gradient
batch-first and the weight gradient one sample at a time, so nothing is copied. Running
sequence-first again (the old layout) leaves the kernel's copy and fails the count; forming the
input gradient with one matmul over the transposed gradient copies it and fails too.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.parity import llama_config

SEQ, HIDDEN = 64, 32  # batch-first pays off while b*s > (b - 1) * hidden


def _layer(dtype, fuse):
    from megatron.core.models.gpt import GPTModel

    config = llama_config(hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                          ffn_hidden_size=48, max_position_embeddings=SEQ)
    model = GPTModel(config, single_process(), execution=ExecutionConfig(params_dtype=dtype, fuse_elementwise=fuse))
    model.initialize_parameters(1)
    return model, model.decoder.layers[0]


def _inputs(model, batch, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, batch, HIDDEN, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(SEQ, batch, HIDDEN, generator=generator).to(dtype)
    return x, grad, model.rotary(torch.arange(SEQ).expand(batch, SEQ))


@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_micro_batch_2_copies_nothing_in_a_layer(dtype, fuse):
    model, layer = _layer(dtype, fuse)
    assert layer.self_attention._batch_first(SEQ, 2)
    x, grad, rotary = _inputs(model, 2, dtype)
    layer(x, rotary).backward(grad)  # compiles
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x, rotary).backward(grad)
    copies = [event.input_shapes[0] for event in prof.events() if event.name == "aten::clone"]
    assert copies == [], copies


def test_batch_first_layer_equals_each_sample_alone():
    """Micro-batch 2 (batch-first) against each sample at micro-batch 1 (sequence-first): outputs,
    input gradients and the summed weight gradients agree in fp32."""
    model, layer = _layer(torch.float32, False)
    x, grad, rotary = _inputs(model, 2, torch.float32)
    out = layer(x, rotary)
    out.backward(grad)
    together = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    alone, alone_x_grads = [], []
    for sample in range(2):
        xs = x.detach()[:, sample:sample + 1].clone().requires_grad_()
        cos_sin = model.rotary(torch.arange(SEQ).expand(1, SEQ))
        y = layer(xs, cos_sin)
        y.backward(grad[:, sample:sample + 1])
        alone.append(y.detach())
        alone_x_grads.append(xs.grad)
    torch.testing.assert_close(out.detach(), torch.cat(alone, dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, torch.cat(alone_x_grads, dim=1), rtol=1e-5, atol=1e-6)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(together[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
