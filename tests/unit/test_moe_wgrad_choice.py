"""--moe-grouped-wgrad auto (the default): the experts' weight-gradient path chosen at start-up by
timing both (moe/wgrad_choice.py).

The choice itself, with the timing replaced: the faster path wins, per-expert only by 5%, a path that
raises is never taken and is named, each kind of experts module is timed once and every module of
that kind takes its choice (FP8 experts choose among three: per expert also with bf16 accumulation);
nothing is timed on the CPU (grouped-mm stays). The timing, run for real on the CPU (bf16 and FP8
experts, every path): it runs the path it times (one accumulating GEMM per expert, or the grouped
product's one add, or FP8's widened casts) into stand-in gradients, and leaves the model's weights,
main_grad, data-parallel hooks and delayed-scaling history as they were. The rows per expert are
the balanced routing's.
"""
import pytest
import torch

from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.wgrad_choice import (choices, choose_expert_wgrad, probe_experts,
                                                        rows_per_expert, time_expert_wgrad)
from tests.unit.test_moe_grad_fusion import attach_fp8
from tests.unit.test_moe_layer import config

CPU = torch.device("cpu")


def chunk(layers: int = 2, wgrad: str = "auto", dtype=torch.float32, fusion: bool = True, device=CPU,
          **overrides):
    """A module list of `layers` MoE layers (4 experts, ffn 16) as a model chunk holds them."""
    execution = ExecutionConfig(params_dtype=dtype, moe_grouped_wgrad=wgrad, gradient_accumulation_fusion=fusion,
                                **overrides)
    cfg = config(moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall")
    return torch.nn.ModuleList([MoELayer(cfg, execution=execution, layer_number=n, groups=single_process(),
                                         device=device) for n in range(layers)])


def experts_of(modules) -> list:
    return [m for m in modules.modules() if isinstance(m, GroupedMLP)]


def timer(times: dict, calls: list):
    def time_path(module, choice):
        calls.append(choice)
        if isinstance(times[choice], Exception):
            raise times[choice]
        return times[choice]
    return time_path


@pytest.mark.parametrize("grouped, per_expert, chosen", [
    (2e-3, 1e-3, "per-expert"),
    (1e-3, 2e-3, "grouped-mm"),
    (1e-3, 0.96e-3, "grouped-mm"),          # 4% faster: within the margin, the grouped path stays
    (1e-3, 0.94e-3, "per-expert"),
])
def test_the_faster_path_is_taken_by_every_module_of_the_kind(grouped, per_expert, chosen):
    modules = chunk()
    calls = []
    report = choose_expert_wgrad([modules], 64, CPU, timer({"grouped-mm": grouped, "per-expert": per_expert}, calls))
    assert calls == ["grouped-mm", "per-expert"]  # one kind (both layers alike): timed once
    assert [m.per_expert_wgrad for m in experts_of(modules)] == [chosen == "per-expert"] * 2
    assert report == (f"auto -> {chosen} (grouped-mm {grouped * 1e3:.2f} ms, per-expert {per_expert * 1e3:.2f} ms "
                      f"for 4 experts x 64 rows)")


@pytest.mark.parametrize("accumulating, chosen", [
    (0.8e-3, "per-expert accumulating in bf16"),
    (0.95e-3, "per-expert"),                # the faster per-expert path, whichever it is
    (2e-3, "per-expert"),
])
def test_fp8_experts_also_time_per_expert_accumulating_in_bf16(accumulating, chosen):
    """FP8 experts time a third path (the later micro-batches' weight gradients as bf16 GEMMs of the
    widened casts accumulating into main_grad); the fastest per-expert path is set on every module
    of the kind, FP8 products or bf16 accumulation on both of its weights."""
    modules = chunk(dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise", moe_router_padding_for_fp8=True)
    attach_fp8(experts_of(modules), "hybrid", "tensorwise")
    calls = []
    times = {"grouped-mm": 2e-3, "per-expert": 0.9e-3, "per-expert accumulating in bf16": accumulating}
    report = choose_expert_wgrad([modules], 64, CPU, timer(times, calls))
    assert calls == list(times)
    for module in experts_of(modules):
        assert module.per_expert_wgrad
        assert [fp8.bf16_accumulation for fp8 in module.fp8.values()] == [chosen != "per-expert"] * 2
    assert report == (f"auto -> {chosen} (grouped-mm 2.00 ms, per-expert 0.90 ms, per-expert accumulating in bf16 "
                      f"{accumulating * 1e3:.2f} ms for 4 experts x 64 rows)")
    # a grouped path within the margin of the fastest stays
    times["grouped-mm"] = 0.82e-3
    choose_expert_wgrad([modules], 64, CPU, timer(times, []))
    assert not any(m.per_expert_wgrad or m.fp8["fc1"].bf16_accumulation for m in experts_of(modules))


def test_a_path_that_fails_is_not_taken_and_is_named():
    modules = chunk()
    report = choose_expert_wgrad([modules], 64, CPU, timer({"grouped-mm": 5e-3, "per-expert": RuntimeError(
        "CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")}, []))
    assert not any(m.per_expert_wgrad for m in experts_of(modules))
    assert report.endswith("for 4 experts x 64 rows; per-expert failed: CUBLAS_STATUS_NOT_SUPPORTED when calling "
                           "cublasLtMatmul)")


def test_each_kind_is_timed_once_and_other_choices_are_left_alone():
    wide, narrow = chunk(layers=1), chunk(layers=2)
    narrow_config = config(moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall")
    narrow[1] = MoELayer(narrow_config, execution=ExecutionConfig(moe_grouped_wgrad="auto"), layer_number=1,
                         groups=single_process(), device=CPU)
    forced = chunk(layers=1, wgrad="grouped-mm")
    unfused = chunk(layers=1, fusion=False)
    calls = []
    choose_expert_wgrad([wide, narrow, forced, unfused], 64, CPU,
                        timer({"grouped-mm": 2e-3, "per-expert": 1e-3}, calls))
    assert len(calls) == 2 * 2  # two kinds (ffn 16 and 32), both paths each
    assert all(m.per_expert_wgrad for m in experts_of(wide) + experts_of(narrow))
    assert not experts_of(forced)[0].per_expert_wgrad and not experts_of(unfused)[0].per_expert_wgrad
    assert choose_expert_wgrad([forced, unfused], 64, CPU, timer({}, [])) == ""


def test_nothing_is_timed_on_the_cpu():
    modules = chunk()
    assert choose_expert_wgrad([modules], 64, CPU) == "auto -> grouped-mm (not timed on the CPU)"
    assert not any(m.per_expert_wgrad for m in experts_of(modules))


def test_rows_per_expert_are_the_balanced_routings():
    assert rows_per_expert(4096, 2, 8, 1) == 1024           # Mixtral on one GPU
    assert rows_per_expert(4096, 8, 128, 1) == 256          # Qwen3-30B-A3B on one GPU
    assert rows_per_expert(2048, 8, 128, 8) == 1024         # EP 8: every rank sends to a local expert
    assert rows_per_expert(100, 2, 8, 1) == 32              # 25, rounded up to 16
    assert rows_per_expert(1, 1, 64, 1) == 16


def _model(fp8_format=None, recipe="tensorwise"):
    """Two MoE layers under one-process data parallelism (main_grad buffers and hooks), in bf16 and,
    with `fp8_format`, FP8 experts on padded routing."""
    extra = dict(fp8=fp8_format, fp8_recipe=recipe, moe_router_padding_for_fp8=True) if fp8_format else {}
    modules = chunk(dtype=torch.bfloat16, **extra)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in modules.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    scaling = attach_fp8(experts_of(modules), fp8_format, recipe) if fp8_format else None
    ddp = DistributedDataParallel(modules, single_process())
    ddp.zero_grad_buffer()
    return modules, ddp, scaling


@pytest.mark.parametrize("fp8_format, recipe", [(None, None), ("hybrid", "tensorwise"), ("e4m3", "delayed")])
def test_the_timing_runs_each_path_and_leaves_the_model_alone(fp8_format, recipe, monkeypatch):
    modules, ddp, scaling = _model(fp8_format, recipe)
    module = experts_of(modules)[0]
    hooked = []
    for param in ddp.params:
        param.main_grad_hook = lambda p: hooked.append(p)
    before = {name: p.detach().clone() for name, p in modules.named_parameters()}
    history = scaling.history.clone() if scaling is not None else None
    per_expert, grouped = [], []
    accumulate = experts_module._accumulate_per_expert_
    monkeypatch.setattr(experts_module, "_accumulate_per_expert_",
                        lambda *a: per_expert.append(1) or accumulate(*a))
    module.accumulate_grads = lambda *a: grouped.append(1) or experts_module.accumulate_expert_grads_(*a)
    from megatron.core.transformer.moe import fp8_experts
    scaled = fp8_experts._per_expert_gradients
    monkeypatch.setattr(fp8_experts, "_per_expert_gradients", lambda *a: per_expert.append(1) or scaled(*a))
    widened, widen = [], fp8_experts._widened_for_accumulation
    monkeypatch.setattr(fp8_experts, "_widened_for_accumulation", lambda *a: widened.append(1) or widen(*a))
    assert probe_experts(module) == 4
    runs = 1 + 1   # one warm-up call and one timed one
    seconds = {}
    assert choices(module) == (("grouped-mm", "per-expert") if fp8_format is None else
                               ("grouped-mm", "per-expert", "per-expert accumulating in bf16"))
    for choice in choices(module):
        seconds[choice] = time_expert_wgrad(module, choice, 32, CPU, warmup=1, repeats=1)
    assert all(s > 0 for s in seconds.values())
    # each path ran: per weight and call, the grouped product's add or the per-expert GEMMs; FP8's
    # third path with the casts widened for accumulation (every call: the stand-ins' main_grad holds a sum)
    assert grouped == [1] * 2 * runs
    assert per_expert == [1] * 2 * runs * (len(seconds) - 1)
    assert widened == ([] if fp8_format is None else [1] * 2 * runs)
    assert hooked == []
    for name, p in modules.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert not p.main_grad.any(), name
    if scaling is not None:
        assert torch.equal(scaling.history, history)


def test_start_up_probes_the_rows_of_a_micro_batch_and_names_the_choice(monkeypatch):
    """The training start-up (`training._choose_expert_wgrad`): the rows each local expert gets from
    a micro-batch of 2 x 32 tokens, top-2 over 4 experts (32), and, where every module took the same
    path, the execution config naming it (what the fast-paths line and FP8's report read)."""
    from megatron.training import training
    from megatron.training.arguments import parse_args
    from tests.unit.test_moe_flags import MINIMAL

    config = parse_args(MINIMAL + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"])
    modules = chunk()
    model_config = type("Routing", (), dict(num_experts=4, moe_router_topk=2))()  # (only its routing is read)
    asked = []

    def choose(chunks, rows, device):
        asked.append(rows)
        for module in experts_of(chunks[0]):
            module.per_expert_wgrad = True
        return "auto -> per-expert (...)"

    monkeypatch.setattr(training, "choose_expert_wgrad", choose)
    execution = ExecutionConfig(moe_grouped_wgrad="auto")
    chosen, report = training._choose_expert_wgrad([modules], config, single_process(), model_config, execution)
    assert asked == [32] and report == "auto -> per-expert (...)"
    assert chosen.moe_grouped_wgrad == "per-expert"
    forced = ExecutionConfig(moe_grouped_wgrad="grouped-mm")
    assert training._choose_expert_wgrad([modules], config, single_process(), model_config, forced) == (forced, "")
