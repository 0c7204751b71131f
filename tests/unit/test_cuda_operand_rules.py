"""Every FP8 path passes its GEMMs operands a GPU takes, checked on the CPU.

The CPU's `torch._scaled_mm` multiplies operands that CUDA's refuses (a row-major second operand,
an unaligned leading dimension, two E5M2 operands), and `torch._scaled_grouped_mm` has no CPU kernel
at all, so a layout the GPU refuses used to surface only on a GPU. `tests/unit/cuda_operand_rules.py`
writes down the GPU's rules; here they are shown to refuse what they should, and the FP8 paths run
under them: the dense linear's three GEMMs for every recipe (written into fp32 main_grad too), a
tiny model's training steps, and the routed experts' loop, per-expert (--moe-grouped-wgrad
per-expert) and grouped paths (the grouped kernel's stand-in in tests/unit/test_fp8_experts.py holds
its arguments to the grouped rules).
"""
import pytest
import torch

from megatron.core.transformer.fp8 import writes_into
from tests.unit.cuda_operand_rules import CudaOperandRules, scaled_grouped_mm_problems, scaled_mm_problems
from tests.unit.test_fp8 import fp8_linear, randn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


@pytest.fixture(autouse=True)
def direct_output_probed():
    """`_scaled_mm`'s fp32 output probed before the counts below (once per process, else inside them)."""
    for rowwise in (False, True):
        writes_into(torch.zeros(16, 16), rowwise)


