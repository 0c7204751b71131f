"""FP8 for the routed experts, on the CPU: each expert's GEMMs in FP8 with its own scaling state, rows
padded per expert to 16, and the dense FP8 linear's cast-once properties.

Bounds as tests/unit/test_fp8.py's for one GEMM (u = 2^-(m+1) of the format: forward
sqrt(2) u_E4M3, gradients sqrt(u_grad^2 + u_E4M3^2)): the layer's output and gradients against the
same layer without FP8, and above bf16's error (so FP8 really ran).
"""
import math

import pytest
import torch

from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.layers import initialize_param
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.fp8 import INPUT, DelayedScaling, FP8Linear, FP8Options
from megatron.core.transformer.moe.experts import initialize_expert_param
from megatron.core.transformer.moe.fp8_experts import padded_counts, real_rows
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.unit.cuda_operand_rules import scaled_grouped_mm_problems
from tests.unit.test_fp8 import train_on_arithmetic_sequences
from tests.unit.test_fp8_work import CountFP8Work, micro_batch_step

UNIT_ROUNDOFF = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}
EXPERTS = 4


def config(**overrides):
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=2, padded_vocab_size=64, ffn_hidden_size=24,
                  num_experts=EXPERTS, moe_ffn_hidden_size=48, moe_router_topk=2, swiglu=True,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  moe_router_load_balancing_type="none")
    return derive(TransformerConfig(**(values | overrides)))


def moe_layer(options=None):
    """A MoE layer (fp32 weights from seed 3); with `options` its experts run in FP8."""
    cfg = config()
    layer = MoELayer(cfg, execution=ExecutionConfig(), layer_number=0, groups=single_process(),
                     device=torch.device("cpu"))
    for name, param in layer.named_parameters():
        init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
        init(param, f"decoder.layers.0.mlp.{name}", 3, 0.1, cfg.num_layers)
    scaling = None
    if options is not None:
        scaling = DelayedScaling(options) if options.recipe == "delayed" else None
        linears = layer.experts.attach_fp8(lambda: FP8Linear(options, scaling))
        if scaling is not None:
            scaling.allocate("cpu")
            for linear in linears:
                linear.bind()
    return layer, scaling


def run(layer, x, grad):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad


X = torch.randn(8, 5, 64, generator=torch.Generator().manual_seed(0))
GRAD = torch.randn(8, 5, 64, generator=torch.Generator().manual_seed(1)) * 1e-3


@pytest.mark.parametrize("fp8_format, recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"),
                                                ("hybrid", "delayed"), ("e4m3", "rowwise")])
def test_fp8_experts_match_the_layer_within_the_dense_fp8_bound(fp8_format, recipe):
    want = run(moe_layer()[0], X, GRAD)
    options = FP8Options(fp8_format, recipe)
    layer, scaling = moe_layer(options)
    forward_u = UNIT_ROUNDOFF[torch.float8_e4m3fn]
    grad_u = UNIT_ROUNDOFF[torch.float8_e5m2 if fp8_format == "hybrid" else torch.float8_e4m3fn]
    bounds = (math.hypot(forward_u, forward_u),) + (math.hypot(grad_u, forward_u),) * 3
    for step in range(2):  # delayed: the second pass scales from the recorded history
        if scaling is not None:
            scaling.roll()
        got = run(layer, X, GRAD)
        for name, g, w, bound in zip(("output", "input grad", "fc1 grad", "fc2 grad"), got, want, bounds):
            error = ((g - w).norm() / w.norm()).item()
            assert 2.0 ** -8 < error <= bound, (name, step, error, bound)


