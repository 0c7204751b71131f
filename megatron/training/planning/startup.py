"""The planner at start-up: `--dry-run` prints the plan for the target cluster (never this
machine), and a real run stops before allocating when its weights, gradients and optimizer state
alone exceed the free memory of its own device."""
import os

from megatron.training.planning.architecture import architecture
from megatron.training.planning.hardware import PRESETS, cluster
from megatron.training.planning.layout import layout_from_config
from megatron.training.planning.memory import GIB, memory_per_stage
from megatron.training.planning.plan import format_plan, plan_for_flags, reducing_flags

PERSISTENT = ("weights", "gradients", "optimizer state", "FP8 weight copies", "expert weights", "expert gradients",
              "expert optimizer state", "expert FP8 weight copies")


def dry_run_cluster(config, world_size: int):
    """The cluster --dry-run plans for: --dry-run-gpu's preset, LOCAL_WORLD_SIZE GPUs per node (the
    launchers set it; else the preset's), as many nodes as WORLD_SIZE needs."""
    preset = PRESETS[config.training.dry_run_gpu]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or preset.gpus_per_node
    per_node = min(per_node, world_size)
    return cluster(config.training.dry_run_gpu, nodes=-(-world_size // per_node), gpus_per_node=per_node)


def print_dry_run_plan(config, vocab_size: int, world_size: int, error) -> None:
    """Prints the plan; raises `error` (the caller's exception type) when it does not fit."""
    plan = plan_for_flags(config, vocab_size, world_size, dry_run_cluster(config, world_size))
    print(format_plan(plan), flush=True)
    if plan.worst.total > plan.cluster.gpu.memory_bytes:
        raise error(f"the plan {plan.verdict()}; reduce it with " + ", ".join(reducing_flags(plan))
                    + " (python tools/plan.py with the same flags and --top 5 ranks the layouts that fit)")
    if not plan.fits:
        print(f"NOTE: {plan.verdict()}", flush=True)


def persistent_bytes(config, model_config, world_size: int) -> float:
    """Weights, gradients and optimizer state of the largest pipeline stage on one GPU."""
    lay = layout_from_config(config, model_config, world_size)
    stages = memory_per_stage(architecture(model_config), lay)
    return max(sum(v for k, v in s.terms.items() if k in PERSISTENT) for s in stages)


def check_device_fits(estimate: float, available: float, where: str, hints: list, processes: int = 1) -> None:
    """Raises ValueError with the estimate and the flags that reduce it (`hints`) when `processes`
    processes of `estimate` bytes each do not fit in `available` bytes of `where`."""
    if estimate * processes <= available:
        return
    share = f"{processes} processes x {estimate / GIB:.3f} GiB" if processes > 1 else f"{estimate / GIB:.3f} GiB"
    raise ValueError(f"the model does not fit: {share} of parameters, gradients and optimizer state (before "
                     f"activations), but {where} has {available / GIB:.3f} GiB free; reduce it with "
                     + ", ".join(hints))


def persistent_hints(config) -> list:
    """The flags that would shrink the weights, gradients and optimizer state."""
    p, t = config.parallel, config.training
    hints = ["--tensor-model-parallel-size or --pipeline-model-parallel-size (split the model over more GPUs)"]
    if not (p.use_distributed_optimizer or p.use_torch_fsdp2):
        hints.append("--use-distributed-optimizer or --use-torch-fsdp2 (shard the optimizer state over the "
                     "data-parallel ranks)")
    if not (t.bf16 or t.fp16):
        hints.append("--bf16 (halves the parameters)")
    return hints + ["a smaller model"]
