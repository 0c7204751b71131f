"""One plan: the memory per GPU term by term with a verdict, and the predicted step time, for a
run's flags on a target cluster. `pretrain_gpt.py --dry-run` and `tools/plan.py` print it."""
import copy
from dataclasses import dataclass

from megatron.training.planning.architecture import Architecture, active_parameters, architecture, total_parameters
from megatron.training.planning.hardware import Cluster
from megatron.training.planning.layout import Layout, layout_from_config
from megatron.training.planning.memory import GIB, StageMemory, memory_per_stage
from megatron.training.planning.timing import StepTime, step_time

MARGIN = 0.10  # of the GPU's memory, kept for the CUDA context, NCCL buffers and fragmentation


@dataclass
class Plan:
    arch: Architecture
    layout: Layout
    cluster: Cluster
    stages: list          # StageMemory per pipeline stage
    time: StepTime
    margin: float = MARGIN

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def budget(self) -> float:
        return self.cluster.gpu.memory_bytes * (1 - self.margin)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.budget

    def verdict(self) -> str:
        gpu, total, capacity = self.cluster.gpu, self.worst.total, self.cluster.gpu.memory_bytes
        if total <= self.budget:
            return (f"fits on {gpu.name}: {total / GIB:.2f} of {capacity / GIB:.2f} GiB, "
                    f"{(capacity - total) / GIB:.2f} GiB free (at least {self.margin:.0%} is kept for the CUDA "
                    f"context, communication buffers and fragmentation)")
        if total <= capacity:
            return (f"too tight for {gpu.name}: {total / GIB:.2f} of {capacity / GIB:.2f} GiB leaves less than the "
                    f"{self.margin:.0%} needed for the CUDA context, communication buffers and fragmentation")
        return f"does not fit on {gpu.name}: {total / GIB:.2f} GiB needed, {capacity / GIB:.2f} GiB there"


def model_architecture(config, vocab_size: int, tp: int = None) -> Architecture:
    """The architecture a run with these flags builds (at tensor-parallel size `tp`: the padded
    vocabulary depends on it)."""
    from megatron.training import builders

    if tp is not None and tp != config.parallel.tensor_model_parallel_size:
        config = copy.deepcopy(config)
        config.parallel.tensor_model_parallel_size = tp
    return architecture(builders.transformer_config(config, vocab_size))


def layout_for_flags(config, vocab_size: int, world_size: int) -> Layout:
    """The layout a run's flags ask for, on `world_size` GPUs (the start of a layout search). The
    search replaces the parallel sizes, so flags whose TP x PP x CP does not divide `world_size`
    still start it (on one data-parallel replica of theirs)."""
    from megatron.training import builders

    p = config.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    world_size = world_size if world_size % model_parallel == 0 else model_parallel
    return layout_from_config(config, builders.transformer_config(config, vocab_size), world_size)


def make_plan(arch: Architecture, layout: Layout, cluster: Cluster, margin: float = MARGIN) -> Plan:
    return Plan(arch=arch, layout=layout, cluster=cluster, stages=memory_per_stage(arch, layout),
                time=step_time(arch, layout, cluster), margin=margin)


def plan_for_flags(config, vocab_size: int, world_size: int, cluster: Cluster, margin: float = MARGIN,
                   on_cpu: bool = False) -> Plan:
    """The plan of a run with these flags on `world_size` GPUs of `cluster` (`on_cpu`: the memory of
    the same run on CPU processes, whose kernels run eagerly and save some tensors wider)."""
    from megatron.training import builders

    model_config = builders.transformer_config(config, vocab_size)
    layout = layout_from_config(config, model_config, world_size)
    if on_cpu:
        layout = layout.replace(device="cpu", fused_elementwise=False)
    return make_plan(architecture(model_config), layout, cluster, margin)


