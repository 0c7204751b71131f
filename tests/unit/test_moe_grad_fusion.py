"""The routed experts' weight gradients go straight into data parallelism's `main_grad`
(--gradient-accumulation-fusion), as the dense linears' do.

Over three micro-batches (one expert receiving no rows in the second), with the experts as a loop of
GEMMs and as grouped GEMMs (--moe-grouped-gemm), the fused path's `main_grad`
equals a reference written here (plain `F.linear` per expert on leaf copies of the weights, the
per-micro-batch gradients summed in fp32), and so does the unfused path's (a stacked `param.grad`
added by the data-parallel hook). The looped fused backward makes no tensor of a stacked weight's
shape (the unfused one makes one per weight and micro-batch: 2 + 2 + 4 + 4 bytes per weight element
moved that the fused GEMM does not); the grouped one makes exactly one, the grouped GEMM's product
that one add puts into main_grad (torch._grouped_mm has no accumulating form). Both leave
`param.grad` None and tell the hook once per weight and backward. Under FP8 (tensorwise and delayed,
the loop of per-expert `_scaled_mm`) the fused path writes a step's first weight gradient into fp32
`main_grad` with the GEMM itself and adds the others, and agrees with the unfused path within
bf16's rounding.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.parallel_state import TensorParallel
from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.fp8 import DelayedScaling, FP8Linear, FP8Options
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.experts import GroupedMLP, initialize_expert_param
from tests.unit.test_moe_layer import HIDDEN, config

COUNTS = ([5, 3, 7, 4], [6, 0, 9, 4], [4, 4, 4, 4])  # rows per expert in each micro-batch
GROUPED_MM = torch._grouped_mm
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _micro_batches(dtype):
    generator = torch.Generator().manual_seed(11)
    out = []
    for counts in COUNTS:
        rows = sum(counts)
        out.append((counts, torch.randn(rows, HIDDEN, generator=generator).to(dtype),
                    torch.rand(rows, generator=generator).to(dtype),
                    torch.randn(rows, HIDDEN, generator=generator).to(dtype)))
    return out


def _experts(dtype, fusion, fp8_recipe=None, grouped=False, fp8_format="hybrid", **execution_fields):
    """Four local experts (SwiGLU, ffn 16: grouped GEMMs take strides of 16 bytes) under a one-process
    DDP, so they have `main_grad`; in FP8 (`fp8_format`, `fp8_recipe`) if a recipe is given."""
    execution = ExecutionConfig(params_dtype=dtype, gradient_accumulation_fusion=fusion, **execution_fields)
    experts = GroupedMLP(config(moe_grouped_gemm=grouped, moe_ffn_hidden_size=16), execution=execution,
                         num_local_experts=4, expert_offset=0, etp=TensorParallel(), tp=TensorParallel(),
                         device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in experts.named_parameters():
            initialize_expert_param(param, f"decoder.layers.0.mlp.experts.{name}", 3, 0.5, 2)
    if fp8_recipe is not None:
        attach_fp8([experts], fp8_format, fp8_recipe)
    ddp = DistributedDataParallel(experts, single_process())
    ddp.zero_grad_buffer()
    return experts, ddp


def attach_fp8(experts: list, fp8_format: str, recipe: str):
    """The experts (GroupedMLPs) in FP8 of this format and recipe, one delayed-scaling state for all
    of them (allocated on the CPU and bound; None for the other recipes), which is returned."""
    options = FP8Options(fp8_format, recipe, amax_history_len=2, amax_compute_algo="max")
    scaling = DelayedScaling(options) if recipe == "delayed" else None
    linears = [linear for module in experts for linear in module.attach_fp8(lambda: FP8Linear(options, scaling))]
    if scaling is not None:
        scaling.allocate("cpu")
    for linear in linears:
        linear.bind()
    return scaling


def _reference(experts, dtype):
    """main_grad of both weights by plain autograd: per expert F.linear, SwiGLU, F.linear, x probs."""
    fc1 = experts.fc1_weight.detach().clone().requires_grad_()
    fc2 = experts.fc2_weight.detach().clone().requires_grad_()
    main = [torch.zeros(fc1.shape), torch.zeros(fc2.shape)]
    for counts, x, probs, grad in _micro_batches(dtype):
        pieces = []
        for index, rows in enumerate(x.split(counts)):
            gate, up = F.linear(rows, fc1[index]).chunk(2, dim=-1)
            pieces.append(F.linear(F.silu(gate) * up, fc2[index]))
        (torch.cat(pieces) * probs.unsqueeze(-1)).backward(grad)
        for total, weight in zip(main, (fc1, fc2)):
            total += weight.grad.float()
            weight.grad = None
    return main


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(16, 8), torch.ones(2, 8, 8), offs=torch.tensor([8, 16], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class NewStacked(TorchDispatchMode):
    """Counts the [E, n, k] tensors of a stacked weight's size that ops make in memory of their own
    (not views or in-place results on the weights or their main_grad, nor an in-place op's result)."""

    def __init__(self, experts):
        super().__init__()
        weights = (experts.fc1_weight, experts.fc2_weight)
        self.sizes = {w.numel() for w in weights}
        self.known = {t.untyped_storage().data_ptr() for w in weights for t in (w, w.main_grad)}
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.endswith("_"):  # in place: its input's memory, counted when made
            return out
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.numel() in self.sizes
                    and tensor.untyped_storage().data_ptr() not in self.known):
                self.made += 1
        return out


