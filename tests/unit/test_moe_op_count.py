"""The work of one MoE layer does not grow with its expert count, and the grouped weight gradient is
the per-expert loop's.

Operators (aten ops under a dispatch mode) of one forward + backward of a layer with 8 and with 128
experts (the same tokens, top-2): at most 25% more with 128 (the per-expert loop made 9.9x as many).
The grouped GEMMs' weight gradient (one `torch._grouped_mm` per weight, groups along the rows) equals
the loop of per-expert GEMMs at rtol 1e-6 in fp32, plain and accumulated into `main_grad`, and an
expert that receives no row gets a zero gradient. Its way into `main_grad` skips the slots of the
experts without rows whatever they hold (a kernel need not write them), and compiled it is one pass:
one kernel, in place, no buffer allocated.
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.experts import _ExpertsFunction, accumulate_expert_grads_
from megatron.core.utils import pick
from tests.unit.test_moe_host_sync import HIDDEN, moe_layer
from tests.unit.work_counting import generated_code

COUNTS = [5, 0, 7, 4, 0, 9]  # rows per expert; experts 1 and 4 receive none


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def layer_ops(num_experts: int, **overrides) -> collections.Counter:
    layer = moe_layer(dict(num_experts=num_experts, **overrides))
    x = torch.randn(32, 2, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(0))
    with OpCount() as count:
        layer(x).square().sum().backward()
    return count.ops


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_operators_per_layer_do_not_grow_with_the_expert_count(dispatcher):
    few, many = layer_ops(8, moe_token_dispatcher_type=dispatcher), layer_ops(128, moe_token_dispatcher_type=dispatcher)
    assert sum(many.values()) <= 1.25 * sum(few.values()), (sum(few.values()), sum(many.values()))
    # Each weight: one grouped GEMM forward, one for the input gradient, one for the weight gradient.
    assert few["_grouped_mm"] == many["_grouped_mm"] == 6
    assert many["mm"] + many["addmm"] <= few["mm"] + few["addmm"]  # no GEMM per expert


def test_the_loop_fallback_grows_with_the_expert_count(monkeypatch):
    """The count above can see the difference: the loop of GEMMs where torch._grouped_mm is missing."""
    monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: False)
    few, many = sum(layer_ops(8).values()), sum(layer_ops(128).values())
    assert many > 3 * few


def _data(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), 16, generator=generator)
    weight = torch.randn(len(COUNTS), 8, 16, generator=generator)
    grad = torch.randn(sum(COUNTS), 8, generator=generator)
    return x, weight, grad


def _gradients(grouped: bool, fuse_wgrad: bool, counts):
    x, weight, grad = _data(0)
    x.requires_grad_()
    weight = weight.requires_grad_()
    if fuse_wgrad:
        weight.main_grad = torch.full(weight.shape, 0.25)  # accumulated onto, not overwritten
    y = _ExpertsFunction.apply(x, weight, counts, grouped, accumulate_expert_grads_ if fuse_wgrad else None)
    y.backward(grad)
    return y.detach(), x.grad, weight.main_grad - 0.25 if fuse_wgrad else weight.grad


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["returned", "into main_grad"])
def test_grouped_weight_gradient_equals_the_loop(fuse_wgrad):
    looped = _gradients(False, fuse_wgrad, COUNTS)
    grouped = _gradients(True, fuse_wgrad, torch.tensor(COUNTS))
    for name, got, want in zip(("output", "input gradient", "weight gradient"), grouped, looped):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    weight_grad = grouped[2]
    for expert, count in enumerate(COUNTS):
        assert bool(weight_grad[expert].eq(0).all()) == (count == 0), expert


def _product_and_counts(seed, num_experts=len(COUNTS)):
    """A grouped weight gradient [E, 8, 16] in bf16 whose empty experts' slots hold NaN (what a kernel
    may leave there), with its row counts."""
    counts = torch.tensor((COUNTS * num_experts)[:num_experts])
    product = torch.randn(num_experts, 8, 16, generator=torch.Generator().manual_seed(seed)).bfloat16()
    product[counts.eq(0)] = float("nan")
    return product, counts


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
def test_accumulating_the_product_skips_experts_without_rows(compile_it):
    product, counts = _product_and_counts(3)
    main_grad = torch.full(product.shape, 0.25)
    pick(accumulate_expert_grads_, compile_it)(main_grad, product, counts)
    for expert, count in enumerate(counts.tolist()):
        want = 0.25 + (product[expert].float() if count else torch.zeros(8, 16))
        torch.testing.assert_close(main_grad[expert], want, rtol=0, atol=0, msg=f"expert {expert}")


def test_compiled_accumulation_is_one_pass_in_place():
    """Compiled (--gradient-accumulation-fusion with the elementwise fusions): one kernel that reads
    the product and main_grad once and writes main_grad itself; the eager select + add allocated a
    selected copy of the product and passed over the weights twice."""
    product, counts = _product_and_counts(4, num_experts=10)  # shapes no other test compiles
    main_grad = torch.zeros(product.shape)
    code = generated_code(torch.compile(accumulate_expert_grads_, fullgraph=True, dynamic=False),
                          main_grad, product, counts)
    assert code.count('extern "C"') == 1, code
    assert "empty_strided_cpu((" not in code, code  # no intermediate buffer
    assert torch.equal(main_grad, torch.where(counts.eq(0).view(-1, 1, 1), 0, product).float())


@pytest.mark.parametrize("dispatcher, overrides", [("alltoall", {}), ("allgather", {}),
                                                   ("alltoall", dict(moe_expert_capacity_factor=1.0))],
                         ids=["alltoall", "allgather", "capacity"])
def test_combine_and_dispatch_backward_gather_rows_instead_of_scattering(dispatcher, overrides):
    """Every token has top-k rows (dropped slots in the sentinel group): the combine and the dispatch's
    backward gather each token's rows and sum them in order, no scatter-add (atomic adds on a GPU,
    measured at 0.54 ms per call for Qwen3-30B-A3B's [32768, 2048] rows on an H200, where the gather
    moves the same bytes)."""
    layer = moe_layer(dict(num_experts=8, moe_token_dispatcher_type=dispatcher, **overrides))
    x = torch.randn(32, 2, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(0))
    with RowScatters() as scatters:
        layer(x).square().sum().backward()
    assert scatters.ops == [], scatters.ops  # (the probabilities' [N] gradient may scatter: N values)


class RowScatters(TorchDispatchMode):
    """The scatter-adds (index_add, scatter_add, index_put with accumulate) into tensors of hidden
    rows [*, HIDDEN]."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_") and (
                out.dim() >= 2 and out.shape[-1] == HIDDEN):
            self.ops.append((name, tuple(out.shape)))
        return out


