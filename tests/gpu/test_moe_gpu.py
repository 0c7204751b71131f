"""The experts' grouped GEMMs on the GPU (`pytest -m gpu`, run by bench/gpu_check.sh): the paths the
CPU cannot run, each against the loop of GEMMs it replaces.

- bf16: `torch._grouped_mm` (--moe-grouped-gemm) against the loop of F.linear, forward and backward;
  and with the weight gradients accumulated into an fp32 `main_grad` onto what the buffer holds: the
  product added eagerly, compiled, by the Triton grouped GEMM (--moe-grouped-wgrad triton), and by a
  cuBLAS GEMM per expert accumulating into it, the counts copied to the host without waiting
  (--moe-grouped-wgrad per-expert: one non-blocking copy, nothing else read back); under FP8 its
  per-expert `_scaled_mm` gradients (E5M2 x E4M3 under hybrid) against the loop, the weight
  gradient also as bf16 GEMMs of the widened casts accumulating into main_grad.
- FP8: `torch._scaled_grouped_mm` (one cast per tensor for all experts, each expert's scale per
  row) against the loop of `torch._scaled_mm` with each expert's `FP8Linear`: the same FP8 values,
  so only the bf16 rounding of the results differs; and both within the FP8 bound of bf16.
Rows per expert are multiples of 16 (as the experts pad them under FP8), one expert gets none.
Skipped without a GPU.
"""
import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.gpu
COUNTS = [32, 0, 48, 16]        # rows per expert (multiples of 16; an empty expert)
HIDDEN, FFN = 256, 512


def _data(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(COUNTS)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(len(COUNTS), FFN, HIDDEN, device="cuda", generator=generator) * 0.05).bfloat16()
    grad = (torch.randn(rows, FFN, device="cuda", generator=generator) * 1e-3).bfloat16()
    return x, weight, grad


def _run(function, x, weight, grad):
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    y = function(x, weight)
    y.backward(grad)
    return y.detach().float(), x.grad.float(), weight.grad.float()


def _with_main_grad(weight, start: float, empty: bool = False):
    """A leaf copy of `weight` with an fp32 `main_grad` holding `start` everywhere, marked empty (data
    parallelism's zeroed buffer at a step's first micro-batch) if `empty`."""
    fused = weight.clone().requires_grad_()
    fused.main_grad = torch.full(weight.shape, start, device=weight.device)
    fused.main_grad_empty = empty
    return fused


def _close(got, want, what):
    for name, g, w in zip(("output", "input grad", "weight grad"), got, want):
        torch.testing.assert_close(g, w, rtol=2 ** -7, atol=2 ** -7 * w.abs().max().item(), msg=f"{what}: {name}")


def test_grouped_mm_experts_equal_the_loop():
    from megatron.core.transformer.moe.experts import _grouped_linear, _grouped_mm_supported, _looped_linear

    x, weight, grad = _data(0)
    if not _grouped_mm_supported(x):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+ and this PyTorch")
    _close(_run(lambda a, w: _grouped_linear(a, w, COUNTS), x, weight, grad),
           _run(lambda a, w: _looped_linear(a, w, COUNTS), x, weight, grad), "bf16 grouped")


@pytest.mark.parametrize("compile_accumulate, triton", [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "triton"])
def test_grouped_mm_experts_accumulate_weight_gradients_into_main_grad(compile_accumulate, triton):
    from megatron.core.transformer.moe.experts import (
        _ExpertsFunction,
        _grouped_mm_supported,
        _looped_linear,
        accumulate_expert_grads_,
    )
    from megatron.core.utils import pick

    x, weight, grad = _data(2)
    if not _grouped_mm_supported(x):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+ and this PyTorch")
    want = _run(lambda a, w: _looped_linear(a, w, COUNTS), x, weight, grad)
    fused = _with_main_grad(weight, 0.5)  # accumulated onto, not overwritten
    inputs = x.clone().requires_grad_()
    if triton and importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    accumulate = pick(accumulate_expert_grads_, compile_accumulate)
    y = _ExpertsFunction.apply(inputs, fused, COUNTS, True, accumulate, triton)
    if triton:  # the Triton kernel takes these operands, and no product is formed
        from megatron.core.transformer.moe import triton_experts
        assert triton_experts.supported(grad, inputs, fused.main_grad)
        original, calls = torch._grouped_mm, []

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        torch._grouped_mm = counted
        try:
            y.backward(grad)
        finally:
            torch._grouped_mm = original
        assert len(calls) == 1  # the input gradient's grouped GEMM only: no weight-gradient product
    else:
        y.backward(grad)
    assert fused.grad is None
    _close((y.detach().float(), inputs.grad.float(), fused.main_grad - 0.5), want, "bf16 grouped, fused")