def _train(experts, ddp, dtype):
    """Three micro-batches; returns how many stacked-size tensors the backwards made and the hook's
    calls per weight."""
    calls = {experts.fc1_weight: 0, experts.fc2_weight: 0}
    original = ddp._on_grad_ready
    for param in calls:
        param.main_grad_hook = lambda p: (calls.__setitem__(p, calls[p] + 1), original(p))
    made = 0
    for counts, x, probs, grad in _micro_batches(dtype):
        out = ddp(x.clone().requires_grad_(), counts, probs)
        with NewStacked(experts) as stacked:
            out.backward(grad)
        made += stacked.made
        assert experts.fc1_weight.grad is None and experts.fc2_weight.grad is None  # only main_grad
    ddp.finish_grad_sync()
    return made, calls


@pytest.mark.parametrize("path", ["loop", "grouped", "per-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_weight_gradients_accumulate_into_main_grad(dtype, path, monkeypatch):
    """per-expert: --moe-grouped-wgrad per-expert (grouped forward and input gradients, the weight
    gradient one GEMM per expert with rows accumulating into main_grad, the counts read once)."""
    grouped = []
    if path == "loop":  # the fallback where PyTorch has no torch._grouped_mm for the device
        monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: False)
    else:  # PyTorch's CPU build runs torch._grouped_mm too (a reference kernel)
        if not _cpu_grouped_mm():
            pytest.skip("this PyTorch has no CPU torch._grouped_mm (2.13 has; the GPU lane tests the kernel)")
        monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: True)
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: grouped.append(1) or GROUPED_MM(*a, **k))
    wgrad = dict(moe_grouped_wgrad="per-expert") if path == "per-expert" else {}
    fused, fused_ddp = _experts(dtype, fusion=True, grouped=path != "loop", **wgrad)
    unfused, unfused_ddp = _experts(dtype, fusion=False, grouped=path != "loop", **wgrad)
    want = _reference(fused, dtype)
    accumulated = []
    accumulate = experts_module.accumulate_matmul_
    monkeypatch.setattr(experts_module, "accumulate_matmul_",
                        lambda out, a, b: accumulated.append(out.shape) or accumulate(out, a, b))
    made, calls = _train(fused, fused_ddp, dtype)
    fused_grouped_calls, fused_accumulated = len(grouped), len(accumulated)
    made_unfused, _ = _train(unfused, unfused_ddp, dtype)
    # The loop and per-expert accumulate into main_grad GEMM by GEMM; the grouped weight gradient is
    # one product [E, n, k] per weight and micro-batch (torch._grouped_mm has no accumulating form),
    # added once.
    assert made == (2 * len(COUNTS) if path == "grouped" else 0)
    assert made_unfused >= 2 * len(COUNTS)  # a gradient per weight and micro-batch: the check sees them
    assert calls == {fused.fc1_weight: len(COUNTS), fused.fc2_weight: len(COUNTS)}
    for module in (fused, unfused):
        torch.testing.assert_close(module.fc1_weight.main_grad, want[0], **TOLERANCE[dtype])
        torch.testing.assert_close(module.fc2_weight.main_grad, want[1], **TOLERANCE[dtype])
    # Fused, per micro-batch: both weights' forward, input- and weight-gradient GEMMs grouped; per
    # expert, the weight gradient's GEMMs one per expert with rows (none for the second micro-batch's
    # empty expert) and weight.
    with_rows = sum(count > 0 for counts in COUNTS for count in counts)
    assert fused_grouped_calls == {"loop": 0, "grouped": 2 * 3 * len(COUNTS), "per-expert": 2 * 2 * len(COUNTS)}[path]
    assert fused_accumulated == (0 if path == "grouped" else 2 * with_rows)


