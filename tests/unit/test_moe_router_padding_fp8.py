"""--moe-router-padding-for-fp8: the routing is padded (Megatron-Core's rule) instead of the FP8
experts' rows, and the FP8 experts then run grouped with their counts on the device.

- The padded map equals Megatron-Core's `pad_routing_map`; every expert's count becomes a multiple
  of 16; padding entries carry probability 0, so the dispatcher's combine is unchanged by them.
- The grouped path's casts (one segment reduction for the experts' amaxes, one cast of all rows)
  give exactly the per-expert FP8 path's scales and FP8 values.
- The layer on the device path equals the same layer through the per-expert loop (same FP8 values;
  fp32 sums in another order: rtol 1e-5).
- The layer's operator count does not grow with the expert count (tensorwise, delayed), where the
  per-expert row padding's does (112 and 76 operators per expert).
- Bad combinations fail at construction with the flag's name.
(The host-read count is in tests/unit/test_moe_host_sync.py.)
"""
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.layers import initialize_param
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.fp8 import INPUT, DelayedScaling, FP8Linear, FP8Options, scale_from_amax
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.experts import initialize_expert_param
from megatron.core.transformer.moe.fp8_experts import _expert_amaxes, _row_groups, quantize_rows
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import AllToAllDispatcher, pad_routing_map
from tests.optional import require_megatron_core, skip_unless_importable_by_megatron_core
from tests.unit.test_fp8_experts import config

HIDDEN, EXPERTS, TOKENS = 64, 4, 32


def routing(seed: int, tokens: int = TOKENS, experts: int = EXPERTS, topk: int = 2):
    """(probs, routing_map) [T, E] of a random top-k routing, probs 0 off the map."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    return scores * routing_map, routing_map


def test_padded_map_equals_megatron_core():
    root = require_megatron_core("megatron/core/transformer/moe/moe_utils.py")
    _, routing_map = routing(1, tokens=48, experts=8, topk=3)
    code = ("import sys, torch; from megatron.core.transformer.moe.moe_utils import pad_routing_map; "
            "m = torch.load(sys.argv[1]); torch.save(pad_routing_map(m.clone(), 16), sys.argv[1])")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pad_routing_map_{os.getpid()}.pt")
    torch.save(routing_map, path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, path], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)  # cwd: `-c` puts it first on sys.path
    if done.returncode != 0:
        skip_unless_importable_by_megatron_core(done.stderr)
        raise AssertionError(done.stderr[-3000:])
    expected = torch.load(path, weights_only=True).bool()
    os.remove(path)
    ours = pad_routing_map(routing_map, 16)
    assert torch.equal(ours, expected)
    assert (ours.sum(dim=0) % 16 == 0).all() and (ours & routing_map).equal(routing_map)


def test_dispatcher_pads_counts_and_leaves_the_combine_unchanged():
    """Rows through a per-expert map: each expert's count a multiple of 16, the counted rows
    first, and the combine equal to the unpadded dispatcher's (padding rows weigh 0)."""
    probs, routing_map = routing(2)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    outputs, counts = [], []
    for pad_multiple in (None, 16):
        dispatcher = AllToAllDispatcher(num_local_experts=EXPERTS, ep_group=None, etp_group=None, topk=2,
                                        num_experts=EXPERTS, pad_multiple=pad_multiple)
        rows, per_expert = dispatcher.dispatch(hidden, probs, routing_map)
        row_expert = _row_groups(per_expert.cumsum(0), rows.shape[0])
        scale = torch.arange(1.0, EXPERTS + 2).view(-1, 1)                  # expert e: x (e + 1)
        outputs.append(dispatcher.combine(rows * scale[row_expert]))
        counts.append(per_expert)
    assert torch.equal(counts[0], routing_map.sum(dim=0))
    assert (counts[1] % 16 == 0).all() and (counts[1] >= counts[0]).all() and (counts[1] > counts[0]).any()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_one_cast_for_all_experts_equals_the_per_expert_casts(fp8_format):
    """Scales and FP8 values of the grouped path's cast equal each expert's own tensorwise cast
    exactly (the same amax, the same fp32 product, the same rounding); sentinel rows cast to 0."""
    generator = torch.Generator().manual_seed(4)
    counts = torch.tensor([16, 0, 32, 16])
    rows = torch.randn(80, HIDDEN, generator=generator) * torch.tensor([1.0, 3.0, 0.01, 50.0]).repeat_interleave(
        torch.tensor([16, 16, 32, 16])).view(-1, 1)
    rows[64:] = 0                                                           # 16 sentinel rows
    options = FP8Options(fp8_format, "tensorwise")
    dtype = FP8Linear(options, None).forward_dtype
    row_expert = _row_groups(counts.cumsum(0).to(torch.int32), rows.shape[0])
    scales = scale_from_amax(_expert_amaxes(rows, row_expert, EXPERTS), dtype, options.margin)
    grouped = quantize_rows(rows, scales, row_expert, dtype)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            q, _, scale = FP8Linear(options, None)._cast_whole(rows[start:start + count], INPUT, dtype)
            assert torch.equal(scales[expert], scale.float().reshape(())), expert
            assert torch.equal(grouped[start:start + count].view(torch.uint8), q.view(torch.uint8)), expert
        start += count
    assert scales[1] == 1 and not grouped[64:].float().any()


