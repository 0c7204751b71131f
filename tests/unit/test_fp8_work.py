"""FP8 does each cast once: counted on CPU over real training steps.

Per linear and micro-batch there are three `_scaled_mm` GEMMs (forward, input gradient, weight
gradient). With one scale per tensor the input and the output gradient are each cast once (the
forward keeps the input's FP8 transpose for the weight gradient; the backward casts the gradient
once for both GEMMs) and the weight once per optimizer step: (2 + 1/M) casts per 3 GEMMs over M
micro-batches. Casting again in backward (the old code: the input twice, the gradient twice) makes
it (4 + 1/M) / 3 and fails these tests, as does keeping the bf16 input, or rolling the amax history
in evaluation, or leaving the cached weights' amaxes out of a roll.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.fp8 import WEIGHT, DelayedScaling, FP8Linear, FP8Options

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MICRO_BATCHES = 4


class CountFP8Work(TorchDispatchMode):
    """Counts `_scaled_mm` calls and casts into a float8 dtype from any other dtype."""

    def __init__(self):
        super().__init__()
        self.gemms = self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm.out):  # .out: into main_grad
            self.gemms += 1
        elif (isinstance(out, torch.Tensor) and out.dtype in FP8_DTYPES and isinstance(args[0], torch.Tensor)
              and args[0].dtype not in FP8_DTYPES):
            self.casts += 1
        return out


def _tiny_fp8_training(recipe):
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    config = llama_config(padded_vocab_size=64)
    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe=recipe,
                                fp8_amax_history_len=2, fp8_amax_compute_algo="max")
    groups = single_process()
    model = GPTModel(config, groups, execution=execution)
    model.initialize_parameters(7)
    ddp = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [ddp], groups)
    return model, micro_batch_step(ddp, optimizer)


def micro_batch_step(ddp, optimizer):
    """One optimizer step over MICRO_BATCHES micro-batches of 2 x 16 tokens (the same tokens each call)."""
    tokens = torch.randint(0, 64, (MICRO_BATCHES, 2, 16), generator=torch.Generator().manual_seed(3))

    def step():
        ddp.zero_grad_buffer()
        for micro in tokens:
            ddp(micro, torch.arange(16).expand_as(micro), labels=micro).mean().backward()
        optimizer.step()
    return step


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_one_training_step_casts_each_tensor_once(recipe):
    model, step = _tiny_fp8_training(recipe)
    step()  # the first step: delayed scaling's history fills
    counter = CountFP8Work()
    with counter:
        step()
    linears = 4 * model.config.num_layers  # qkv, proj, fc1, fc2 per layer
    assert counter.gemms == 3 * linears * MICRO_BATCHES
    per_gemm = counter.casts / counter.gemms
    assert per_gemm <= (2 + 1 / MICRO_BATCHES) / 3 + 1e-9, (counter.casts, counter.gemms)


def test_fp8_linear_keeps_its_input_in_fp8_for_backward():
    """Bytes saved for backward by one FP8 linear, beyond its weight: the input's FP8 transpose
    (1 byte per element) and a scale, not the bf16 input (2 bytes per element)."""
    linear = ColumnParallelLinear(64, 96, bias=False, tp=TensorParallel(),
                                  params_dtype=torch.bfloat16, gradient_accumulation_fusion=False)
    linear.fp8 = FP8Linear(FP8Options("hybrid", "tensorwise"), None)
    x = torch.randn(16, 2, 64).bfloat16().requires_grad_()
    saved = []

    def pack(tensor):
        if tensor is not linear.weight:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = linear(x)
    assert sum(saved) <= x.numel() + 16, saved
    grad = torch.randn(16, 2, 96).bfloat16()
    y.backward(grad)
    # The kept transpose gives the weight gradient that casting the bf16 input again would, exactly.
    recast = linear.fp8.wgrad(grad.reshape(-1, 96), x.detach().reshape(-1, 64))
    assert torch.equal(linear.weight.grad, recast)


def _linear_with_history(history_len):
    options = FP8Options("e4m3", "delayed", amax_history_len=history_len, amax_compute_algo="max")
    scaling = DelayedScaling(options)
    linear = FP8Linear(options, scaling)
    scaling.allocate("cpu")
    linear.bind()
    return linear, scaling


def test_every_roll_records_the_cached_weights_amax():
    """History of 2 entries, 4 micro-batches per step: the weight is cast in the first micro-batch
    only, yet every entry of its history holds its amax (the old code left zeros, so its scale
    stopped following the weight)."""
    linear, scaling = _linear_with_history(2)
    weight = torch.nn.Parameter(torch.randn(32, 16).bfloat16())
    x = torch.randn(8, 16).bfloat16()
    slot = linear.first_slot + WEIGHT
    for _ in range(3):  # optimizer steps
        amax = weight.detach().abs().max().float()
        for micro_batch in range(MICRO_BATCHES):
            scaling.roll()
            if micro_batch >= 2:  # both entries are from rolls after this weight's cast
                assert torch.all(scaling.history[:, slot] == amax), scaling.history[:, slot]
                assert scaling.scale[slot].item() == pytest.approx(448.0 / amax.item())
            linear.forward(x, weight)
        with torch.no_grad():
            weight.mul_(0.5)


def test_evaluation_forwards_leave_the_amax_history_alone():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    model = GPTModel(llama_config(padded_vocab_size=64), single_process(),
                     execution=ExecutionConfig(fp8="e4m3", fp8_amax_history_len=3))
    model.initialize_parameters(1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16).expand_as(tokens)
    model(tokens, positions, labels=tokens).mean().backward()
    model(tokens, positions, labels=tokens).mean().backward()
    before = {name: tensor.clone() for name, tensor in model.fp8_scaling.state_tensors().items()}
    model.eval()
    with torch.no_grad():
        model(tokens * 0 + 5, positions, labels=tokens)  # other data: other amaxes, were they recorded
    model.train()
    for name, tensor in model.fp8_scaling.state_tensors().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("delayed", [False, True])
def test_compiled_cast_makes_the_fp8_tensor_and_its_transpose_in_one_kernel(delayed):
    """What runs on GPU with compilation on: amax, cast and transpose as one generated function
    whose only full-size buffers are the two FP8 outputs, equal to the eager cast bit for bit."""
    import re

    from megatron.core.transformer.fp8 import cast_to_fp8, compiled_cast_to_fp8
    from tests.unit.work_counting import generated_code

    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    scale = torch.tensor(3.0) if delayed else None
    code = generated_code(compiled_cast_to_fp8(), x, scale, torch.float8_e4m3fn, 0, True)
    assert code.count("async_compile.cpp_pybinding") == 1
    full_size = re.findall(r"empty_strided_cpu\(\(s\d+, s\d+\)[^\n]*", code)
    assert len(full_size) == 2 and all("float8_e4m3fn" in line for line in full_size), code
    got = compiled_cast_to_fp8()(x, scale, torch.float8_e4m3fn, 0, True)
    want = cast_to_fp8(x, scale, torch.float8_e4m3fn, 0, True)
    for a, b in zip(got, want):
        assert torch.equal(a.float(), b.float())
