"""The FP8 weight gradient goes into the fp32 `main_grad` without a product in between on a step's
first micro-batch: counted on CPU over real training steps, and checked equal to the path that
forms the product and adds it.

`torch._scaled_mm` cannot accumulate into its output, but it can write an fp32 output. While
`main_grad` holds nothing yet this step (the gradient buffer was just zeroed, `main_grad_empty`),
the weight-gradient GEMM writes straight into it: no product tensor, no add pass. Later micro-batches
form the product in the gradient's dtype and add it (fewer bytes than an fp32 product then added).
Per FP8 linear and step of M micro-batches: 1 direct write, M - 1 products and M - 1 adds, where the
old code made M of each. If the buffer's zeroing never set the flag, the counts fail; if the first
write were made on a later micro-batch too (the earlier micro-batches' sum overwritten), the
gradients differ from the product-then-add path.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig

SEQ, BATCH = 16, 2  # 32 tokens per micro-batch: no weight of the tiny model has 32 rows


class CountWeightGradients(TorchDispatchMode):
    """Per step: FP8 weight-gradient GEMMs written into a main_grad (`_scaled_mm.out`), those that
    allocate a product of a weight's shape (`_scaled_mm.default`, with its bytes), and the adds
    into the FP8 weights' main_grad."""

    def __init__(self, weights: list):
        super().__init__()
        self.main_grads = {w.main_grad.data_ptr() for w in weights}
        self.shapes = {tuple(w.shape) for w in weights}
        self.direct = self.products = self.product_bytes = self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._scaled_mm.out and kwargs["out"].data_ptr() in self.main_grads:
            self.direct += 1
        elif func is torch.ops.aten._scaled_mm.default and tuple(out.shape) in self.shapes:
            self.products += 1
            self.product_bytes += out.numel() * out.element_size()
        elif func is torch.ops.aten.add_.Tensor and args[0].data_ptr() in self.main_grads:
            self.adds += 1
        return out


def _fp8_training(params_dtype, *, direct=True, ddp_config=None, micro_batches=4):
    """A tiny FP8 model under data parallelism, and its training step. `direct=False`: the old path,
    product then add on every micro-batch (the buffer's flag cleared right after the zeroing)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    config = llama_config(padded_vocab_size=64)
    execution = ExecutionConfig(params_dtype=params_dtype, fp8="hybrid", fp8_recipe="delayed")
    groups = single_process()
    model = GPTModel(config, groups, execution=execution)
    model.initialize_parameters(7)
    ddp = DistributedDataParallel(model, groups, ddp_config=ddp_config)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=params_dtype == torch.bfloat16), [ddp], groups)
    tokens = torch.randint(0, 64, (micro_batches, BATCH, SEQ), generator=torch.Generator().manual_seed(3))

    def step(optimize=True):
        ddp.zero_grad_buffer()
        for param in ddp.params:
            param.main_grad_empty = param.main_grad_empty and direct
        for micro in tokens:
            ddp(micro, torch.arange(SEQ).expand_as(micro), labels=micro).mean().backward()
        ddp.finish_grad_sync()
        if optimize:
            optimizer.step()
    return model, step


def _fp8_weights(model) -> list:
    return [m.weight for m in model.modules() if getattr(m, "fp8", None) is not None]


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_first_micro_batch_writes_the_weight_gradient_into_main_grad(micro_batches):
    model, step = _fp8_training(torch.bfloat16, micro_batches=micro_batches)
    step()
    weights = _fp8_weights(model)
    counter = CountWeightGradients(weights)
    with counter:
        step()
    linears = len(weights)
    assert linears == 4 * model.config.num_layers
    assert counter.direct == linears, (counter.direct, linears)
    assert counter.products == counter.adds == linears * (micro_batches - 1), (counter.products, counter.adds)
    bf16_products = sum(2 * w.numel() for w in weights) * (micro_batches - 1)
    assert counter.product_bytes == bf16_products  # nothing at all with one micro-batch


@pytest.mark.parametrize("ddp_config", [
    None,
    DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2000),
], ids=["ddp", "overlap-distributed-optimizer"])
def test_written_weight_gradients_equal_product_then_add(ddp_config):
    """fp32 parameters: the direct write and the product added to zero are the same numbers, so the
    gradients match the old path (product, then `main_grad.add_`) exactly, over two steps."""
    fused, fused_step = _fp8_training(torch.float32, ddp_config=ddp_config)
    reference, reference_step = _fp8_training(torch.float32, direct=False, ddp_config=ddp_config)
    for _ in range(2):
        fused_step(optimize=False)
        reference_step(optimize=False)
        for (name, a), b in zip(fused.named_parameters(), reference.parameters()):
            assert torch.equal(a.main_grad, b.main_grad), name
        fused_step()  # the same gradients again, then the step both models take
        reference_step()


def test_bf16_weight_gradients_stay_within_bf16_rounding_of_product_then_add():
    """bf16 parameters: the first micro-batch's gradient lands in fp32 unrounded, where the
    old path rounds it to bf16 first; the difference is bf16 rounding, not a lost micro-batch."""
    fused, fused_step = _fp8_training(torch.bfloat16)
    reference, reference_step = _fp8_training(torch.bfloat16, direct=False)
    fused_step(optimize=False)
    reference_step(optimize=False)
    for weight, other in zip(_fp8_weights(fused), _fp8_weights(reference)):
        scale = other.main_grad.abs().max().item()
        torch.testing.assert_close(weight.main_grad, other.main_grad, rtol=2 ** -7, atol=2 ** -7 * scale)