@pytest.mark.parametrize("may_drop", [False, True])
def test_gathered_combine_and_its_backward_equal_the_scatter_add(may_drop):
    """gather_rows + unpermute with `slot_row` (gathers, sums over each token's slots) against the
    scatter-add path: outputs and both gradients at fp32 rounding, sentinel rows adding nothing."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import gather_rows, sort_by_expert, unpermute

    generator = torch.Generator().manual_seed(5)
    tokens, experts, topk, hidden = 12, 6, 3, 4
    probs, routing_map = moe_utils.topk_routing(torch.randn(tokens, experts, generator=generator), topk)
    if may_drop:  # experts 4 and 5 elsewhere, token 0's first choice dropped
        routing_map = routing_map.clone()
        routing_map[0, routing_map[0].nonzero()[0, 0]] = False
    token_index, row_probs, _, row_valid, slot_row = sort_by_expert(
        probs, routing_map, topk=topk, num_experts=4 if may_drop else experts, may_drop=may_drop)
    assert sorted(slot_row.tolist()) == list(range(tokens * topk))
    assert torch.equal(token_index.index_select(0, slot_row), torch.arange(tokens).repeat_interleave(topk))

    x = torch.randn(tokens, hidden, generator=generator)
    weight = torch.randn(tokens * topk, hidden, generator=generator)
    probe = torch.randn(tokens, hidden, generator=generator)
    results = []
    for slots in (slot_row, None):
        leaf = x.clone().requires_grad_()
        rows = gather_rows(leaf, token_index, row_valid, slots)
        expert_out = (rows * weight).requires_grad_()
        expert_out.retain_grad()
        out = unpermute(expert_out, token_index, tokens, row_probs, row_valid, slots)
        (out * probe).sum().backward()
        results.append((out, leaf.grad, expert_out.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
