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
from megatron.core.tensor_parallel.layers import initialize_param
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.fp8 import DelayedScaling, FP8Linear, FP8Options
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.experts import initialize_expert_param
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.distributed.harness import run_distributed

EXPERTS, HIDDEN, SEQ, BATCH, RTOL = 4, 32, 32, 2, 1e-5


def _layer(groups):
    cfg = derive(TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=64,
                                   ffn_hidden_size=48, num_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=2,
                                   swiglu=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                                   moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall"))
    execution = ExecutionConfig(fp8="hybrid", fp8_recipe="delayed", moe_router_padding_for_fp8=True)
    layer = MoELayer(cfg, execution=execution, layer_number=0, groups=groups, device=torch.device("cpu"))
    for name, param in layer.named_parameters():
        init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
        init(param, f"decoder.layers.0.mlp.{name}", 5, 0.2, cfg.num_layers)
    options = FP8Options("hybrid", "delayed", amax_history_len=2, amax_compute_algo="max")
    scaling = DelayedScaling(options)
    linears = layer.experts.attach_fp8(lambda: FP8Linear(options, scaling))
    scaling.allocate("cpu")
    for linear in linears:
        linear.bind()
    return layer, scaling


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