def fp8_layer(recipe: str, fp8_format: str = "e4m3", padded: bool = True, num_experts: int = EXPERTS):
    """An FP8 MoE layer (alltoall, fp32 weights from seed 3), its routing padded."""
    cfg = config(moe_token_dispatcher_type="alltoall", num_experts=num_experts)
    execution = ExecutionConfig(fp8=fp8_format, fp8_recipe=recipe, moe_router_padding_for_fp8=padded)
    layer = MoELayer(cfg, execution=execution, layer_number=0, groups=single_process(), device=torch.device("cpu"))
    for name, param in layer.named_parameters():
        init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
        init(param, f"decoder.layers.0.mlp.{name}", 3, 0.1, cfg.num_layers)
    options = FP8Options(fp8_format, recipe)
    scaling = DelayedScaling(options) if recipe == "delayed" else None
    linears = layer.experts.attach_fp8(lambda: FP8Linear(options, scaling))
    if scaling is not None:
        scaling.allocate("cpu")
        for linear in linears:
            linear.bind()
    return layer, scaling


def train(layer, scaling, steps: int = 3):
    """Forward and backward of `steps` inputs: (output, input grad, fc1 grad, fc2 grad) each."""
    results = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(10 + step)
        x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=generator).requires_grad_()
        if scaling is not None:
            scaling.roll()
        layer.zero_grad()
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=generator) * 1e-3)
        results.append((y.detach(), x.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad))
    return results


@pytest.mark.parametrize("fp8_format, recipe", [("e4m3", "tensorwise"), ("e4m3", "delayed"), ("hybrid", "delayed")])
def test_device_path_equals_the_per_expert_loop(monkeypatch, fp8_format, recipe):
    """Same routing (padded), same scales and FP8 values: the grouped path on the device counts and
    the per-expert loop of `FP8Linear`s differ only in the order of fp32 additions."""
    layer, scaling = fp8_layer(recipe, fp8_format)
    assert layer.experts.fp8_counts_on_device(torch.empty(TOKENS, HIDDEN))
    grouped = train(layer, scaling)
    monkeypatch.setattr(experts_module.GroupedMLP, "fp8_counts_on_device", lambda self, tokens: False)
    layer, scaling = fp8_layer(recipe, fp8_format)
    looped = train(layer, scaling)
    for got, want in zip(grouped, looped):
        for name, g, w in zip(("output", "input grad", "fc1 grad", "fc2 grad"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def operators(recipe: str, padded: bool, num_experts: int) -> int:
    """aten operators of one forward and backward of an FP8 layer (after a first step)."""
    layer, scaling = fp8_layer(recipe, padded=padded, num_experts=num_experts)
    train(layer, scaling, steps=1)
    counter = CountOps()
    with counter:
        train(layer, scaling, steps=1)
    return counter.ops


@pytest.mark.parametrize("recipe, per_expert", [("tensorwise", 112), ("delayed", 76)])
def test_operator_count_does_not_grow_with_the_experts(recipe, per_expert):
    """Delayed scaling included: the experts' amaxes enter the history in one kernel per tensor."""
    assert operators(recipe, True, 4) == operators(recipe, True, 8)
    assert operators(recipe, False, 8) - operators(recipe, False, 4) == 4 * per_expert  # the loop's


@pytest.mark.parametrize("overrides, execution, message", [
    (dict(moe_token_dispatcher_type="alltoall"), dict(), "needs --fp8-format"),
    (dict(), dict(fp8="e4m3"), "needs --moe-token-dispatcher-type alltoall"),
    (dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
          moe_pad_expert_input_to_capacity=True), dict(fp8="e4m3"), "use one of them"),
])
def test_bad_combinations_name_the_flag(overrides, execution, message):
    with pytest.raises(ValueError, match="--moe-router-padding-for-fp8") as raised:
        MoELayer(config(**overrides), execution=ExecutionConfig(moe_router_padding_for_fp8=True, **execution),
                 layer_number=0, groups=single_process(), device=torch.device("cpu"))
    assert message in str(raised.value)


def test_tokens_not_a_multiple_of_16_are_refused():
    layer, _ = fp8_layer("tensorwise")
    with pytest.raises(ValueError, match="--moe-router-padding-for-fp8 needs the tokens"):
        layer(torch.randn(5, 3, HIDDEN))
