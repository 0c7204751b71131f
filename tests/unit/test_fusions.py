"""The torch.compile'd elementwise chains equal their eager definitions, forward and backward.

Compiled here on CPU (inductor's C++ backend); on GPU the same functions compile to Triton kernels.
"""
import pytest
import torch

from megatron.core.transformer import fusions


def _inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 4, 32, generator=generator).to(dtype)
    angles = torch.randn(16, 2, 1, 16, generator=generator)
    return x, torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def _assert_close(got, want, tol):
    """Max difference within `tol` of the tensor's largest magnitude. In bf16 the fused kernel
    rounds once where eager rounds after every op, and reductions (the norm weight's gradient) sum
    in another order, so differences of a couple of bf16 ulps (2^-8 relative) are expected."""
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


def _compare(function, args, tol):
    eager_args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    fused_args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    eager = function(*eager_args)
    fused = fusions.compiled(function)(*fused_args)
    _assert_close(fused, eager, tol)
    # Drawn on the CPU (the same numbers on every device), then moved to the output's device.
    grad = torch.randn(eager.shape, generator=torch.Generator().manual_seed(2)).to(eager.device, eager.dtype)
    eager.backward(grad)
    fused.backward(grad)
    for a, b in zip(fused_args, eager_args):
        if b.grad is not None:
            _assert_close(a.grad, b.grad, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_rms_norm_swiglu_and_rotary_match_eager(dtype, tol):
    x, cos, sin = _inputs(dtype)
    weight = torch.randn(32, generator=torch.Generator().manual_seed(3)).to(dtype)
    _compare(lambda a, w: fusions.rms_norm(a, w, 1e-5), [x, weight], tol)
    _compare(fusions.swiglu, [x], tol)
    _compare(fusions.rotary, [x, cos, sin], tol)


def test_fused_model_matches_eager_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand_as(tokens)
    losses, grads = [], []
    for fuse in (False, True):
        model = GPTModel(llama_config(), single_process(), execution=ExecutionConfig(fuse_elementwise=fuse))
        model.initialize_parameters(5)
        loss = model(tokens, positions, labels=tokens).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6)
