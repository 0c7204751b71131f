"""The optimizer step in four passes over the parameters' memory, counted on CPU.

A pass is one operation (a multi-tensor one counts once, and so do consecutive calls of one
operation over the optimizer's parameter groups, which cover disjoint parameters) that reads or
writes the gradients, the fp32 masters, the model's weights or the Adam moments. With clipping active a step is: the
gradient norm, the fused AdamW update (which divides the gradients by the clip factor inside its
kernel), the copy of the masters into the bf16 model; then the gradient buffer is zeroed. Clipping
as a pass of its own (the old code: `_foreach_mul_` over the gradients) makes it five and fails.
"""
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.parity import llama_config


class CountPasses(TorchDispatchMode):
    """Records each operation (views aside: they move no data) that touches one of `storages`."""

    def __init__(self, storages: set):
        super().__init__()
        self.storages, self.passes = storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        touched = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
                      for t in tree_leaves((args, kwargs or {})))
        name = func.overloadpacket.__name__
        if touched and not func.is_view and (not self.passes or self.passes[-1] != name):
            self.passes.append(name)
        return func(*args, **(kwargs or {}))


def _trained_one_step(clip_grad):
    groups = single_process()
    model = GPTModel(llama_config(), groups, execution=ExecutionConfig(params_dtype=torch.bfloat16))
    model.initialize_parameters(5)
    ddp = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=clip_grad), [ddp], groups)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def forward_backward():
        ddp.zero_grad_buffer()
        ddp(tokens, torch.arange(16).expand_as(tokens), labels=tokens).mean().backward()
    forward_backward()
    optimizer.step()  # creates the Adam moments
    forward_backward()
    return ddp, optimizer


def _parameter_storages(ddp, optimizer) -> set:
    tensors = [buffer.grad_data for buffer in ddp.buffers] + list(ddp.module.parameters())
    tensors += optimizer.master_params + [p.main_grad for p in ddp.module.parameters()]
    tensors += [value for state in optimizer.optimizer.state.values() for key, value in state.items()
                if key != "step"]
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_a_clipped_step_is_four_passes():
    ddp, optimizer = _trained_one_step(clip_grad=1e-3)  # small: every step clips
    counter = CountPasses(_parameter_storages(ddp, optimizer))
    with counter:
        applied, grad_norm = optimizer.step()
        ddp.zero_grad_buffer()
    assert applied and grad_norm > 1e-3
    assert counter.passes == ["_foreach_norm", "_fused_adamw_", "_foreach_copy_", "zero_"], counter.passes


def test_clipping_inside_the_update_equals_clipping_before_it():
    folded_ddp, folded = _trained_one_step(clip_grad=1e-3)
    plain_ddp, plain = _trained_one_step(clip_grad=1e-3)
    plain.config.clip_grad = 0.0  # from here the clipping is done by hand, before the step
    grads = plain.grads()
    norm = torch.stack([g.norm() for g in grads]).norm().item()
    torch._foreach_mul_(grads, 1e-3 / (norm + 1e-6))
    _, folded_norm = folded.step()
    plain.step()
    assert abs(folded_norm - norm) <= 1e-6 * norm
    for got, want in zip(folded.master_params, plain.master_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert folded.optimizer.grad_scale is None  # nothing left for the next step