def reducing_flags(plan: Plan) -> list:
    """The flags that would shrink the largest terms, given the layout's."""
    lay, terms = plan.layout, plan.worst.terms
    hints = []
    if terms.get("activations", 0) + terms.get("logits and loss", 0) > 0.3 * plan.worst.total:
        if lay.recompute_granularity != "full":
            hints.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
        if lay.micro_batch_size > 1:
            hints.append(f"--micro-batch-size {lay.micro_batch_size // 2}")
        if lay.tp > 1 and not lay.sp:
            hints.append("--sequence-parallel")
        hints.append("--context-parallel-size 2 (long sequences)")
        if plan.arch.is_moe and not lay.moe_layer_recompute:
            hints.append("--moe-layer-recompute")
    experts = sum(terms.get(name, 0) for name in ("expert weights", "expert gradients", "expert optimizer state"))
    if experts > 0.3 * plan.worst.total and plan.arch.num_experts % (2 * lay.ep) == 0:
        hints.append(f"--expert-model-parallel-size {2 * lay.ep}")
    if not (lay.distributed_optimizer or lay.fsdp2) and lay.dp * lay.cp > 1:
        hints.append("--use-distributed-optimizer" + ("" if plan.arch.is_moe else " (or --use-torch-fsdp2)"))
    if lay.precision == "fp32":
        hints.append("--bf16")
    hints.append(f"--tensor-model-parallel-size {2 * lay.tp} or --pipeline-model-parallel-size {2 * lay.pp}")
    return hints


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def _experts(arch: Architecture) -> str:
    if not arch.is_moe:
        return ""
    moe_layers = arch.moe_layer_count(0, arch.num_layers)
    shared = f" + shared {arch.moe_shared_expert_size}" if arch.moe_shared_expert_size else ""
    return (f"; {moe_layers} mixture-of-experts layers of {arch.num_experts} experts, top-{arch.moe_router_topk}, "
            f"expert FFN {arch.moe_ffn_hidden_size}{shared}, {arch.moe_dispatcher} dispatcher; "
            f"{active_parameters(arch) / 1e9:.2f} B active")


def format_plan(plan: Plan) -> str:
    arch, lay, cluster, worst = plan.arch, plan.layout, plan.cluster, plan.worst
    lines = [f"plan for {cluster.nodes} node(s) x {cluster.gpus_per_node} {cluster.gpu.name} "
             f"({lay.world_size} GPUs used): {lay.describe()}",
             f"  model: {total_parameters(arch) / 1e9:.2f} B parameters ({arch.num_layers} layers, hidden "
             f"{arch.hidden_size}, {arch.num_attention_heads} heads / {arch.num_query_groups} query groups, FFN "
             f"{arch.ffn_hidden_size}, padded vocabulary {arch.vocab_size}" + _experts(arch)
             + f"); sequence {lay.seq_length}, {lay.precision}"
             + (" + FP8" if lay.fp8 else "") + f"; global batch {lay.global_batch_size} = {lay.num_microbatches} "
             f"micro-batches of {lay.micro_batch_size} x DP {lay.dp}"]
    where = f" (pipeline stage {worst.stage} of {lay.pp}, the largest; {worst.layers} layers)" if lay.pp > 1 else ""
    lines.append(f"  memory per GPU{where}:")
    for name, value in worst.terms.items():
        lines.append(f"    {name:24s}{_gib(value)}  {value / worst.total:4.0%}")
    lines.append(f"    {'total':24s}{_gib(worst.total)}")
    largest = sorted(worst.terms, key=worst.terms.get, reverse=True)[:2]
    lines.append(f"  largest terms: {', '.join(largest)}; verdict: {plan.verdict()}")
    t = plan.time
    parts = ", ".join(f"{name} {seconds * 1e3:.0f}" if seconds >= 0.01 else f"{name} {seconds * 1e3:.1f}"
                      for name, seconds in t.parts.items())
    lines.append(f"  step time (prediction): {t.seconds * 1e3:.0f} ms ({parts} ms); {t.tokens_per_second:,.0f} "
                 f"tokens/s, {t.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} TFLOP/s/GPU, "
                 f"MFU {t.mfu:.1%} (of {cluster.gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16)")
    return "\n".join(lines)
