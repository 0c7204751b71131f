"""--moe-router-padding-for-fp8 at EP 2 (alltoall, gloo, 2 ranks, 64 tokens each, FP8 hybrid delayed).

Each rank pads its own routing map (as Megatron-Core's alltoall dispatcher does), so an expert's
padding rows, and with them its FP8 amaxes, depend on how the tokens are spread over ranks: EP 2 is
not compared with one process. What is compared: the experts on device counts (grouped FP8 GEMMs)
against the per-expert loop on the same EP 2 layout and routing (every amax, scale and FP8 value the
same; rtol 1e-5, the order of fp32 sums), over two passes with a roll between; and every expert's
received count a multiple of 16. Also with --moe-grouped-wgrad per-expert (both gradient GEMMs per
expert by `torch._scaled_mm`, the counts received by the exchange copied to the host in forward,
the weight gradients into an fp32 `main_grad` as data parallelism attaches it) against the same loop.
"""
import functools

import pytest
import torch

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe import experts as experts_module
from tests.distributed.harness import run_distributed
from tests.distributed.test_fp8_expert_parallel import fp8_moe_layer

EXPERTS, HIDDEN, SEQ, BATCH, RTOL = 4, 32, 32, 2, 1e-5


def _layer(groups, wgrad="grouped-mm"):
    return fp8_moe_layer(groups, "alltoall", ExecutionConfig(fp8="hybrid", fp8_recipe="delayed",
                                                             moe_router_padding_for_fp8=True, moe_grouped_wgrad=wgrad))


def _ep2(rank, world_size, mode: str):
    """mode: "device" (grouped FP8 GEMMs), "loop" (the per-expert loop on host counts) or
    "per-expert" (device counts, --moe-grouped-wgrad per-expert into main_grad)."""
    if mode == "loop":
        experts_module.GroupedMLP.fp8_counts_on_device = lambda self, tokens: False
    groups = initialize_model_parallel(1, 1, 1, expert_model_parallel_size=2)
    layer, scaling = _layer(groups, "per-expert" if mode == "per-expert" else "grouped-mm")
    weights = (layer.experts.fc1_weight, layer.experts.fc2_weight)
    if mode == "per-expert":
        for weight in weights:
            weight.main_grad = torch.zeros(weight.shape)
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
        for weight in weights if mode == "per-expert" else ():
            weight.main_grad.zero_()
            weight.main_grad_empty = True  # as data parallelism marks its zeroed buffer
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad)
        fc1, fc2 = (w.main_grad.clone() if mode == "per-expert" else w.grad for w in weights)
        assert mode != "per-expert" or all(w.grad is None for w in weights)
        results.append({"output": out.detach(), "input_grad": inputs.grad, "fc1": fc1, "fc2": fc2,
                        "counts": torch.as_tensor(counts[-1])})
    return results


@functools.lru_cache(maxsize=None)
def _results(mode: str):
    return run_distributed(2, _ep2, mode, timeout=300)


@pytest.mark.parametrize("mode", ["device", "per-expert"])
def test_padded_routing_at_ep2_device_counts_equal_the_loop(mode):
    for rank, (got_passes, want_passes) in enumerate(zip(_results(mode), _results("loop"))):
        for got, want in zip(got_passes, want_passes):
            assert torch.equal(got["counts"], want["counts"]) and (got["counts"] % 16 == 0).all()
            for name in ("output", "input_grad", "fc1", "fc2"):
                atol = RTOL * want[name].abs().max().item()
                torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=atol, msg=f"{name}, rank {rank}")