def test_per_expert_weight_gradients_accumulate_into_main_grad_with_counts_copied_without_waiting():
    """--moe-grouped-wgrad per-expert on the GPU: the counts (a device tensor) copied to pinned host
    memory with one non-blocking copy in forward; backward's GEMMs accumulate into main_grad (cuBLAS,
    fp32 output) what the loop of GEMMs computes, with no other copy to the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core.transformer.moe.experts import (
        HostCounts,
        _ExpertsFunction,
        _grouped_mm_supported,
        _looped_linear,
        accumulate_expert_grads_,
    )

    x, weight, grad = _data(3)
    if not _grouped_mm_supported(x):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+ and this PyTorch")

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.to_host = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._local_scalar_dense.default:
                self.to_host.append("item")
            if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].is_cuda:
                self.to_host.append(("copy_", bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))))
            return func(*args, **kwargs)

    from megatron.core.tensor_parallel.layers import _mixed_dtype_addmm_works

    assert _mixed_dtype_addmm_works(x.device)  # (probed here, not counted below: cuBLAS's fp32 output)
    want = _run(lambda a, w: _looped_linear(a, w, COUNTS), x, weight, grad)
    fused = _with_main_grad(weight, 0.5)  # accumulated onto, not overwritten
    inputs = x.clone().requires_grad_()
    counts = torch.tensor(COUNTS, device="cuda")
    with Copies() as forward:
        host = HostCounts(counts)
        y = _ExpertsFunction.apply(inputs, fused, counts, True, accumulate_expert_grads_, False, host)
    with Copies() as backward:
        y.backward(grad)
    assert forward.to_host == [("copy_", True)] and backward.to_host == []
    assert host.read() == COUNTS
    assert fused.grad is None
    _close((y.detach().float(), inputs.grad.float(), fused.main_grad - 0.5), want, "bf16 grouped, per-expert")


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_scaled_grouped_mm_fp8_experts_equal_the_loop(fp8_format):
    from megatron.core.transformer.fp8 import FP8Linear, FP8Options
    from megatron.core.transformer.moe.experts import _looped_linear
    from megatron.core.transformer.moe.fp8_experts import ExpertsFP8, _ExpertsFP8Function, grouped_fp8_supported

    x, weight, grad = _data(1)
    if not grouped_fp8_supported(x, rowwise=False):
        pytest.skip("torch._scaled_grouped_mm needs compute capability 9.x and this PyTorch")
    options = FP8Options(fp8_format, "tensorwise")
    grouped = ExpertsFP8([FP8Linear(options, None) for _ in COUNTS])
    loop = [FP8Linear(options, None) for _ in COUNTS]
    got = _run(lambda a, w: grouped(a, w, COUNTS), x, weight, grad)
    want = _run(lambda a, w: _ExpertsFP8Function.apply(a, w, COUNTS, loop, False), x, weight, grad)
    _close(got, want, f"FP8 {fp8_format} grouped")
    bf16 = _run(lambda a, w: _looped_linear(a, w, COUNTS), x, weight, grad)
    grad_u = 2.0 ** -3 if fp8_format == "hybrid" else 2.0 ** -4
    for name, g, w, bound in zip(("output", "input grad", "weight grad"), got, bf16,
                                 (math.hypot(2 ** -4, 2 ** -4),) + (math.hypot(grad_u, 2 ** -4),) * 2):
        error = ((g - w).norm() / w.norm()).item()
        assert error <= bound, (name, error, bound)
    assert torch.all(got[2][1] == 0)  # the expert without rows gets a zero weight gradient


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
@pytest.mark.parametrize("empty, bf16_accumulation", [(True, False), (False, False), (False, True)],
                         ids=["written", "added", "accumulated-in-bf16"])
def test_fp8_per_expert_gradients_equal_the_loop_on_cuda(fp8_format, empty, bf16_accumulation):
    """--moe-grouped-wgrad per-expert under FP8 on the GPU: the grouped forward, then per expert
    cuBLAS `_scaled_mm` (E5M2 x E4M3 under hybrid) on column slices of the transposed casts, whose
    leading dimension is rounded up to 16 bytes (here N = 101 rows with the sentinel rows: an
    expert's columns of an unpadded [n, N] transpose are no operand cuBLAS takes). The weight
    gradient written into a zeroed main_grad on a step's first micro-batch (`written`), else its
    product added (`added`, onto 0.5) or, with `bf16_accumulation`, the casts widened to bf16 and
    multiplied by cuBLAS accumulating into main_grad (`accumulated-in-bf16`: a column-major operand
    of the widened transpose, fp32 output); against the loop of `_scaled_mm` with each expert's
    `FP8Linear` (the same FP8 values)."""
    from megatron.core.transformer.fp8 import FP8Linear, FP8Options
    from megatron.core.transformer.moe.experts import HostCounts, accumulate_expert_grads_
    from megatron.core.transformer.moe.fp8_experts import ExpertsFP8, _ExpertsFP8Function, grouped_fp8_supported

    x, weight, grad = _data(4)
    if not grouped_fp8_supported(x, rowwise=False):
        pytest.skip("torch._scaled_grouped_mm needs compute capability 9.x and this PyTorch")
    rows, sentinel = sum(COUNTS), 5
    x_s = torch.cat([x, torch.zeros(sentinel, HIDDEN, device="cuda", dtype=x.dtype)])
    grad_s = torch.cat([grad, torch.ones(sentinel, FFN, device="cuda", dtype=grad.dtype)])
    options = FP8Options(fp8_format, "tensorwise")
    grouped = ExpertsFP8([FP8Linear(options, None) for _ in COUNTS])
    grouped.bf16_accumulation = bf16_accumulation
    loop = [FP8Linear(options, None) for _ in COUNTS]
    start = 0.0 if empty else 0.5
    fused = _with_main_grad(weight, start, empty)
    inputs = x_s.clone().requires_grad_()
    counts = torch.tensor(COUNTS, device="cuda")
    y = grouped(inputs, fused, counts, accumulate_expert_grads_, False, HostCounts(counts))
    y.backward(grad_s)
    want = _run(lambda a, w: _ExpertsFP8Function.apply(a, w, COUNTS, loop, False), x, weight, grad)
    _close((y[:rows].detach().float(), inputs.grad[:rows].float(), fused.main_grad - start), want,
           f"FP8 {fp8_format} per-expert gradients")
    assert torch.all(inputs.grad[rows:] == 0) and fused.grad is None
    assert torch.all(fused.main_grad[1] == start)  # the expert without rows: untouched


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.float8_e4m3fn),
                                    (torch.float8_e5m2, torch.float8_e4m3fn)], ids=["bf16", "fp8-e4m3", "fp8-hybrid"])
def test_triton_weight_gradient_kernel_on_cuda(dtypes):
    """--moe-grouped-wgrad triton's kernel compiled by Triton for this GPU (the CPU tests run it in the
    interpreter): partial tiles, an expert without rows, experts of several row blocks, sentinel rows;
    FP8 operands with each expert's dequantizing factor. Against fp64 sums of the same operands."""
    from megatron.core.transformer.moe import triton_experts

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    counts, n, k = [200, 0, 70, 333], 320, 192
    generator = torch.Generator(device="cuda").manual_seed(7)
    rows = sum(counts) + 16
    grad = torch.randn(rows, n, device="cuda", generator=generator).to(dtypes[0])
    x = torch.randn(rows, k, device="cuda", generator=generator).to(dtypes[1])
    scales = torch.rand(len(counts), device="cuda", generator=generator) + 0.5 if dtypes[0] != torch.bfloat16 else None
    main_grad = torch.randn(len(counts), n, k, device="cuda", generator=generator)
    want, start = main_grad.double(), 0
    for expert, count in enumerate(counts):
        product = grad[start:start + count].double().t() @ x[start:start + count].double()
        want[expert] += product * (scales[expert].double() if scales is not None else 1)
        start += count
    assert triton_experts.supported(grad, x, main_grad)
    before_empty = main_grad[1].clone()
    triton_experts.accumulate_grouped_wgrad_(main_grad, grad, x, torch.tensor(counts, device="cuda").cumsum(0).int(),
                                           scales)
    assert torch.equal(main_grad[1], before_empty)
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["hybrid", "e4m3"])
def test_triton_row_grouped_fp8_gemm_on_cuda(a_dtype):
    """FP8 hybrid's input gradient by Triton's row-grouped GEMM, compiled for this GPU: E5M2 rows
    times their expert's E4M3 weight cast (a transposed view), each row scaled, against fp64."""
    from megatron.core.transformer.moe import triton_experts

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    counts, k, n = [200, 0, 70, 333], 320, 192
    generator = torch.Generator(device="cuda").manual_seed(8)
    rows = sum(counts) + 16
    a = torch.randn(rows, k, device="cuda", generator=generator).mul(8).to(a_dtype)
    b = torch.randn(len(counts), n, k, device="cuda", generator=generator).mul(8).to(torch.float8_e4m3fn)
    b = b.transpose(1, 2)
    scale = torch.rand(rows, device="cuda", generator=generator) + 0.5
    ends = torch.tensor(counts, device="cuda").cumsum(0).int()
    out = triton_experts.fp8_grouped_rows_mm(a, b, scale, ends, torch.bfloat16)
    start = 0
    for expert, count in enumerate(counts):
        want = (a[start:start + count].double() @ b[expert].double()) * scale[start:start + count, None].double()
        torch.testing.assert_close(out[start:start + count].double(), want, rtol=2 ** -7, atol=1e-3)
        start += count


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_with_every_fusion_compiled_matches_eager_on_cuda(dispatcher):
    """The MoE layer in bf16 on the GPU with --moe-permute-fusion, --moe-router-fusion and the
    elementwise fusions compiled (the experts' SwiGLU, the weight gradients' one pass into
    main_grad) against the same layer eager: outputs, input gradient and main_grad within bf16's
    rounding. Also with --moe-grouped-wgrad triton (its kernel compiled by Triton here)."""
    from megatron.core.parallel_state import single_process
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.transformer.config import ExecutionConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.parallelize import compile_declared
    from tests.unit.test_moe_layer import config

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of compute capability 9.0+ (torch._grouped_mm in bf16)")
    fused = dict(fuse_elementwise=True, moe_permute_fusion=True, moe_router_fusion=True)
    variants = {"eager": {}, "fused": fused}
    if importlib.util.find_spec("triton") is not None:
        variants["fused, triton wgrad"] = dict(fused, moe_grouped_wgrad="triton")
    x = torch.randn(256, 2, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).bfloat16()
    results = {}
    for name, fields in variants.items():
        execution = ExecutionConfig(params_dtype=torch.bfloat16, **fields)
        layer = MoELayer(config(hidden_size=HIDDEN, moe_ffn_hidden_size=FFN // 4, num_experts=8,
                                moe_token_dispatcher_type=dispatcher), execution=execution, layer_number=0,
                         groups=single_process(torch.device("cuda")), device=torch.device("cuda"))
        generator = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, device="cuda", generator=generator) * 0.05)
        compile_declared(layer, execution)
        ddp = DistributedDataParallel(layer, single_process(torch.device("cuda")))
        ddp.zero_grad_buffer()
        inputs = x.clone().requires_grad_()
        for _ in range(2):  # two micro-batches: main_grad accumulates
            out = ddp(inputs)
            out.float().square().sum().backward()
        ddp.finish_grad_sync()
        results[name] = [out.detach().float(), inputs.grad.float()] + [
            param.main_grad.float().clone() for param in layer.experts.parameters()]
    for name in variants:
        for index, (got, want) in enumerate(zip(results[name], results["eager"])):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * scale, msg=f"{name}: tensor {index}")


