"""The fused linear Function and the fused cross entropy against plain PyTorch, single process.

References are written here: `F.linear` on a separate copy of the weights, with its weight
gradients summed over micro-batches the way the data-parallel hook sums `param.grad` into
`main_grad`; and `F.cross_entropy` on fp32 logits. The tensor-parallel cases (TP 2/4, sequence
parallelism, saved bytes) are in tests/distributed/test_fused_kernels.py.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

MICRO_BATCHES = 3
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def full_weights(dtype):
    """The unsharded weights: fc1 [32, 16] with bias [32], fc2 [16, 32]."""
    return {"w1": (randn(32, 16, seed=1) / 4).to(dtype), "b1": randn(32, seed=2).to(dtype),
            "w2": (randn(16, 32, seed=3) / 4).to(dtype)}


class TwoLinears(torch.nn.Module):
    """column-parallel (with bias) -> gelu -> row-parallel, as an MLP; this rank's weight slices."""

    def __init__(self, dtype, fusion, tp_group=None, tp_size=1, tp_rank=0, sequence_parallel=False):
        super().__init__()
        common = dict(tp=TensorParallel(tp_group, tp_size, tp_rank), sequence_parallel=sequence_parallel,
                      params_dtype=dtype, gradient_accumulation_fusion=fusion)
        self.fc1 = ColumnParallelLinear(16, 32, bias=True, **common)
        self.fc2 = RowParallelLinear(32, 16, bias=False, **common)
        full = full_weights(dtype)
        with torch.no_grad():
            for param, name in ((self.fc1.weight, "w1"), (self.fc1.bias, "b1"), (self.fc2.weight, "w2")):
                param.copy_(param.tp_layout.full_to_local({"": full[name]}))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def reference_run(dtype, inputs, grads):
    """Plain F.linear on leaf copies of the weights; per-micro-batch gradients summed in fp32."""
    full = full_weights(dtype)
    w1, b1, w2 = (full[name].requires_grad_() for name in ("w1", "b1", "w2"))
    main = {name: torch.zeros(p.shape) for name, p in (("w1", w1), ("b1", b1), ("w2", w2))}
    outputs, input_grads = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        y = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
        y.backward(g)
        for name, p in (("w1", w1), ("b1", b1), ("w2", w2)):
            main[name] += p.grad.float()
            p.grad = None
        outputs.append(y.detach())
        input_grads.append(x.grad)
    return outputs, input_grads, main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_equals_plain_path_over_micro_batches(dtype):
    inputs = [randn(6, 2, 16, seed=10 + i, dtype=dtype) for i in range(MICRO_BATCHES)]
    grads = [randn(6, 2, 16, seed=20 + i, dtype=dtype) for i in range(MICRO_BATCHES)]
    want_out, want_dx, want_main = reference_run(dtype, inputs, grads)

    model = TwoLinears(dtype, fusion=True)
    ddp = DistributedDataParallel(model, single_process(), ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=100))
    ddp.zero_grad_buffer()
    ready_calls = []
    original = ddp._on_grad_ready
    for param in model.parameters():
        param.main_grad_hook = lambda p: (ready_calls.append(p), original(p))
    for index, (x, g) in enumerate(zip(inputs, grads)):
        x = x.clone().requires_grad_()
        last = index == MICRO_BATCHES - 1
        with ddp.no_sync() if not last else torch.enable_grad():
            y = ddp(x)
            y.backward(g)
        torch.testing.assert_close(y.detach(), want_out[index], **TOLERANCE[dtype])
        torch.testing.assert_close(x.grad, want_dx[index], **TOLERANCE[dtype])
        assert model.fc1.weight.grad is None and model.fc2.weight.grad is None  # nothing but main_grad
    # The fused weights told DDP once per backward; the bias (not fused) went through autograd's hook.
    assert [p is model.fc1.weight for p in ready_calls].count(True) == MICRO_BATCHES
    assert all(bucket.grad_sync_started for buffer in ddp.buffers for bucket in buffer.buckets)
    ddp.finish_grad_sync()
    for name, param in (("w1", model.fc1.weight), ("b1", model.fc1.bias), ("w2", model.fc2.weight)):
        torch.testing.assert_close(param.main_grad, want_main[name], **TOLERANCE[dtype])


