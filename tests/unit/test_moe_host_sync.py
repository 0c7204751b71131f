"""The MoE layer keeps its routing on the device: at expert-parallel size 1, with either dispatcher,
one forward and backward reads nothing back to the host.

Shown three ways: on the CPU under a dispatch mode that counts what synchronizes a GPU
(`aten::_local_scalar_dense`, i.e. `.item()`, and `nonzero`) with `Tensor.tolist` counted too (it
reads a CPU tensor without dispatching); on the meta device, where any of those, or any shape that
depends on the data, raises; and by `torch.compile(fullgraph=True)` capturing the forward as one
graph. Two micro-batches routed differently through one layer each equal the naive per-token loop
(nothing of the first, such as its tokens per expert, is reused by the second).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.unit.test_moe_layer import HIDDEN, config

# Expert FFN 16: the grouped GEMMs take rows of 16-byte multiples (fp32 and bf16).
CASES = {
    "allgather": dict(),
    "alltoall": dict(moe_token_dispatcher_type="alltoall"),
    "capacity": dict(moe_expert_capacity_factor=0.75, moe_token_dispatcher_type="alltoall"),
    "biases gelu top-1": dict(add_bias_linear=True, swiglu=False, moe_router_topk=1),
    "deepseek-like": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                          moe_router_num_groups=2, moe_router_group_topk=1, moe_shared_expert_intermediate_size=16,
                          moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
}


def moe_layer(overrides, dtype=torch.float32, device="cpu", seed=0):
    cfg = config(moe_ffn_hidden_size=16, **overrides)
    layer = MoELayer(cfg, execution=ExecutionConfig(params_dtype=dtype), layer_number=0, groups=single_process(),
                     device=torch.device(device))
    if device != "meta":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return layer


class HostReads(TorchDispatchMode):
    """Counts the ops that make a GPU wait for its results: a scalar read (`.item()`), `nonzero`,
    and copies from a non-CPU device to the CPU."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.reads.append(str(func))
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu":
                self.reads.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    """A HostReads that also counts `Tensor.tolist` (which reads a CPU tensor without dispatching)."""
    mode = HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: mode.reads.append("tolist") or tolist(self))
    return mode


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_read_nothing_back(name, host_reads):
    layer = moe_layer(CASES[name])
    x = torch.randn(6, 2, HIDDEN, requires_grad=True)
    assert layer.experts.uses_grouped_mm(x.view(-1, HIDDEN))
    with host_reads:
        layer(x).square().sum().backward()
    assert host_reads.reads == []
    assert all(param.grad is not None for param in layer.parameters())


def test_the_counter_sees_the_loop_fallback(host_reads, monkeypatch):
    """Where PyTorch has no grouped GEMM the experts read their row counts back, and the count says so."""
    monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: False)
    layer = moe_layer({})
    with host_reads:
        layer(torch.randn(6, 2, HIDDEN)).sum()
    assert host_reads.reads == ["tolist"]


@pytest.mark.parametrize("name", ["allgather", "capacity", "deepseek-like"])
def test_forward_and_backward_run_on_the_meta_device(name, monkeypatch):
    """The meta device has no data: a read-back or a data-dependent shape would raise. (Its grouped
    GEMM is the CUDA kernel's shape function, bf16 only, and is not in `_grouped_mm_supported`.)"""
    monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: True)
    layer = moe_layer(CASES[name], dtype=torch.bfloat16, device="meta")
    x = torch.empty(6, 2, HIDDEN, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape


def test_torch_compile_captures_the_forward_as_one_graph():
    """bf16: PyTorch's shape function of the grouped GEMM (used while tracing) takes bf16 only."""
    torch._dynamo.reset()
    layer = moe_layer(CASES["deepseek-like"], dtype=torch.bfloat16)
    x = torch.randn(6, 2, HIDDEN, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def naive(layer, x):
    """Per token: the sum over its chosen experts of prob x expert(token) (SwiGLU experts)."""
    experts, tokens = layer.experts, x.reshape(-1, HIDDEN)
    probs, routing_map = layer.router(x)
    out = torch.zeros_like(tokens)
    for t, e in routing_map.nonzero().tolist():
        gate, up = F.linear(tokens[t], experts.fc1_weight[e]).chunk(2)
        out[t] += probs[t, e] * F.linear(F.silu(gate) * up, experts.fc2_weight[e])
    return out.view(x.shape)


@pytest.mark.parametrize("name", ["allgather", "capacity"])
def test_micro_batches_routed_differently_each_equal_the_naive_loop(name):
    layer = moe_layer(CASES[name])
    generator = torch.Generator().manual_seed(5)
    first = torch.randn(6, 2, HIDDEN, generator=generator)
    second = torch.randn(6, 2, HIDDEN, generator=generator) * 3
    outputs = [layer(first), layer(second)]
    assert not torch.equal(layer.router(first)[1].sum(0), layer.router(second)[1].sum(0))
    with torch.no_grad():
        for x, out in zip((first, second), outputs):
            torch.testing.assert_close(out, naive(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_experts_with_padded_routing_read_nothing_back(recipe, host_reads):
    """--moe-router-padding-for-fp8: the FP8 experts take the counts as a device tensor (one amax
    per expert by a segment reduction, one cast of all rows, grouped GEMMs), so the FP8 layer at
    EP 1 reads nothing back either; without the flag the per-expert row padding reads them once."""
    from tests.unit.test_moe_router_padding_fp8 import TOKENS, fp8_layer, train

    layer, scaling = fp8_layer(recipe)
    train(layer, scaling, steps=1)  # delayed: past the first step, the scales come from the history
    with host_reads:
        train(layer, scaling, steps=2)
    assert host_reads.reads == []
    layer, scaling = fp8_layer(recipe, padded=False)
    with host_reads:
        layer(torch.randn(TOKENS // 2, 2, 64)).sum()
    assert host_reads.reads == ["tolist"]
