"""--moe-grouped-wgrad auto: the routed experts' weight-gradient path, chosen at start-up by timing it.

The grouped experts' weight gradients reach `main_grad` one of two ways (moe/experts.py): one
grouped GEMM per weight whose product one pass adds into main_grad (`grouped-mm`), or one GEMM per
local expert accumulating into its main_grad slice (`per-expert`: no product and no pass after it,
but a GEMM per expert). Which is faster depends on the experts' shapes: a few large experts
(Mixtral's 8 of 14336) favour the GEMMs per expert, many small ones (Qwen3-MoE's 128 of 768) the one
grouped GEMM. Under `auto` each kind of experts module (its weights' shapes and dtype, FP8 or not)
is timed once with both paths, on this rank's device, and every module of that kind takes the
faster one; `per-expert` must win by `MARGIN`, so that a tie keeps the grouped path (the one the
CPU and the tests run by default). Each rank probes for itself, as the attention probe does.

FP8 experts time a third path: per expert, with the weight gradients of a step's later micro-batches
(once main_grad holds a sum) as bf16 GEMMs of the widened FP8 casts accumulating into main_grad,
instead of FP8 GEMMs whose products are added to it (`torch._scaled_mm` has no accumulating output:
12 bytes per weight element and micro-batch). The bf16 GEMM is slower, but the pass it saves does
not shrink with the rows an expert gets, so it can only win for experts with few rows: the cost
model calls it a draw at Mixtral's 1,024 rows per micro-batch on one GPU, unless cuBLAS hides
main_grad's traffic under the GEMM, and a loss at EP 8's 8,192; the timing decides.

The timing runs one forward and backward of both weights of the first `probe_experts` local
experts (as many as fit `SCRATCH_BYTES` of fp32 gradients) on the rows each receives from a
micro-batch under balanced routing, into stand-in parameters: the module's weights (views, not
copies) with a main_grad of their own and no data-parallel hook, so the model's gradients and
hooks are not touched. FP8 experts are timed with tensorwise scales of their own (no delayed-scaling
history is recorded). A path that raises is not chosen, and the reason is reported. On the CPU
nothing is timed (no fp32-output GEMM there to accumulate with) and `grouped-mm` runs.
"""
import math
from typing import Callable, Optional

import torch

from megatron.core import utils
from megatron.core.transformer.moe.experts import GroupedMLP, HostCounts, _ExpertsFunction
from megatron.core.transformer.moe.fp8_experts import FP8_ALIGNMENT, ExpertsFP8

GROUPED, PER_EXPERT, ACCUMULATING = "grouped-mm", "per-expert", "per-expert accumulating in bf16"
CHOICES = (GROUPED, PER_EXPERT)  # and, for FP8 experts, ACCUMULATING (`choices`)
MARGIN = 0.05                 # per-expert is taken only when at least 5% faster
# fp32 stand-in gradients the probe may allocate: at most one layer's experts' main_grad, which data
# parallelism allocates after it anyway for every layer (returned to the device when the probe ends);
# enough for every local expert of the Mixtral and Qwen3-MoE presets, so that the compiled
# accumulation sees the shapes it trains with (DeepSeek-V3's 256 experts of 2048 run 48 of them: one
# more compilation, at start-up)
SCRATCH_BYTES = 8 * 2 ** 30


