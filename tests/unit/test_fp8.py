"""FP8 without Transformer Engine, on the CPU (torch._scaled_mm takes float8 operands there too).

Error bounds: a format with m mantissa bits rounds to a relative error of at most u = 2^-(m+1)
(E4M3: 1/16, E5M2: 1/8). A GEMM of operands rounded with u_a and u_b has a relative
(Frobenius) error of order sqrt(u_a^2 + u_b^2) / sqrt(3) for random data; the tests allow
sqrt(u_a^2 + u_b^2), and check the error is far above bf16's (so FP8 really ran).
"""
import math

import pytest
import torch

from megatron.core.transformer.fp8 import (
    DelayedScaling,
    FP8Linear,
    FP8Options,
    dequantize,
    fp8_layer_numbers,
    quantize,
    scale_from_amax,
)

UNIT_ROUNDOFF = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}
CASES = [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("e4m3", "delayed"), ("hybrid", "delayed"),
         ("e4m3", "rowwise")]


def randn(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_round_trip_within_half_an_ulp_and_saturates(dtype):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = scale_from_amax(x.abs().max(), dtype, margin=0)
    back = dequantize(quantize(x, scale, dtype), scale)
    normal = x.abs() * scale >= torch.finfo(dtype).smallest_normal
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= UNIT_ROUNDOFF[dtype] * (1 + 1e-6)
    assert relative.max() > UNIT_ROUNDOFF[dtype] / 4  # it did round
    exact = torch.tensor([0.0, 1.0, -2.0, 0.5, 0.375]).to(dtype).float()  # representable values
    assert torch.equal(dequantize(quantize(exact, torch.tensor(1.0), dtype), torch.tensor(1.0)), exact)
    limit = torch.finfo(dtype).max
    assert quantize(torch.tensor([1e9, -1e9]), torch.tensor(1.0), dtype).float().tolist() == [limit, -limit]


def test_scale_maps_amax_to_the_format_maximum_with_margin():
    amax = torch.tensor(2.0)
    assert scale_from_amax(amax, torch.float8_e4m3fn, 0).item() == 448.0 / 2.0
    assert scale_from_amax(amax, torch.float8_e4m3fn, 2).item() == 448.0 / 2.0 / 4
    assert scale_from_amax(torch.tensor(0.0), torch.float8_e4m3fn, 0).item() == 1.0
    assert scale_from_amax(torch.tensor(float("inf")), torch.float8_e5m2, 0).item() == 1.0


@pytest.mark.parametrize("algo, history_len", [("max", 3), ("most_recent", 3), ("max", 1)])
def test_delayed_scaling_amax_history_across_steps(algo, history_len):
    options = FP8Options("hybrid", "delayed", margin=1, amax_history_len=history_len, amax_compute_algo=algo)
    scaling = DelayedScaling(options)
    linear = FP8Linear(options, scaling)
    scaling.allocate("cpu")
    linear.bind()
    slot = linear.first_slot
    amaxes = [4.0, 1.0, 8.0, 0.5, 0.25]
    seen = []
    for step, amax in enumerate(amaxes):
        scaling.roll()  # the model's forward: last step's amaxes enter the history
        if step > 0:
            window = seen[-history_len:]
            expected = max(window) if algo == "max" else window[-1]
            assert scaling.scale[slot].item() == pytest.approx(448.0 / expected / 2)          # input: E4M3
            assert scaling.scale[slot + 2].item() == pytest.approx(57344.0 / expected / 2)    # grad: E5M2
        x = torch.full((16, 16), amax)
        x[0, 0] = -amax
        linear._tensor_scale(x, 0, torch.float8_e4m3fn)
        linear._tensor_scale(x / 2, 0, torch.float8_e4m3fn)  # the window keeps the larger amax
        linear._tensor_scale(x, 2, torch.float8_e5m2)
        seen.append(amax)
    assert scaling.ready


def test_delayed_scaling_scales_the_first_micro_batch_from_its_own_amax():
    options = FP8Options("e4m3", "delayed")
    scaling = DelayedScaling(options)
    linear = FP8Linear(options, scaling)
    scaling.allocate("cpu")
    linear.bind()
    scaling.roll()  # nothing recorded yet: no history
    x = torch.full((4, 4), 1e-3)
    assert linear._tensor_scale(x, 0, torch.float8_e4m3fn).item() == pytest.approx(448.0 / 1e-3)


def fp8_linear(fp8_format: str, recipe: str):
    """(an FP8Linear of this format and recipe, its DelayedScaling bound on the CPU or None)."""
    options = FP8Options(fp8_format, recipe)
    scaling = DelayedScaling(options) if recipe == "delayed" else None
    linear = FP8Linear(options, scaling)
    if scaling is not None:
        scaling.allocate("cpu")
        linear.bind()
    return linear, scaling


@pytest.mark.parametrize("fp8_format, recipe", CASES)
def test_each_recipe_gemm_matches_bf16_within_the_format_bound(fp8_format, recipe):
    linear, scaling = fp8_linear(fp8_format, recipe)
    x, weight, grad = randn(8, 4, 64, seed=1), randn(48, 64, seed=2, scale=0.1), randn(8, 4, 48, seed=3, scale=1e-4)
    forward_u = UNIT_ROUNDOFF[linear.forward_dtype]
    grad_u = UNIT_ROUNDOFF[linear.grad_dtype]
    for step in range(2):  # delayed: the second pass scales from the recorded history
        if scaling is not None:
            scaling.roll()
        checks = [
            (linear.forward(x, weight), x.float() @ weight.float().t(), math.hypot(forward_u, forward_u)),
            (linear.dgrad(grad, weight), grad.float() @ weight.float(), math.hypot(grad_u, forward_u)),
            (linear.wgrad(grad.reshape(-1, 48), x.reshape(-1, 64)),
             grad.reshape(-1, 48).float().t() @ x.reshape(-1, 64).float(), math.hypot(grad_u, forward_u)),
        ]
        for got, want, bound in checks:
            assert got.dtype == torch.bfloat16
            error = ((got.float() - want).norm() / want.norm()).item()
            assert 2.0 ** -8 < error <= bound, (fp8_format, recipe, step, error, bound)


def test_weight_cast_is_cached_until_the_weight_changes(monkeypatch):
    import megatron.core.transformer.fp8 as fp8

    linear = FP8Linear(FP8Options("e4m3", "tensorwise"), None)
    weight = torch.nn.Parameter(randn(32, 16, seed=1))
    x = randn(4, 16, seed=2)
    casts = []
    original = linear._cast
    linear._cast = lambda t, s, d: (casts.append(t.shape), original(t, s, d))[1]
    first = linear.forward(x, weight)
    linear.forward(x, weight)  # another micro-batch of the same step
    assert casts.count(torch.Size([32, 16])) == 1
    with torch.no_grad():
        weight.mul_(2.0)  # an optimizer step
    second = linear.forward(x, weight)
    assert casts.count(torch.Size([32, 16])) == 2
    torch.testing.assert_close(second.float(), 2 * first.float(), rtol=0.02, atol=0.02)


def test_first_last_layers_bf16_picks_layers_by_global_number():
    from types import SimpleNamespace

    execution = SimpleNamespace(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert fp8_layer_numbers(execution, 6) == {1, 2, 3}
    execution.first_last_layers_bf16 = False
    assert fp8_layer_numbers(execution, 6) == set(range(6))


@pytest.mark.parametrize("recipe, message", [  # blockwise: tests/unit/test_fp8_blockwise.py
    ("mxfp8", "--fp8-recipe mxfp8 is not available without Transformer Engine"),
    ("custom", "--fp8-recipe must be one of"),
])
def test_recipes_that_cannot_run_are_named_errors(recipe, message):
    with pytest.raises(ValueError, match=message):
        FP8Options("e4m3", recipe)


def _train(fp8_format, recipe, steps):
    """A tiny Llama, bf16 weights with fp32 main grads and Adam, on a learnable sequence task."""
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    config = llama_config(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                          padded_vocab_size=64, max_position_embeddings=32)
    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8=fp8_format, fp8_recipe=recipe, fp8_amax_history_len=4,
                                fp8_amax_compute_algo="max")
    groups = single_process()
    model = GPTModel(config, groups, execution=execution)
    model.initialize_parameters(7)
    ddp = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, bf16=True, clip_grad=1.0), [ddp], groups)
    return train_on_arithmetic_sequences(ddp, optimizer, steps)


