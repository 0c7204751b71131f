"""FP8 quantization reads each bf16 tensor as few times as its recipe allows: counted in the code
inductor generates on CPU for the compiled cast (the function the GPU runs as Triton).

Delayed scaling casts with the scale from the history, so nothing has to run before the cast: the
amax of this cast is reduced in the loop that casts (one read of the bf16 tensor). Current scaling
(tensorwise, and delayed before its first roll) needs the amax before the cast: two reads. Either
way the transpose is made from the FP8 result (1 byte per element), and the amax recorded is the
bf16 tensor's own.

Over one linear layer's forward + backward, with the history rolled, each bf16 tensor on its way to
an FP8 GEMM (the input, the weight, the output gradient) is read once.

Planted bugs these fail on (tools/dev/mutations.txt, FP8 one pass): the amax recorded from the
FP8 result instead of the bf16 tensor, and delayed scaling taking its scale from this tensor's
amax (a pass before the cast). The gradient's transpose unscaled with the input's scale is caught
by tests/unit/test_fp8.py's numerics."""
import re

import pytest
import torch

from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import fp8
from megatron.core.transformer.fp8 import GRAD, INPUT, WEIGHT, DelayedScaling, FP8Linear, FP8Options
from tests.unit.work_counting import generated_code


def reads_of_the_bf16_input(code: str) -> int:
    """How many loop nests of the one generated kernel load its bf16 input. Every loop nest of
    inductor's C++ kernels starts with a loop over x0; the kernel's signature names the input."""
    assert code.count("async_compile.cpp_pybinding") == 1, code
    kernel = code[code.index('extern "C"'):]
    name = re.search(r"const at::BFloat16\* (in_ptr\d+)", kernel).group(1)
    nests = re.split(r"for\(int64_t x0=", kernel)[1:]
    return sum(f"{name} +" in nest or f"{name}[" in nest for nest in nests)


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_the_compiled_cast_reads_its_input_once_with_a_given_scale(delayed):
    torch._dynamo.reset()
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    scale = torch.tensor(3.0) if delayed else None
    code = generated_code(fp8.compiled_cast_to_fp8(), x, scale, torch.float8_e4m3fn, 0, True)
    assert reads_of_the_bf16_input(code) == (1 if delayed else 2), code


class CastSpy:
    """Wraps the compiled cast, keeping each call's (input, reads of it in the generated code)."""

    def __init__(self, compiled):
        self.compiled, self.calls, self.reads = compiled, [], {}

    def __call__(self, x, scale, dtype, margin, transpose):
        key = (scale is None, dtype, transpose)
        if key not in self.reads:  # the first call of a kind compiles it: count its code
            self.reads[key] = reads_of_the_bf16_input(generated_code(self.compiled, x, scale, dtype, margin, transpose))
        self.calls.append((x, self.reads[key]))
        return self.compiled(x, scale, dtype, margin, transpose)


def test_one_linear_reads_each_bf16_tensor_once_on_its_way_to_fp8(monkeypatch):
    torch._dynamo.reset()
    spy = CastSpy(fp8.compiled_cast_to_fp8())
    monkeypatch.setattr(fp8, "compiled_cast_to_fp8", lambda: spy)
    options = FP8Options("hybrid", "delayed")
    scaling = DelayedScaling(options)
    linear = ColumnParallelLinear(48, 80, bias=False, tp=TensorParallel(),
                                  params_dtype=torch.bfloat16, gradient_accumulation_fusion=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=generator) * 0.1)
    linear.fp8 = FP8Linear(options, scaling, compiled=True)
    scaling.allocate("cpu")
    linear.fp8.bind()
    for micro_batch in range(2):  # the first fills the history; the second casts with its scales
        scaling.roll()
        spy.calls.clear()
        x = torch.randn(16, 2, 48, generator=generator).bfloat16().requires_grad_()
        grad = torch.randn(16, 2, 80, generator=generator).bfloat16()
        linear(x).backward(grad)
    reads = {}
    for tensor, count in spy.calls:
        reads[tensor.data_ptr()] = reads.get(tensor.data_ptr(), 0) + count
    # The weight was cast in the first micro-batch and is cached; the input and gradient read once.
    assert sorted(reads.values()) == [1, 1], reads
    # What was recorded is each bf16 tensor's own amax.
    slot = linear.fp8.first_slot
    assert scaling.amax[slot + INPUT] == x.detach().abs().max().float()
    assert scaling.amax[slot + GRAD] == grad.abs().max().float()
    assert scaling.weight_amax[slot + WEIGHT] == linear.weight.detach().abs().max().float()
