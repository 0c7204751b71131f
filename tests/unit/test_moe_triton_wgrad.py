"""--moe-grouped-wgrad triton: the experts' weight gradients added into `main_grad` by one Triton
grouped GEMM, no product tensor.

The kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, the CPU; the GPU lane runs it
compiled): against a per-expert reference in fp32, fp16 and bf16 (which the wrapper widens to fp32
for the interpreter, whose bf16 `tl.dot` is wrong), with experts without rows (their `main_grad` left
bit for bit as it was), sentinel rows past the counted ones (left out), widths that are no multiple
of the tiles and experts whose rows span several row blocks. In a layer under data parallelism the
triton path gives the grouped-mm path's `main_grad` and makes no tensor of a stacked weight's size.
"""
import pytest
import torch

pytest.importorskip("triton")

from megatron.core.transformer.moe import triton_wgrad  # noqa: E402

COUNTS = [70, 0, 130, 5, 0, 64]  # rows per expert: 2 empty, one spanning 3 row blocks of 64
SENTINEL_ROWS = 3


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Triton's interpreter for the kernels built in this test (and a fresh kernel after it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_wgrad._kernel.cache_clear()
    yield
    triton_wgrad._kernel.cache_clear()


def _reference(main_grad, grad, x, counts):
    want, start = main_grad.clone(), 0
    for expert, count in enumerate(counts):
        want[expert] += grad[start:start + count].double().t().matmul(x[start:start + count].double()).float()
        start += count
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_adds_each_experts_gradient_into_main_grad(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, n, k = sum(COUNTS) + SENTINEL_ROWS, 48, 160  # k: a full tile of 128 and a partial one
    grad = torch.randn(rows, n, generator=generator).to(dtype)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    main_grad = torch.randn(len(COUNTS), n, k, generator=generator)
    before = main_grad.clone()
    ends = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    assert triton_wgrad.supported(grad, x, main_grad)
    triton_wgrad.accumulate_grouped_wgrad_(main_grad, grad, x, ends)
    want = _reference(before, grad, x, COUNTS)
    tolerance = dict(rtol=1e-5, atol=1e-4)
    for expert, count in enumerate(COUNTS):
        if count == 0:
            assert torch.equal(main_grad[expert], before[expert]), expert
        else:
            torch.testing.assert_close(main_grad[expert], want[expert], **tolerance, msg=f"expert {expert}")


def test_kernel_takes_no_operands_it_cannot():
    x = torch.randn(8, 16)
    assert not triton_wgrad.supported(x, x.bfloat16(), torch.zeros(2, 16, 16))         # mixed dtypes
    assert not triton_wgrad.supported(x, x, torch.zeros(2, 16, 16, dtype=torch.bfloat16))  # bf16 main_grad
    assert not triton_wgrad.supported(x.t(), x.t(), torch.zeros(2, 8, 8))               # column strides


def test_layer_main_grad_equals_the_grouped_mm_path():
    from tests.unit.test_moe_grad_fusion import COUNTS as BATCH_COUNTS, NewStacked, _experts, _micro_batches

    results = {}
    for wgrad in ("grouped-mm", "triton"):
        experts, ddp = _experts(torch.float32, fusion=True, grouped=True, moe_grouped_wgrad=wgrad)
        made = 0
        for counts, x, probs, grad in _micro_batches(torch.float32):  # an expert without rows in one
            out = ddp(x.clone().requires_grad_(), counts, probs)
            with NewStacked(experts) as stacked:
                out.backward(grad)
            made += stacked.made
        ddp.finish_grad_sync()
        results[wgrad] = (made, experts.fc1_weight.main_grad.clone(), experts.fc2_weight.main_grad.clone())
    assert results["grouped-mm"][0] == 2 * len(BATCH_COUNTS)  # a product per weight and micro-batch
    assert results["triton"][0] == 0                          # none
    for got, want in zip(results["triton"][1:], results["grouped-mm"][1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