def test_each_expert_scales_from_its_own_rows():
    """Delayed scaling: each expert's fc1 input slot holds the amax of the rows routed to that expert
    (one slot shared by the experts would hold the largest of them all)."""
    layer, scaling = moe_layer(FP8Options("hybrid", "delayed"))
    scaling.roll()
    x = X.clone()
    x[0, 0] *= 50  # one token far larger than the rest: only its experts see it
    probs, routing_map = layer.router(x)
    tokens = x.reshape(-1, 64)
    layer(x)
    scaling.roll()
    amaxes = [scaling.history[0, linear.first_slot + INPUT].item() for linear in layer.experts.fp8["fc1"].linears]
    want = [tokens[routing_map[:, e]].abs().max().item() for e in range(EXPERTS)]
    assert amaxes == pytest.approx(want, rel=1e-6)
    assert min(amaxes) < max(amaxes) / 10  # the large token reached only its top-2 experts


def test_every_fp8_gemm_sees_rows_padded_to_16():
    """All three GEMMs of each expert and weight get a row count that is a multiple of 16 (the
    weight gradient contracts over it; the layer's other sizes, 48, 64 and 96, are too)."""
    layer, _ = moe_layer(FP8Options("e4m3", "tensorwise"))
    routed = layer.router(X)[1].sum(dim=0).tolist()
    assert any(count % 16 for count in routed), routed  # padding has work to do
    shapes = []

    class Shapes(CountFP8Work):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                shapes.append((*args[0].shape, *args[1].shape))
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Shapes():
        run(layer, X, GRAD)
    assert len(shapes) == 3 * 2 * sum(1 for count in routed if count)
    assert all(size % 16 == 0 for shape in shapes for size in shape), shapes


def test_padding_layout():
    assert padded_counts([0, 1, 16, 17]) == [0, 16, 16, 32]
    rows = real_rows([0, 1, 16, 17], [0, 16, 16, 32], "cpu")
    assert rows.tolist() == [0] + list(range(16, 32)) + list(range(32, 49))


MOE = dict(num_experts=EXPERTS, moe_ffn_hidden_size=48, moe_router_topk=2, moe_router_load_balancing_type="none")
MICRO_BATCHES = 4


def _moe_model(fp8_format, recipe, **overrides):
    """A tiny Llama whose both layers are mixtures of experts, bf16 weights, fp32 main grads, Adam."""
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.distributed.parity import llama_config

    cfg = llama_config(**(dict(padded_vocab_size=64, max_position_embeddings=32) | MOE | overrides))
    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8=fp8_format, fp8_recipe=recipe,
                                fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    groups = single_process()
    model = GPTModel(cfg, groups, execution=execution)
    model.initialize_parameters(7)
    ddp = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, bf16=True, clip_grad=1.0), [ddp], groups)
    return model, ddp, optimizer


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_one_moe_training_step_casts_each_tensor_once(recipe):
    """Over one optimizer step of M micro-batches, every expert GEMM included: at most (2 + 1/M)
    casts to FP8 per 3 GEMMs (the input and the output gradient once per micro-batch, the weight once
    per step). Casting the expert's input again in backward, or its weight every micro-batch, fails."""
    model, ddp, optimizer = _moe_model("hybrid", recipe, moe_router_force_load_balancing=True)
    step = micro_batch_step(ddp, optimizer)
    step()
    counter = CountFP8Work()
    with counter:
        step()
    layers = model.config.num_layers
    gemms_per_micro_batch = 3 * (2 * layers + 2 * EXPERTS * layers)  # qkv + proj, and fc1 + fc2 of each expert
    assert counter.gemms == gemms_per_micro_batch * MICRO_BATCHES
    assert counter.casts / counter.gemms <= (2 + 1 / MICRO_BATCHES) / 3 + 1e-9, (counter.casts, counter.gemms)


def test_evaluation_forwards_leave_the_experts_amax_history_alone():
    model, ddp, _ = _moe_model("e4m3", "delayed")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16).expand_as(tokens)
    for _ in range(2):
        ddp(tokens, positions, labels=tokens).mean().backward()
    before = {name: tensor.clone() for name, tensor in model.fp8_scaling.state_tensors().items()}
    model.eval()
    with torch.no_grad():
        model(tokens * 0 + 5, positions, labels=tokens)
    model.train()
    for name, tensor in model.fp8_scaling.state_tensors().items():
        assert torch.equal(tensor, before[name]), name