def train_on_arithmetic_sequences(ddp, optimizer, steps: int) -> list:
    """`steps` optimizer steps on batches of 8 arithmetic sequences mod 64 (32 tokens each, a task a
    tiny model learns within 50 steps); the losses."""
    generator = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 64, (8, 1), generator=generator)
        stride = torch.randint(1, 4, (8, 1), generator=generator)
        window = (start + stride * torch.arange(33)) % 64  # arithmetic sequences mod 64
        tokens, labels = window[:, :-1], window[:, 1:]
        ddp.zero_grad_buffer()
        loss = ddp(tokens, torch.arange(32).expand_as(tokens), labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fp8_format, recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise"), ("e4m3", "rowwise")])
def test_tiny_model_trained_50_steps_in_fp8_tracks_bf16(fp8_format, recipe, bf16_losses=[]):
    if not bf16_losses:
        bf16_losses.extend(_train(None, "delayed", 50))
    fp8 = _train(fp8_format, recipe, 50)
    assert bf16_losses[-1] < 0.5 * bf16_losses[0]  # the task is learned
    # Every step within 10% of the bf16 loss, and the last 10 steps' mean within 5% (measured: 0.5-2.3%).
    for step in range(50):
        assert abs(fp8[step] - bf16_losses[step]) <= 0.10 * bf16_losses[step], (step, fp8[step], bf16_losses[step])
    assert abs(sum(fp8[40:]) / sum(bf16_losses[40:]) - 1) <= 0.05
