"""--moe-router-padding-for-fp8 at EP 2 (alltoall, gloo, 2 ranks, 64 tokens each, FP8 hybrid delayed).

Each rank pads its own routing map (as Megatron-Core's alltoall dispatcher does), so an expert's
padding rows, and with them its FP8 amaxes, depend on how the tokens are spread over ranks: EP 2 is
not compared with one process. What is compared: the experts on device counts (grouped FP8 GEMMs)
against the per-expert loop on the same EP 2 layout and routing (every amax, scale and FP8 value the
same; rtol 1e-5, the order of fp32 sums), over two passes with a roll between; and every expert's
received count a multiple of 16.
"""
import functools

import torch

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe import experts as experts_module
from tests.distributed.harness import run_distributed
from tests.distributed.test_fp8_expert_parallel import fp8_moe_layer

EXPERTS, HIDDEN, SEQ, BATCH, RTOL = 4, 32, 32, 2, 1e-5


def _layer(groups):
    return fp8_moe_layer(groups, "alltoall", ExecutionConfig(fp8="hybrid", fp8_recipe="delayed",
                                                             moe_router_padding_for_fp8=True))


def _ep2(rank, world_size, on_device: bool):
    if not on_device:
        experts_module.GroupedMLP.fp8_counts_on_device = lambda self, tokens: False
    groups = initialize_model_parallel(1, 1, 1, expert_model_parallel_size=2)
    layer, scaling = _layer(groups)
    counts = []
    forward = layer.experts.forward
    layer.experts.forward = lambda tokens, per_expert, probs=None: counts.append(per_expert) or forward(
        tokens, per_expert, probs)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(SEQ, 2 * BATCH, HIDDEN, generator=generator)[:, rank * BATCH:(rank + 1) * BATCH]
    grad = torch.randn(SEQ, 2 * BATCH, HIDDEN, generator=generator)[:, rank * BATCH:(rank + 1) * BATCH]
    results = []
    for _ in range(2):
        scaling.roll()
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad)
        results.append({"output": out.detach(), "input_grad": inputs.grad, "fc1": layer.experts.fc1_weight.grad,
                        "fc2": layer.experts.fc2_weight.grad, "counts": torch.as_tensor(counts[-1])})
    return results


@functools.lru_cache(maxsize=None)
def _results(on_device: bool):
    return run_distributed(2, _ep2, on_device, timeout=300)


def test_padded_routing_at_ep2_device_counts_equal_the_loop():
    for rank, (got_passes, want_passes) in enumerate(zip(_results(True), _results(False))):
        for got, want in zip(got_passes, want_passes):
            assert torch.equal(got["counts"], want["counts"]) and (got["counts"] % 16 == 0).all()
            for name in ("output", "input_grad", "fc1", "fc2"):
                atol = RTOL * want[name].abs().max().item()
                torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=atol, msg=f"{name}, rank {rank}")