def test_without_main_grad_the_function_returns_ordinary_gradients():
    """A bare module (no data-parallel wrapper) or FSDP2 (no main_grad): plain .grad, same values."""
    inputs, grads = [randn(6, 2, 16, seed=10)], [randn(6, 2, 16, seed=20)]
    _, want_dx, want_main = reference_run(torch.float32, inputs, grads)
    model = TwoLinears(torch.float32, fusion=True)
    x = inputs[0].clone().requires_grad_()
    model(x).backward(grads[0])
    torch.testing.assert_close(x.grad, want_dx[0])
    torch.testing.assert_close(model.fc1.weight.grad, want_main["w1"])
    torch.testing.assert_close(model.fc2.weight.grad, want_main["w2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_accumulates_rows_into_main_grad(dtype):
    tokens = torch.randint(0, 40, (MICRO_BATCHES, 2, 9), generator=torch.Generator().manual_seed(3))
    grads = [randn(9, 2, 8, seed=30 + i, dtype=dtype) for i in range(MICRO_BATCHES)]
    reference = randn(40, 8, seed=4, dtype=dtype).requires_grad_()
    want = torch.zeros(40, 8)
    for t, g in zip(tokens, grads):
        F.embedding(t.t(), reference).backward(g)
        want += reference.grad.float()
        reference.grad = None
    embedding = VocabParallelEmbedding(40, 8, tp=TensorParallel(), params_dtype=dtype)
    with torch.no_grad():
        embedding.weight.copy_(reference)
    ddp = DistributedDataParallel(embedding, single_process())
    ddp.zero_grad_buffer()
    for t, g in zip(tokens, grads):
        ddp(t).backward(g)
        assert embedding.weight.grad is None
    torch.testing.assert_close(embedding.weight.main_grad, want, **TOLERANCE[dtype])


def test_tied_embedding_is_signalled_once_per_backward():
    """Tied input/output embedding on one stage: the output layer fuses its gradient without
    signalling; the embedding's backward (later) signals once, so a bucket is never reduced
    before both contributions are in."""
    from megatron.core.models.gpt import GPTModel
    from tests.distributed.parity import gpt2_config

    model = GPTModel(gpt2_config(), single_process())
    model.initialize_parameters(1)
    ddp = DistributedDataParallel(model, single_process(), ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=10_000))
    calls = {}
    original = ddp._on_grad_ready
    for param in model.parameters():
        param.main_grad_hook = lambda p: (calls.__setitem__(p, calls.get(p, 0) + 1), original(p))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ddp(tokens, torch.arange(16).expand_as(tokens), labels=tokens).mean().backward()
    assert calls[model.embedding.word_embeddings.weight] == 1
    fused = [p for p in model.parameters() if p.ndim == 2 and p is not model.embedding.position_embeddings.weight]
    assert all(calls.get(p) == 1 for p in fused)


# -- cross entropy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk_elements", [50 * 4, 1 << 26])  # several chunks / one
def test_fused_cross_entropy_equals_torch_with_masked_tokens(dtype, tolerance, chunk_elements):
    logits = (randn(7, 3, 50, seed=1) * 4).to(dtype)
    target = torch.randint(0, 50, (7, 3), generator=torch.Generator().manual_seed(2))
    mask = (torch.rand(7, 3, generator=torch.Generator().manual_seed(3)) > 0.3).float()

    reference = logits.float().clone().requires_grad_()
    want = F.cross_entropy(reference.view(-1, 50), target.view(-1), reduction="none").view(7, 3)
    ((want * mask).sum() / mask.sum()).backward()

    leaf = logits.clone().requires_grad_()
    got = fused_vocab_parallel_cross_entropy(leaf * 1, target, None, chunk_elements=chunk_elements)
    assert got.dtype == torch.float32
    ((got * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(got, want.detach(), rtol=tolerance, atol=tolerance)
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad.float(), reference.grad, rtol=tolerance, atol=tolerance * 0.1)
    assert torch.all(leaf.grad.view(-1, 50)[mask.view(-1) == 0] == 0)


def test_fused_cross_entropy_leaves_a_leaf_tensor_untouched():
    logits = randn(4, 2, 10, seed=1).requires_grad_()
    before = logits.detach().clone()
    fused_vocab_parallel_cross_entropy(logits, torch.zeros(4, 2, dtype=torch.long), None).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_gpt_model_loss_is_the_same_fused_or_not():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        model = GPTModel(llama_config(), single_process(), execution=ExecutionConfig(cross_entropy_loss_fusion=fused))
        model.initialize_parameters(3)
        loss = model(tokens, torch.arange(16).expand_as(tokens), labels=tokens).mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config_name", ["llama_config", "gpt2_config"])  # untied; tied with biases
def test_gpt_model_main_grads_are_the_same_with_and_without_fusion(config_name):
    """Whole model under DDP, 2 micro-batches: --gradient-accumulation-fusion changes no gradient."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed import parity

    tokens = torch.randint(0, 128, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for fusion in (False, True):
        model = GPTModel(getattr(parity, config_name)(), single_process(),
                         execution=ExecutionConfig(gradient_accumulation_fusion=fusion))
        model.initialize_parameters(3)
        ddp = DistributedDataParallel(model, single_process())
        ddp.zero_grad_buffer()
        for micro in tokens:
            ddp(micro, torch.arange(16).expand_as(micro), labels=micro).mean().backward()
        ddp.finish_grad_sync()
        grads.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