def _train(fp8_format, recipe, steps):
    _, ddp, optimizer = _moe_model(fp8_format, recipe)
    return train_on_arithmetic_sequences(ddp, optimizer, steps)


@pytest.mark.parametrize("fp8_format, recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_tiny_moe_model_trained_in_fp8_tracks_bf16(fp8_format, recipe, bf16_losses=[]):
    """As the dense FP8 convergence test: every step within 10% of the bf16 loss, the last 10
    steps' mean within 5%, the experts' GEMMs in FP8 too (measured: at most 4.2% and 7.3% per step,
    1.5% and 2.9% over the last 10, for hybrid delayed and e4m3 tensorwise)."""
    steps = 40
    if not bf16_losses:
        bf16_losses.extend(_train(None, "delayed", steps))
    fp8 = _train(fp8_format, recipe, steps)
    assert bf16_losses[-1] < 0.5 * bf16_losses[0]  # the task is learned
    for step in range(steps):
        assert abs(fp8[step] - bf16_losses[step]) <= 0.10 * bf16_losses[step], (step, fp8[step], bf16_losses[step])
    assert abs(sum(fp8[-10:]) / sum(bf16_losses[-10:]) - 1) <= 0.05


def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm as PyTorch's own tests define it (no CPU kernel exists): per group,
    `_scaled_mm` with a's row scales and b's column scales; groups of a's rows (b 3-D) or of the
    contracted dimension (b 2-D, scales group-major). Its arguments are held to what the GPU's
    kernel takes (tests/unit/cuda_operand_rules.py)."""
    problems = scaled_grouped_mm_problems(a, b, scale_a, scale_b, offs)
    assert not problems, "a GPU would refuse this torch._scaled_grouped_mm: " + "; ".join(problems)
    ends = offs.tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    if b.dim() == 3:
        return torch.cat([torch._scaled_mm(a[s:e], b[g], scale_a[s:e].view(-1, 1), scale_b[g].view(1, -1),
                                           out_dtype=torch.bfloat16) for g, (s, e) in enumerate(bounds)])
    m, n = a.shape[0], b.shape[1]
    return torch.stack([torch._scaled_mm(a[:, s:e], b[s:e], scale_a[g * m:(g + 1) * m].view(-1, 1),
                                         scale_b[g * n:(g + 1) * n].view(1, -1), out_dtype=torch.bfloat16)
                        if e > s else a.new_zeros((m, n), dtype=torch.bfloat16) for g, (s, e) in enumerate(bounds)])


@pytest.mark.parametrize("fp8_format, recipe, widened", [("e4m3", "tensorwise", False), ("e4m3", "delayed", False),
                                                          ("hybrid", "delayed", False), ("hybrid", "delayed", True)],
                         ids=["e4m3-tensorwise", "e4m3-delayed", "hybrid-delayed", "hybrid-delayed-bf16-gemm"])
def test_grouped_fp8_path_equals_the_loop(monkeypatch, fp8_format, recipe, widened):
    """The grouped path (one cast per tensor for all experts, each row scaled by its expert's scale,
    `torch._scaled_grouped_mm`; hybrid's E5M2 gradient GEMMs on the dequantized casts, or, as on the
    GPU (`widened`), as one bf16 grouped GEMM of the casts widened to bf16, the scales folded into
    one operand) gives the loop's results: the same FP8 values, so only bf16 rounding of the outputs
    differs. The kernel stands in as PyTorch defines it; tests/gpu runs the real one."""
    from megatron.core.transformer.moe import fp8_experts

    dequantized = []
    exact = fp8_experts._dequantized_grouped_mm

    def train_bf16(grouped):
        monkeypatch.setattr(fp8_experts, "grouped_fp8_supported", lambda x, rowwise: grouped)
        # As on a Hopper GPU: the layouts the layer passes decide (the weight gradient's operand is
        # a transposed view), not a stand-in.
        monkeypatch.setattr(fp8_experts, "_grouped_mm_on_gpu", lambda a: grouped and widened)
        monkeypatch.setattr(fp8_experts, "_scaled_grouped_mm", _emulated_scaled_grouped_mm)
        monkeypatch.setattr(fp8_experts, "_dequantized_grouped_mm", lambda *a: dequantized.append(1) or exact(*a))
        layer, scaling = moe_layer(FP8Options(fp8_format, recipe))
        layer.to(torch.bfloat16)
        results = []
        for _ in range(2):
            if scaling is not None:
                scaling.roll()
            results.append(run(layer, X.bfloat16(), GRAD.bfloat16()))
        return results

    got_all = train_bf16(True)
    if widened:  # every E5M2 GEMM (fc1's and fc2's input and weight gradients) widened, none in fp32
        assert not dequantized, f"{len(dequantized)} E5M2 GEMMs fell back to the fp32 path"
    for got, want in zip(got_all, train_bf16(False)):
        for name, g, w in zip(("output", "input grad", "fc1 grad", "fc2 grad"), got, want):
            if widened and name in ("input grad", "fc1 grad"):
                # Downstream of the widened fc2 input-gradient GEMM (one bf16 rounding more, of its
                # operand): fc1's E5M2 casts of a differently rounded gradient round some elements to
                # the neighbouring E5M2 value (25% apart), so the bound is FP8's, not bf16's.
                assert ((g.float() - w.float()).norm() / w.float().norm()).item() <= 2 ** -4, name
                continue
            torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -7, atol=2 ** -7 * w.abs().max().item(),
                                       msg=name)


def test_grouped_fp8_path_casts_each_tensor_once_for_all_experts(monkeypatch):
    """Per weight and pass on the grouped path: one cast of the input for all experts (its FP8
    transpose kept for the weight gradient), one of the output gradient, one of the weights: 6 for
    the layer's fc1 and fc2, whatever the number of experts."""
    from megatron.core.transformer.moe import fp8_experts

    monkeypatch.setattr(fp8_experts, "grouped_fp8_supported", lambda x, rowwise: True)
    monkeypatch.setattr(fp8_experts, "_scaled_grouped_mm", _emulated_scaled_grouped_mm)
    layer, _ = moe_layer(FP8Options("e4m3", "tensorwise"))
    layer.to(torch.bfloat16)
    counter = CountFP8Work()
    with counter:
        run(layer, X.bfloat16(), GRAD.bfloat16())
    assert counter.casts == 6, counter.casts
    with counter:
        run(layer, X.bfloat16(), GRAD.bfloat16())
    assert counter.casts == 6 + 4  # the weights' casts are reused while they do not change


@pytest.mark.parametrize("shape", ["rows (input gradient)", "contracted (weight gradient)"])
def test_bf16_grouped_gemm_of_the_casts_equals_the_dequantized_one(shape):
    """The GPU's way to multiply FP8 casts that no FP8 grouped kernel takes (hybrid's E5M2 gradients):
    the casts widened to bf16, one operand with its dequantizing factors folded in, one bf16 grouped
    GEMM: the fp32 path's results (the CPU's) within bf16's rounding, experts without rows and
    sentinel rows included."""
    from megatron.core.transformer.moe import fp8_experts

    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([32, 0, 48, 16])
    offs = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum()) + 16                                         # 16 sentinel rows
    scales_e = torch.rand(4, generator=generator) + 0.5                   # one per expert
    if shape.startswith("rows"):
        a = torch.randn(rows, 32, generator=generator).mul(8).to(torch.float8_e5m2)
        b = torch.randn(4, 32, 48, generator=generator).mul(8).to(torch.float8_e4m3fn)
        group = fp8_experts._row_groups(offs, rows)
        scale_a = fp8_experts._with_sentinel(torch.rand(4, generator=generator) + 0.5).index_select(0, group)
        scale_b = scales_e.unsqueeze(1).expand(-1, 48).contiguous()
        valid = slice(0, int(counts.sum()))
    else:
        a = torch.randn(rows, 32, generator=generator).mul(8).to(torch.float8_e5m2).t()   # [m, N]
        b = torch.randn(rows, 48, generator=generator).mul(8).to(torch.float8_e4m3fn)     # [N, n]
        scale_a = (torch.rand(4, generator=generator) + 0.5).repeat_interleave(32)
        scale_b = scales_e.repeat_interleave(48)
        valid = [0, 2, 3]                                                  # expert 1 has no rows
    want = fp8_experts._dequantized_grouped_mm(a, b, scale_a, scale_b, offs, torch.bfloat16)[valid].float()
    got = fp8_experts._bf16_grouped_mm_of_casts(a, b, scale_a, scale_b, offs, torch.bfloat16)[valid].float()
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    assert not fp8_experts._bf16_grouped_mm_runs(a, b)  # (the CPU keeps the exact fp32 path)
    assert fp8_experts._bf16_grouped_layout(a) and fp8_experts._bf16_grouped_layout(b)  # (a GPU's widens)