def fp8(rows, cols, dtype=E4M3, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def column_major(rows, cols, dtype=E4M3):
    return fp8(cols, rows, dtype).t()


MM_CASES = {
    "accepted": (lambda: (fp8(32, 64), column_major(64, 48), ONE, ONE), None),
    "b row-major": (lambda: (fp8(32, 64), fp8(64, 48), ONE, ONE), "b must be column-major"),
    "a column-major": (lambda: (column_major(32, 64), column_major(64, 48), ONE, ONE), "a must be row-major"),
    "two E5M2": (lambda: (fp8(32, 64, E5M2), column_major(64, 48, E5M2), ONE, ONE), "two E5M2"),
    "K not a multiple of 16": (lambda: (fp8(32, 40), column_major(40, 48), ONE, ONE), "multiples of 16"),
    # columns of a transposed cast whose rows are 40 bytes: cuBLAS refuses the leading dimension
    "unaligned leading dimension": (lambda: (fp8(32, 40)[:, :32], column_major(32, 48), ONE, ONE),
                                    "leading dimension"),
    "unaligned start": (lambda: (fp8(32, 48)[:, 8:40], column_major(32, 48), ONE, ONE), "16-byte boundary"),
    "row-wise hybrid": (lambda: (fp8(32, 64, E5M2), column_major(64, 48), torch.ones(32, 1), torch.ones(1, 48)),
                        "row-wise scales need two E4M3"),
    "fp16 scale": (lambda: (fp8(32, 64), column_major(64, 48), ONE.half(), ONE), "scale_a must be fp32"),
}


@pytest.mark.parametrize("case", list(MM_CASES))
def test_the_scaled_mm_rules_refuse_what_a_gpu_refuses(case):
    make, refusal = MM_CASES[case]
    a, b, scale_a, scale_b = make()
    problems = scaled_mm_problems(a, b, scale_a, scale_b, torch.bfloat16)
    if refusal is None:
        assert problems == []
    else:
        assert any(refusal in problem for problem in problems), problems
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
    wrong_out = scaled_mm_problems(a, b, scale_a, scale_b, torch.bfloat16, out=out)
    assert any("out is torch.float32" in problem for problem in wrong_out), wrong_out
    column_out = torch.empty(b.shape[1], a.shape[0], dtype=torch.bfloat16).t()
    assert any("out must be row-major" in p for p in scaled_mm_problems(a, b, scale_a, scale_b, torch.bfloat16,
                                                                         out=column_out))


def _grouped(a_dtype=E4M3, contracted=False, b_row_major=False, groups=(16, 48), scale_b_shape=None):
    offs = torch.tensor(groups, dtype=torch.int32)
    if contracted:  # the weight gradient: a [m, N] row-major, b [N, n] column-major, groups along N
        a, b = fp8(32, 64, a_dtype), column_major(64, 48)
        scale_a, scale_b = torch.ones(2 * 32), torch.ones(scale_b_shape or (2 * 48,))
    else:           # the forward: a [N, k], b [E, k, n] column-major per group
        a = fp8(64, 32, a_dtype)
        b = torch.stack([fp8(32, 48), fp8(32, 48)]) if b_row_major else torch.stack([fp8(48, 32)] * 2).transpose(1, 2)
        scale_a, scale_b = torch.ones(64), torch.ones(scale_b_shape or (2, 48))
    return a, b, scale_a, scale_b, offs


GROUPED_CASES = {
    "rows accepted": (dict(), None),
    "contracted accepted": (dict(contracted=True), None),
    "E5M2 operand": (dict(a_dtype=E5M2), "both be E4M3"),
    "b row-major": (dict(b_row_major=True), "b must be column-major"),
    "contracted group of 24": (dict(contracted=True, groups=(24, 64)), "multiples of 16 long"),
    "decreasing offsets": (dict(groups=(48, 16)), "must not decrease"),
    "scale_b per group missing": (dict(scale_b_shape=(48,)), "scale_b must be contiguous fp32 (2, 48)"),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_the_scaled_grouped_mm_rules_refuse_what_a_gpu_refuses(case):
    overrides, refusal = GROUPED_CASES[case]
    problems = scaled_grouped_mm_problems(*_grouped(**overrides))
    if refusal is None:
        assert problems == []
    else:
        assert any(refusal in problem for problem in problems), problems


def test_the_dispatch_mode_stops_a_refused_call_and_counts_the_others():
    with CudaOperandRules() as rules:
        torch._scaled_mm(fp8(32, 64), column_major(64, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.bfloat16)
        out = torch.empty(32, 48)
        torch._scaled_mm(fp8(32, 64), column_major(64, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32,
                         out=out)
        with pytest.raises(AssertionError, match="b must be column-major"):
            torch._scaled_mm(fp8(32, 64), fp8(64, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.bfloat16)
    assert rules.checked == 2


@pytest.mark.parametrize("fp8_format, recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"),
                                                ("hybrid", "delayed"), ("e4m3", "rowwise")])
def test_dense_fp8_linear_gemms_take_gpu_operands(fp8_format, recipe):
    """Forward, input gradient and weight gradient (from the bf16 input, from the kept FP8 transpose,
    and written into an fp32 main_grad) of one FP8 linear, twice (delayed: from the history)."""
    linear, scaling = fp8_linear(fp8_format, recipe)
    x, weight, grad = randn(3, 16, 64, seed=1), randn(96, 64, seed=2, scale=0.1), randn(3, 16, 96, seed=3, scale=1e-3)
    main_grad = torch.zeros(96, 64)
    writes_into = linear.writes_into(main_grad)  # (probed here, not counted below)
    with CudaOperandRules() as rules:
        for _ in range(2):
            if scaling is not None:
                scaling.roll()
            _, kept = linear.forward_keeping_input(x, weight, keep_input=True)
            grad_fp8 = linear.quantize_grad(grad)
            linear.dgrad(grad, weight, grad_fp8)
            linear.wgrad(grad.reshape(-1, 96), x.reshape(-1, 64), grad_fp8, kept)
            if writes_into:
                linear.wgrad(grad.reshape(-1, 96), x.reshape(-1, 64), grad_fp8, kept, out=main_grad)
    assert rules.checked == 2 * (4 if writes_into else 3)


def test_fp8_model_training_steps_take_gpu_operands():
    """Two optimizer steps of a tiny FP8 model (hybrid, delayed; 4 micro-batches): every GEMM of
    every linear, the first micro-batch's weight gradients written into main_grad."""
    from tests.unit.test_fp8_wgrad import _fp8_training, _fp8_weights

    model, step = _fp8_training(torch.bfloat16)
    with CudaOperandRules() as rules:
        step()
        step()
    assert rules.checked == 2 * 4 * 3 * len(_fp8_weights(model))


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_fp8_experts_loop_takes_gpu_operands(fp8_format):
    """Unpadded routing: the per-expert loop on rows padded to 16 (an expert with none included),
    weight gradients written into and added to main_grad."""
    from tests.unit.test_moe_grad_fusion import COUNTS, _experts, _train

    experts, ddp = _experts(torch.bfloat16, fusion=True, fp8_recipe="tensorwise", fp8_format=fp8_format)
    with CudaOperandRules() as rules:
        _train(experts, ddp, torch.bfloat16)
    with_rows = sum(count > 0 for counts in COUNTS for count in counts)
    assert rules.checked == 2 * 3 * with_rows  # per weight and expert with rows: three GEMMs


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_fp8_experts_per_expert_gradients_take_gpu_operands(fp8_format):
    """--moe-grouped-wgrad per-expert on padded routing (counts multiples of 16 on the device, an
    expert without rows, sentinel rows after the counted ones): both gradient GEMMs of every expert
    with rows, from column slices of the transposed casts, E5M2 times E4M3 under hybrid."""
    from tests.unit.test_moe_grad_fusion import HIDDEN, _cpu_grouped_mm, _experts

    if not _cpu_grouped_mm():
        pytest.skip("this PyTorch has no CPU torch._grouped_mm (2.13 has; the GPU lane tests the kernel)")
    experts, ddp = _experts(torch.bfloat16, fusion=True, fp8_recipe="tensorwise", grouped=True,
                            fp8_format=fp8_format, moe_router_padding_for_fp8=True, moe_grouped_wgrad="per-expert")
    generator = torch.Generator().manual_seed(5)
    all_counts = ([16, 0, 32, 16], [48, 16, 16, 0])
    with CudaOperandRules() as rules:
        for counts in all_counts:
            rows = sum(counts) + 16
            x = torch.randn(rows, HIDDEN, generator=generator).bfloat16().requires_grad_()
            out = ddp(x, torch.tensor(counts), torch.rand(rows, generator=generator).bfloat16())
            out.backward(torch.randn(rows, HIDDEN, generator=generator).bfloat16())
    with_rows = sum(count > 0 for counts in all_counts for count in counts)
    assert rules.checked == 2 * 2 * with_rows  # per weight and expert with rows: input and weight gradient