def probe_experts(module: GroupedMLP) -> int:
    """How many of the module's local experts the probe runs: as many as fit SCRATCH_BYTES of fp32
    gradients of both weights, at least one."""
    per_expert = 4 * (module.fc1_weight[0].numel() + module.fc2_weight[0].numel())
    return max(1, min(module.num_local_experts, SCRATCH_BYTES // per_expert))


def rows_per_expert(tokens: int, topk: int, num_experts: int, expert_ranks: int) -> int:
    """The rows a local expert receives from one micro-batch under balanced routing: this rank's
    `tokens` x top-k spread over all experts, from each of the `expert_ranks` ranks that send to it
    (EP x ETP), rounded up to 16 (FP8's alignment; at least 16)."""
    rows = math.ceil(tokens * topk * expert_ranks / num_experts)
    return max(FP8_ALIGNMENT, -(-rows // FP8_ALIGNMENT) * FP8_ALIGNMENT)


def choices(module: GroupedMLP) -> tuple:
    """The paths timed for a module: FP8 experts also time per-expert with the weight gradients of a
    step's later micro-batches as bf16 GEMMs of the widened casts accumulating into main_grad
    (`ExpertsFP8.bf16_accumulation`) against FP8 products added to it."""
    return CHOICES + ((ACCUMULATING,) if module.fp8 is not None else ())


def _kind(module: GroupedMLP) -> tuple:
    fp8 = None
    if module.fp8 is not None:
        options = module.fp8["fc1"].options
        fp8 = (options.format, options.recipe)
    return (tuple(module.fc1_weight.shape), tuple(module.fc2_weight.shape), module.fc1_weight.dtype, fp8,
            module.gated, module.fc1_bias is not None)


def takes_a_choice(module: GroupedMLP, device) -> bool:
    """Whether the module runs a grouped path whose weight gradients are fused into main_grad, the
    paths --moe-grouped-wgrad chooses between (--gradient-accumulation-fusion on; bf16 grouped
    GEMMs, or FP8 experts on padded routing with one scale per expert and tensor)."""
    if not (module.wgrad_auto and module.gradient_accumulation_fusion):
        return False
    probe = torch.empty((0, module.fc1_weight.shape[-1]), device=device, dtype=module.fc1_weight.dtype)
    return module.fp8_counts_on_device(probe) if module.fp8 is not None else module.uses_grouped_mm(probe)


def choose_expert_wgrad(chunks: list, rows: int, device, time_path: Optional[Callable] = None) -> str:
    """Sets, on every `GroupedMLP` of `chunks` under --moe-grouped-wgrad auto that takes a choice,
    the faster weight-gradient path (`module.per_expert_wgrad`), one timing per kind of module;
    returns what was chosen for the fast-paths line ("" where nothing was). `rows`: rows per local
    expert and micro-batch (`rows_per_expert`). `time_path(module, choice)` -> seconds (or raises)
    replaces the timing (tests); without it nothing is timed on the CPU and `grouped-mm` stays."""
    kinds = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, GroupedMLP) and takes_a_choice(module, device):
                kinds.setdefault(_kind(module), []).append(module)
    if not kinds:
        return ""
    if time_path is None:
        if device.type == "cpu":
            return "auto -> grouped-mm (not timed on the CPU)"
        def time_path(module, choice):
            return time_expert_wgrad(module, choice, rows, device)
    reports = []
    try:
        for modules in kinds.values():
            reports.append(_choose_for_kind(modules, time_path, rows))
    finally:
        utils.empty_cache(device)  # the probe's blocks back to the device before the buffers are made
    return "; ".join(dict.fromkeys(reports))


def _choose_for_kind(modules: list, time_path, rows: int) -> str:
    """Times each path for one kind of module (`modules`), sets the fastest on all of them and says
    so; a per-expert path must beat the grouped one by MARGIN."""
    seconds, failures = {}, []
    for choice in choices(modules[0]):
        try:
            seconds[choice] = time_path(modules[0], choice)
        except (RuntimeError, ValueError, NotImplementedError) as error:
            failures.append(f"{choice} failed: {str(error).splitlines()[0][:120]}")
    fastest = min((choice for choice in seconds if choice != GROUPED), key=seconds.get, default=None)
    chosen = GROUPED
    if fastest is not None and seconds[fastest] < (1 - MARGIN) * seconds.get(GROUPED, math.inf):
        chosen = fastest
    for module in modules:
        module.per_expert_wgrad = chosen != GROUPED
        for fp8 in (module.fp8 or {}).values():
            fp8.bf16_accumulation = chosen == ACCUMULATING
    timed = ", ".join(f"{choice} {seconds[choice] * 1e3:.2f} ms" for choice in choices(modules[0])
                      if choice in seconds)
    experts = probe_experts(modules[0])
    return (f"auto -> {chosen} ({timed} for {experts} experts x {rows} rows"
            + "".join(f"; {failure}" for failure in failures) + ")")


def time_expert_wgrad(module: GroupedMLP, choice: str, rows: int, device, warmup: int = None,
                      repeats: int = None) -> float:
    """Median seconds of one forward and backward of both of the module's weights for its first
    `probe_experts` experts, `rows` rows each, the weight gradients reaching stand-in fp32
    main_grads by the path `choice` (one of `choices(module)`; the stand-ins' main_grad is never
    marked empty, so every call accumulates, as a step's later micro-batches do). The module's
    parameters, their main_grad and hooks are untouched."""
    from megatron.core.transformer.attention import PROBE_REPEATS, PROBE_WARMUP, median_seconds
    from megatron.core.transformer.fp8 import FP8Linear, FP8Options

    experts = probe_experts(module)
    weights = []
    for weight in (module.fc1_weight, module.fc2_weight):
        stand_in = torch.nn.Parameter(weight.detach()[:experts])
        stand_in.main_grad = torch.zeros(stand_in.shape, dtype=torch.float32, device=stand_in.device)
        weights.append(stand_in)
    dtype, hidden = module.fc1_weight.dtype, module.fc1_weight.shape[-1]
    counts = torch.full((experts,), rows, device=device, dtype=torch.int64)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(experts * rows, hidden, device=device, dtype=dtype, generator=generator)
    grad = torch.randn(experts * rows, hidden, device=device, dtype=dtype, generator=generator)
    fp8 = None
    if module.fp8 is not None:  # tensorwise casts of their own: no scaling state is touched
        first = module.fp8["fc1"].linears[0]
        options = FP8Options(first.options.format, "tensorwise")
        fp8 = {name: ExpertsFP8([FP8Linear(options, None, compiled=first.compiled) for _ in range(experts)])
               for name in ("fc1", "fc2")}
        for experts_fp8 in fp8.values():
            experts_fp8.bf16_accumulation = choice == ACCUMULATING
    per_expert = choice != GROUPED

    def linear(inputs, weight, name, host_counts):
        if fp8 is not None:
            return fp8[name](inputs, weight, counts, module.accumulate_grads, False, host_counts)
        return _ExpertsFunction.apply(inputs, weight, counts, True, module.accumulate_grads, False, host_counts)

    def step():
        host_counts = HostCounts(counts) if per_expert else None
        inputs = x.detach().requires_grad_()
        h = linear(inputs, weights[0], "fc1", host_counts)
        linear(module._activate(h), weights[1], "fc2", host_counts).backward(grad)

    seconds = median_seconds(step, device, PROBE_WARMUP if warmup is None else warmup,
                             PROBE_REPEATS if repeats is None else repeats)
    return seconds