def test_compiled_expert_casts_and_widening_are_one_kernel_each(monkeypatch):
    """With the elementwise fusions (FP8Linear compiled) the experts' cast of all rows and hybrid's
    widening of an E5M2 cast are one kernel each (the eager ones pass over the rows in fp32 three
    times), and the layer on the GPU's widened path gives the eager layer's results bit for bit
    where the values agree (the same FP8 values; fp32 products rounded once)."""
    from megatron.core.transformer.moe import fp8_experts
    from tests.unit.work_counting import generated_code

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(40, 24, generator=generator).bfloat16()
    row_expert = torch.arange(40) // 12                                       # 4: sentinel rows 36..39
    scales = torch.rand(3, generator=generator) * 8 + 1
    code = generated_code(torch.compile(fp8_experts.quantize_rows, fullgraph=True, dynamic=False),
                          x, scales, row_expert, torch.float8_e5m2)
    assert code.count('extern "C"') == 1, code
    q = x.float().mul(8).to(torch.float8_e5m2)
    factor = torch.rand(40, 1, generator=generator) + 0.5
    code = generated_code(torch.compile(fp8_experts.widen_scaled, fullgraph=True, dynamic=False), q.t(), factor.t())
    assert code.count('extern "C"') == 1, code

    monkeypatch.setattr(fp8_experts, "_grouped_mm_on_gpu", lambda a: True)
    monkeypatch.setattr(fp8_experts, "grouped_fp8_supported", lambda x, rowwise: True)
    monkeypatch.setattr(fp8_experts, "_scaled_grouped_mm", _emulated_with_sentinel_rows)
    monkeypatch.setattr(fp8_experts, "_dequantized_grouped_mm", None)  # every E5M2 GEMM widened
    from tests.unit.test_moe_router_padding_fp8 import fp8_layer, train

    results = []
    for fuse in (False, True):
        layer, scaling = fp8_layer("tensorwise", "hybrid")
        # as the model attaches them with --fp8-format and the elementwise fusions on (or off)
        layer.experts.attach_fp8(lambda: FP8Linear(FP8Options("hybrid", "tensorwise"), None, compiled=fuse))
        assert (layer.experts.fp8["fc1"].widen is fp8_experts.widen_scaled) is not fuse
        results.append(train(layer, scaling, steps=1))
    for got, want in zip(*results):
        for name, g, w in zip(("output", "input grad", "fc1 grad", "fc2 grad"), got, want):
            torch.testing.assert_close(g, w, rtol=2 ** -8, atol=2 ** -8 * w.abs().max().item(), msg=name)


def _emulated_with_sentinel_rows(a, b, scale_a, scale_b, offs):
    """`_emulated_scaled_grouped_mm` with the rows past the last group (the padded routing's
    sentinel rows, which the kernel leaves unwritten) as zeros."""
    out = _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    if b.dim() == 3 and out.shape[0] < a.shape[0]:
        out = torch.cat([out, out.new_zeros(a.shape[0] - out.shape[0], out.shape[1])])
    return out
