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

from megatron.core.transformer.moe import triton_experts  # noqa: E402

COUNTS = [70, 0, 130, 5, 0, 64]  # rows per expert: 2 empty, one spanning 3 row blocks of 64
SENTINEL_ROWS = 3


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Triton's interpreter for the kernels built in this test (and a fresh kernel after it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_experts._kernels.cache_clear()
    yield
    triton_experts._kernels.cache_clear()


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
    assert triton_experts.supported(grad, x, main_grad)
    triton_experts.accumulate_grouped_wgrad_(main_grad, grad, x, ends)
    want = _reference(before, grad, x, COUNTS)
    tolerance = dict(rtol=1e-5, atol=1e-4)
    for expert, count in enumerate(COUNTS):
        if count == 0:
            assert torch.equal(main_grad[expert], before[expert]), expert
        else:
            torch.testing.assert_close(main_grad[expert], want[expert], **tolerance, msg=f"expert {expert}")


@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "hybrid"])
def test_kernel_takes_fp8_casts_with_each_experts_scale(grad_dtype):
    """FP8 experts' casts as they are (gradient E4M3, or E5M2 under hybrid, times the E4M3 input),
    each expert's sum scaled by its dequantizing factor: the exact products of the same FP8 values."""
    generator = torch.Generator().manual_seed(1)
    rows, n, k = sum(COUNTS) + SENTINEL_ROWS, 32, 144
    grad = torch.randn(rows, n, generator=generator).mul(4).to(grad_dtype)
    x = torch.randn(rows, k, generator=generator).mul(4).to(torch.float8_e4m3fn)
    scales = torch.rand(len(COUNTS), generator=generator) + 0.5
    main_grad = torch.randn(len(COUNTS), n, k, generator=generator)
    before = main_grad.clone()
    assert triton_experts.supported(grad, x, main_grad)
    triton_experts.accumulate_grouped_wgrad_(main_grad, grad, x, torch.tensor(COUNTS).cumsum(0).to(torch.int32), scales)
    unscaled = _reference(torch.zeros_like(before), grad.float(), x.float(), COUNTS)
    for expert, count in enumerate(COUNTS):
        if count == 0:
            assert torch.equal(main_grad[expert], before[expert]), expert
        else:
            torch.testing.assert_close(main_grad[expert], before[expert] + scales[expert] * unscaled[expert],
                                       rtol=1e-5, atol=1e-4, msg=f"expert {expert}")


@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["hybrid", "e4m3"])
def test_row_grouped_fp8_gemm_multiplies_each_row_by_its_experts_weight(a_dtype):
    """FP8 hybrid's input gradient: E5M2 (or E4M3) gradient rows times their expert's E4M3 weight
    cast (a transposed view, as the weight cast is kept), each row scaled; experts without rows and
    of several row tiles, widths that are no multiple of the tiles. The exact products of the same
    FP8 values, summed in fp32, one conversion to bf16."""
    from megatron.core.transformer.moe.fp8_experts import _row_groups, _with_sentinel

    generator = torch.Generator().manual_seed(2)
    counts = [70, 0, 300, 5, 0, 64]            # the 300 rows span 3 row tiles of 128
    rows, k, n = sum(counts) + SENTINEL_ROWS, 160, 48
    a = torch.randn(rows, k, generator=generator).mul(8).to(a_dtype)
    b = torch.randn(len(counts), n, k, generator=generator).mul(8).to(torch.float8_e4m3fn).transpose(1, 2)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    row_scale = _with_sentinel(torch.rand(len(counts), generator=generator) + 0.5).index_select(
        0, _row_groups(ends, rows)) * (torch.rand(rows, generator=generator) + 0.5)
    out = triton_experts.fp8_grouped_rows_mm(a, b, row_scale, ends, torch.bfloat16)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    start = 0
    for expert, count in enumerate(counts):
        want = (a[start:start + count].double() @ b[expert].double()) * row_scale[start:start + count, None].double()
        # one bf16 ulp (2^-7 of the value at worst): the interpreter's conversion to bf16 truncates
        torch.testing.assert_close(out[start:start + count].double(), want, rtol=2 ** -7, atol=1e-6,
                                   msg=f"expert {expert}")
        start += count


