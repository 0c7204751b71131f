"""The residual add and the norm after it run as one compiled function, forward and backward.

Counted on CPU (inductor's C++ kernels; Triton on GPU): the eager additions over a whole [s, b, h]
activation in one transformer layer's forward and backward. With the fusions compiled, what stays
eager is the second residual add and, in backward, the sum of the layer input's two gradients;
the first residual add and the sum of its gradients run inside the compiled norm. Adding the
residual outside the norm again (the old layer) doubles the count and fails here."""
import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.parallel_state import single_process
from megatron.core.transformer import fusions
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.parity import llama_config


def _eager_adds_over_activations(layer, x) -> int:
    layer(x).sum().backward()  # compiles
    x.grad = None  # (else the next backward adds into it)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).sum().backward()
    shape = list(x.shape)
    return sum(1 for event in prof.events() if event.name in ("aten::add", "aten::add_")
               and event.input_shapes and list(event.input_shapes[0]) == shape)


def test_compiled_layer_adds_the_first_residual_inside_the_norm():
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(llama_config(), single_process(), execution=ExecutionConfig(fuse_elementwise=True))
    model.initialize_parameters(1)
    layer = model.decoder.layers[0]
    x = torch.randn(16, 2, 64, requires_grad=True)
    # The mlp residual (forward) and the sum of the layer input's two gradients; the old layer: 4.
    assert _eager_adds_over_activations(layer, x) == 2


def test_compiled_add_and_norm_equals_eager():
    generator = torch.Generator().manual_seed(0)
    residual, delta = torch.randn(16, 2, 64, generator=generator), torch.randn(16, 2, 64, generator=generator)
    weight = torch.randn(64, generator=generator)
    grads = torch.randn(16, 2, 64, generator=generator), torch.randn(16, 2, 64, generator=generator)
    results = []
    for function in (fusions.add_rms_norm, fusions.compiled(fusions.add_rms_norm)):
        inputs = [t.clone().requires_grad_() for t in (residual, delta, weight)]
        outputs = function(*inputs, 1e-5)
        torch.autograd.backward(outputs, grads)
        results.append([*outputs, *(t.grad for t in inputs)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