@pytest.mark.parametrize("fp8_format", [None, "hybrid"], ids=["bf16", "fp8-hybrid"])
def test_auto_weight_gradient_probe_times_both_paths_on_cuda(fp8_format):
    """--moe-grouped-wgrad auto on the GPU: every path timed (no failure; FP8 also per-expert
    accumulating in bf16), the choice set on every module of the kind, the model's main_grad and
    weights untouched (the probe's gradients go to stand-ins). FP8: hybrid tensorwise experts on
    padded routing."""
    from megatron.core.transformer.fp8 import FP8Linear, FP8Options
    from megatron.core.transformer.moe.wgrad_choice import choose_expert_wgrad
    from tests.unit.test_moe_wgrad_choice import chunk, experts_of

    extra = dict(fp8=fp8_format, fp8_recipe="tensorwise", moe_router_padding_for_fp8=True) if fp8_format else {}
    modules = chunk(dtype=torch.bfloat16, device=torch.device("cuda"), **extra)
    with torch.no_grad():
        for param in modules.parameters():
            param.normal_(0, 0.1)
    for module in experts_of(modules):
        if fp8_format:
            module.attach_fp8(lambda: FP8Linear(FP8Options(fp8_format, "tensorwise"), None))
        for weight in (module.fc1_weight, module.fc2_weight):
            weight.main_grad = torch.zeros(weight.shape, device="cuda")
    before = [p.detach().clone() for p in modules.parameters()]
    report = choose_expert_wgrad([modules], 64, torch.device("cuda"))
    assert report.startswith("auto -> ") and "grouped-mm " in report and "per-expert " in report, report
    assert ("per-expert accumulating in bf16 " in report) == bool(fp8_format), report
    assert "failed" not in report, report
    chosen = {(module.per_expert_wgrad, module.fp8 is not None and module.fp8["fc1"].bf16_accumulation)
              for module in experts_of(modules)}
    assert len(chosen) == 1, chosen
    per_expert, accumulating = chosen.pop()
    name = "per-expert accumulating in bf16" if accumulating else "per-expert" if per_expert else "grouped-mm"
    assert report.startswith(f"auto -> {name} ("), report
    for param, old in zip(modules.parameters(), before):
        assert torch.equal(param.detach(), old)
    for module in experts_of(modules):
        assert not module.fc1_weight.main_grad.any() and not module.fc2_weight.main_grad.any()
