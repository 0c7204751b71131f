"""Ranking layouts: every TP, PP, VPP, CP, DP, sharding (DDP, distributed optimizer, FSDP2),
recomputation and micro-batch size that divides the model, the sequence and the global batch on
the cluster, and for a mixture of experts every EP and ETP the start-up validation accepts (with
and without --moe-layer-recompute), kept when it fits the GPU's memory (with the margin), ordered
by predicted tokens/s."""
import itertools
from typing import Callable

from megatron.training.errors import ConfigError
from megatron.training.validation import check_expert_layout

from megatron.training.planning.hardware import Cluster
from megatron.core.parallel_layout import PipelineSplit
from megatron.training.planning.layout import Layout
from megatron.training.planning.plan import MARGIN, make_plan

SHARDING = ("distributed optimizer", "FSDP2", "DDP")
RECOMPUTE = (None, "selective", "full")


def _divisors(n: int, limit: int) -> list:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _tp_sizes(arch, gpus_per_node: int) -> list:
    sizes = []
    for tp in _divisors(arch.num_attention_heads, gpus_per_node):
        groups = arch.num_query_groups
        if arch.ffn_hidden_size % tp == 0 and (groups % tp == 0 or tp % groups == 0):
            sizes.append(tp)
    return sizes


def candidate_layouts(arch_for_tp: Callable, base: Layout, cluster: Cluster) -> list:
    """(architecture, layout) pairs: every layout of the cluster's GPUs this model and batch allow."""
    world = cluster.world_size
    arch1 = arch_for_tp(1)
    found = []
    for tp in _tp_sizes(arch1, cluster.gpus_per_node):
        arch = arch_for_tp(tp)
        for pp, cp in itertools.product(_divisors(arch.num_layers, world // tp), (1, 2, 4, 8, 16)):
            if world % (tp * pp * cp) or base.seq_length % (2 * cp):
                continue
            dp = world // (tp * pp * cp)
            vpps = [v for v in (1, 2, 4) if pp > 1 and v > 1 and arch.num_layers % (pp * v) == 0] + [1]
            for mbs, vpp, sharding, recompute in itertools.product((1, 2, 4, 8), vpps, SHARDING, RECOMPUTE):
                if base.global_batch_size % (mbs * dp):
                    continue
                microbatches = base.global_batch_size // (mbs * dp)
                if vpp > 1 and microbatches % pp:
                    continue  # the interleaved schedule runs micro-batches in groups of PP
                if sharding != "DDP" and dp * cp == 1:
                    continue
                for experts in _expert_layouts(arch, tp, tp * cp * dp, sharding == "FSDP2", recompute):
                    found.append((arch, base.replace(**experts, **_layout_fields(
                        tp, pp, cp, dp, vpp, mbs, sharding, recompute))))
    return found


def _expert_layouts(arch, tp: int, stage_ranks: int, fsdp2: bool, recompute) -> list:
    """{ep, etp, moe_layer_recompute} choices of a layout: one (nothing) for a dense model."""
    if not arch.is_moe:
        return [{}]
    choices = []
    for ep, etp in itertools.product(_divisors(arch.num_experts, stage_ranks), sorted({1, tp})):
        try:
            check_expert_layout(num_experts=arch.num_experts, expert_ffn=arch.moe_ffn_hidden_size, tp=tp, ep=ep,
                                etp=etp, stage_ranks=stage_ranks, sequence_parallel=True, fsdp2=fsdp2)
        except ConfigError:
            continue
        for moe_recompute in ((False, True) if recompute != "full" else (False,)):
            choices.append(dict(ep=ep, etp=etp, moe_layer_recompute=moe_recompute))
    return choices


def _layout_fields(tp, pp, cp, dp, vpp, mbs, sharding, recompute) -> dict:
    return dict(
        tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, micro_batch_size=mbs, sequence_parallel=tp > 1,
        distributed_optimizer=sharding == "distributed optimizer", fsdp2=sharding == "FSDP2",
        overlap_grad_reduce=sharding == "distributed optimizer",
        overlap_param_gather=sharding == "distributed optimizer",
        recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None, split=PipelineSplit())


def search(arch_for_tp: Callable, base: Layout, cluster: Cluster, top: int, margin: float = MARGIN) -> tuple:
    """(the `top` plans that fit, best first by predicted tokens/s; how many layouts were tried)."""
    candidates = candidate_layouts(arch_for_tp, base, cluster)
    fitting = []
    for arch, layout in candidates:
        plan = make_plan(arch, layout, cluster, margin)
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=lambda p: (-p.time.tokens_per_second, p.worst.total))  # ties: the smaller footprint
    return fitting[:top], len(candidates)


def format_table(plans: list, tried: int, cluster: Cluster) -> str:
    moe = any(plan.arch.is_moe for plan in plans)
    header = (f"{'rank':>4} {'TP':>3} {'PP':>3} {'VPP':>3} {'CP':>3} {'DP':>5} "
              + (f"{'EP':>3} {'ETP':>3} " if moe else "") + f"{'MBS':>3}  {'sharding':21s} "
              f"{'recompute':13s} {'memory GiB':>10} {'step ms':>9} {'tokens/s/GPU':>12} {'MFU':>6}")
    lines = [f"layouts of {cluster.world_size} {cluster.gpu.name} GPUs ({cluster.nodes} x {cluster.gpus_per_node}) "
             f"that fit, by predicted tokens/s ({len(plans)} shown of {tried} tried):", header]
    for rank, plan in enumerate(plans, 1):
        lay = plan.layout
        sharding = "FSDP2" if lay.fsdp2 else ("distributed optimizer" if lay.distributed_optimizer else "DDP")
        recompute = str(lay.recompute_granularity or ("moe" if lay.moe_layer_recompute else "none"))
        if lay.moe_layer_recompute and lay.recompute_granularity:
            recompute += "+moe"
        lines.append(f"{rank:>4} {lay.tp:>3} {lay.pp:>3} {lay.vpp:>3} {lay.cp:>3} {lay.dp:>5} "
                     + (f"{lay.ep:>3} {lay.etp:>3} " if moe else "") + f"{lay.micro_batch_size:>3}  "
                     f"{sharding:21s} {recompute:13s} "
                     f"{plan.worst.total / 2 ** 30:>10.1f} {plan.time.seconds * 1e3:>9.0f} "
                     f"{plan.time.tokens_per_second_per_gpu:>12,.0f} {plan.time.mfu:>6.1%}")
    if not plans:
        lines.append("  none fits: more GPUs, a shorter sequence or a smaller model")
    return "\n".join(lines)