def test_row_tiles_never_span_two_experts():
    counts = [70, 0, 300, 5, 0, 64]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    expert, first = triton_experts._row_tiles(ends, sum(counts) + SENTINEL_ROWS)
    tiles = [(e, r) for e, r in zip(expert.tolist(), first.tolist()) if e < len(counts)]
    assert tiles == [(0, 0), (2, 70), (2, 198), (2, 326), (3, 370), (5, 375)]
    assert expert.numel() == -(-(sum(counts) + SENTINEL_ROWS) // triton_experts.ROWS_BLOCK_M) + len(counts)


def test_kernel_takes_no_operands_it_cannot():
    x = torch.randn(8, 16)
    assert not triton_experts.supported(x, x.bfloat16(), torch.zeros(2, 16, 16))         # mixed dtypes
    assert not triton_experts.supported(x, x, torch.zeros(2, 16, 16, dtype=torch.bfloat16))  # bf16 main_grad
    assert not triton_experts.supported(x.t(), x.t(), torch.zeros(2, 8, 8))               # column strides
    fp8 = x.to(torch.float8_e4m3fn)
    assert triton_experts.supported(fp8, x.to(torch.float8_e5m2), torch.zeros(2, 16, 16))  # FP8: any two formats
    assert not triton_experts.supported(fp8, x.bfloat16(), torch.zeros(2, 16, 16))        # FP8 with bf16


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


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_fp8_layer_main_grad_equals_the_grouped_path(fp8_format, monkeypatch):
    """FP8 experts on padded routing (counts on the device, tensorwise): the Triton kernel adds each
    expert's dequantized sum of the casts into main_grad; the grouped path (here the dequantized
    grouped GEMM, as on the CPU) forms a product in bf16 and adds it. Same FP8 values and scales; the
    grouped path rounds each micro-batch's product to bf16 (the kernel's sums stay fp32, exact
    against the casts in the kernel test above), so within that rounding. With the kernels the
    backward runs no other grouped FP8 GEMM: where no FP8 grouped kernel takes the gradient (the
    CPU; hybrid's E5M2 on the GPU) the input gradient is Triton's row-grouped GEMM too, the same
    within one bf16 rounding."""
    from megatron.core.transformer.fp8 import FP8Linear, FP8Options
    from megatron.core.transformer.moe import fp8_experts
    from tests.unit.test_moe_grad_fusion import _experts

    grouped_gemm, calls = fp8_experts._grouped_gemm, []
    monkeypatch.setattr(fp8_experts, "_grouped_gemm", lambda *a: calls.append(1) or grouped_gemm(*a))
    generator = torch.Generator().manual_seed(5)
    batches = []
    for counts in ([16, 0, 32, 16], [32, 16, 16, 0]):  # multiples of 16, as the padded routing makes them
        rows = sum(counts) + 16  # and sentinel rows after them
        batches.append((torch.tensor(counts), torch.randn(rows, 16, generator=generator).bfloat16(),
                        torch.rand(rows, generator=generator).bfloat16(),
                        torch.randn(rows, 16, generator=generator).bfloat16()))
    results = {}
    for wgrad in ("grouped-mm", "triton"):
        experts, ddp = _experts(torch.bfloat16, fusion=True, grouped=True, moe_router_padding_for_fp8=True,
                                moe_grouped_wgrad=wgrad)
        for linear in experts.attach_fp8(lambda: FP8Linear(FP8Options(fp8_format, "tensorwise"), None)):
            linear.bind()
        backward_gemms, input_grads = 0, []
        for counts, x, probs, grad in batches:
            inputs = x.clone().requires_grad_()
            out = ddp(inputs, counts, probs)
            calls.clear()
            out.backward(grad)
            backward_gemms += len(calls)
            input_grads.append(inputs.grad[:int(counts.sum())].float())
        ddp.finish_grad_sync()
        results[wgrad] = (backward_gemms, torch.cat(input_grads), experts.fc1_weight.main_grad.clone(),
                          experts.fc2_weight.main_grad.clone())
    assert results["grouped-mm"][0] == 2 * 2 * len(batches) and results["triton"][0] == 0
    input_grad, fc1, fc2 = results["triton"][1:]
    want_input_grad, want_fc1, want_fc2 = results["grouped-mm"][1:]
    # fc2's weight gradient: the same casts, within the grouped path's bf16 product rounding.
    torch.testing.assert_close(fc2, want_fc2, rtol=2 ** -7, atol=2 ** -7 * want_fc2.abs().max().item())
    # Downstream of fc2's input gradient (bf16-rounded differently by the two GEMMs), fc1's gradient
    # casts round some elements to the neighbouring FP8 value: FP8's bound, not bf16's.
    for got, want in ((input_grad, want_input_grad), (fc1, want_fc1)):
        assert ((got - want).norm() / want.norm()).item() <= 2 ** -4
    assert fc1.abs().sum() > 0 and fc2.abs().sum() > 0