def test_per_expert_weight_gradients_read_the_counts_once_per_backward(monkeypatch):
    """--moe-grouped-wgrad per-expert with the counts a device tensor (as the dispatchers give them):
    the forward reads nothing back (on a GPU it starts one non-blocking copy: the GPU lane checks
    it), each backward reads the counts once for both weights, and each micro-batch's own counts are
    used (main_grad equals the reference over micro-batches routed differently)."""
    from tests.unit.test_moe_host_sync import HostReads

    if not _cpu_grouped_mm():
        pytest.skip("this PyTorch has no CPU torch._grouped_mm (2.13 has; the GPU lane tests the kernel)")
    monkeypatch.setattr(experts_module, "_grouped_mm_supported", lambda x: True)
    experts, ddp = _experts(torch.float32, fusion=True, grouped=True, moe_grouped_wgrad="per-expert")
    want = _reference(experts, torch.float32)
    mode = HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: mode.reads.append("tolist") or tolist(self))
    for counts, x, probs, grad in _micro_batches(torch.float32):
        with mode:
            out = ddp(x, torch.tensor(counts), probs)
        assert mode.reads == []
        with mode:
            out.backward(grad)
        assert mode.reads == ["tolist"]
        mode.reads.clear()
    ddp.finish_grad_sync()
    torch.testing.assert_close(experts.fc1_weight.main_grad, want[0], **TOLERANCE[torch.float32])
    torch.testing.assert_close(experts.fc2_weight.main_grad, want[1], **TOLERANCE[torch.float32])


class ScaledMatmuls(TorchDispatchMode):
    """Counts `_scaled_mm` calls that write into a given tensor (`out=`) and those that make one."""

    def __init__(self):
        super().__init__()
        self.into, self.made = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.out:
            self.into += 1
        elif func is torch.ops.aten._scaled_mm.default:
            self.made += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_experts_weight_gradients_accumulate_into_main_grad(recipe):
    fused, fused_ddp = _experts(torch.bfloat16, fusion=True, fp8_recipe=recipe)
    unfused, unfused_ddp = _experts(torch.bfloat16, fusion=False, fp8_recipe=recipe)
    assert fused.fp8["fc1"].linears[0].writes_into(fused.fc1_weight.main_grad)  # probed here, not counted below
    with ScaledMatmuls() as gemms:
        made, calls = _train(fused, fused_ddp, torch.bfloat16)
    made_unfused, _ = _train(unfused, unfused_ddp, torch.bfloat16)
    assert made == 0
    assert made_unfused >= 2 * len(COUNTS)
    assert calls == {fused.fc1_weight: len(COUNTS), fused.fc2_weight: len(COUNTS)}
    # The first micro-batch's 4 experts x 2 weights write into main_grad; later ones are added.
    assert gemms.into == 2 * 4
    for name in ("fc1_weight", "fc2_weight"):
        torch.testing.assert_close(getattr(fused, name).main_grad, getattr(unfused, name).main_grad,
                                   **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32])
def test_compiled_grouped_accumulation_equals_the_reference(dtype):
    """With the elementwise fusions compiled (parallelize.compile_declared, as --fuse-elementwise
    runs it) the grouped product reaches main_grad through the compiled one-pass function
    (test_moe_op_count.py counts its kernel, bf16 products included): the same main_grad,
    `param.grad` still None. In fp32: in bf16 the compiled SwiGLU rounds once where the eager
    reference rounds twice, a difference that is not this test's."""
    from megatron.core.transformer.parallelize import compile_declared
    from megatron.core.utils import compiled

    if not _cpu_grouped_mm():
        pytest.skip("this PyTorch has no CPU torch._grouped_mm (2.13 has; the GPU lane tests the kernel)")
    fused, fused_ddp = _experts(dtype, fusion=True, grouped=True)
    compile_declared(fused, ExecutionConfig(fuse_elementwise=True))
    assert fused.accumulate_grads is compiled(experts_module.accumulate_expert_grads_)
    want = _reference(fused, dtype)
    for counts, x, probs, grad in _micro_batches(dtype):  # (a dispatch mode would keep compile out)
        fused_ddp(x.clone().requires_grad_(), counts, probs).backward(grad)
        assert fused.fc1_weight.grad is None and fused.fc2_weight.grad is None
    fused_ddp.finish_grad_sync()
    torch.testing.assert_close(fused.fc1_weight.main_grad, want[0], **TOLERANCE[dtype])
    torch.testing.assert_close(fused.fc2_weight.main_grad, want[1], **TOLERANCE[dtype])


@pytest.mark.parametrize("fp8_format, recipe", [("hybrid", "tensorwise"), ("e4m3", "tensorwise"),
                                                ("hybrid", "delayed")])
def test_fp8_per_expert_gradients_equal_the_grouped_path(fp8_format, recipe, monkeypatch):
    """--moe-grouped-wgrad per-expert under FP8 (padded routing: counts multiples of 16 on the
    device, sentinel rows after them): both gradient GEMMs are `torch._scaled_mm` per expert with
    rows, on the casts the grouped path makes (E5M2 x E4M3 under hybrid, which the grouped FP8 kernel
    cannot multiply), no grouped GEMM left in backward; the first micro-batch's weight gradients are
    written into main_grad by the GEMM, the later ones added, or, with `bf16_accumulation` (what
    --moe-grouped-wgrad auto may choose), multiplied as the casts widened to bf16 by one GEMM per
    expert accumulating into main_grad (`accumulate_matmul_`; no FP8 product made). Same FP8 values
    and scales as the grouped path (here its dequantized grouped GEMM, as on the CPU), which rounds
    every weight-gradient product to bf16 where the first per-expert one is written in fp32: within
    bf16's rounding."""
    from megatron.core.transformer.moe import fp8_experts
    from tests.unit.test_moe_host_sync import HostReads

    if not _cpu_grouped_mm():
        pytest.skip("this PyTorch has no CPU torch._grouped_mm (2.13 has; the GPU lane tests the kernel)")
    grouped_gemm, grouped_calls = fp8_experts._grouped_gemm, []
    monkeypatch.setattr(fp8_experts, "_grouped_gemm", lambda *a: grouped_calls.append(1) or grouped_gemm(*a))
    generator = torch.Generator().manual_seed(5)
    batches = []
    for counts in ([16, 0, 32, 16], [32, 16, 16, 0], [16, 16, 16, 16]):
        rows = sum(counts) + 16  # sentinel rows after the counted ones
        batches.append((torch.tensor(counts), torch.randn(rows, HIDDEN, generator=generator).bfloat16(),
                        torch.rand(rows, generator=generator).bfloat16(),
                        torch.randn(rows, HIDDEN, generator=generator).bfloat16()))
    mode = HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: mode.reads.append("tolist") or tolist(self))
    accumulated = []
    monkeypatch.setattr(fp8_experts, "accumulate_matmul_",
                        lambda *a: accumulated.append(1) or experts_module.accumulate_matmul_(*a))
    results = {}
    for variant in ("grouped-mm", "per-expert", "bf16 accumulation"):
        wgrad = "grouped-mm" if variant == "grouped-mm" else "per-expert"
        experts, ddp = _experts(torch.bfloat16, fusion=True, fp8_recipe=recipe, grouped=True, fp8_format=fp8_format,
                                moe_router_padding_for_fp8=True, moe_grouped_wgrad=wgrad)
        for fp8 in experts.fp8.values():
            fp8.bf16_accumulation = variant == "bf16 accumulation"
        accumulated.clear()
        assert experts.fp8_counts_on_device(batches[0][1])
        # (probed here, not counted below)
        assert experts.fp8["fc1"].linears[0].writes_into(experts.fc1_weight.main_grad)
        input_grads, backward_grouped, reads = [], 0, []
        with ScaledMatmuls() as gemms:
            for counts, x, probs, grad in batches:
                inputs = x.clone().requires_grad_()
                out = ddp(inputs, counts, probs)
                grouped_calls.clear()
                mode.reads.clear()
                with mode:
                    out.backward(grad)
                backward_grouped += len(grouped_calls)
                reads.append(list(mode.reads))
                if wgrad == "per-expert":  # sentinel rows: zeros (not what an empty tensor held)
                    assert torch.all(inputs.grad[int(counts.sum()):] == 0)
                input_grads.append(inputs.grad[:int(counts.sum())].float())
        ddp.finish_grad_sync()
        results[variant] = dict(grouped=backward_grouped, into=gemms.into, made=gemms.made, reads=reads,
                                accumulated=len(accumulated), input_grad=torch.cat(input_grads),
                                fc1=experts.fc1_weight.main_grad.clone(), fc2=experts.fc2_weight.main_grad.clone())
    grouped = results["grouped-mm"]
    with_rows = [sum(count > 0 for count in counts.tolist()) for counts, *_ in batches]
    assert grouped["grouped"] == 2 * 2 * len(batches)
    for variant in ("per-expert", "bf16 accumulation"):
        per_expert = results[variant]
        assert per_expert["grouped"] == 0
        assert per_expert["reads"] == [["tolist"]] * len(batches)  # the counts once per backward, both weights
        # Per weight: the first micro-batch's experts with rows write into main_grad, then a product
        # each (or a bf16 GEMM accumulating); an input gradient per expert with rows (written into its
        # rows of the result).
        assert per_expert["into"] == 2 * (with_rows[0] + sum(with_rows))
        later = 2 * sum(with_rows[1:])
        assert (per_expert["made"], per_expert["accumulated"]) == ((later, 0) if variant == "per-expert" else (0, later))
        for name in ("input_grad", "fc1", "fc2"):
            torch.testing.assert_close(per_expert[name], grouped[name], rtol=2 ** -7,
                                       atol=2 ** -7 * grouped[name].abs().max().item())
        assert per_expert["fc1"].abs().sum() > 0 and per_expert["fc2"].abs().sum() > 0
