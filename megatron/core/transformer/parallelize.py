"""How a built model runs: FP8, compiled elementwise kernels and activation recomputation, applied
from outside the layers, here and nowhere else.

Tensor, sequence, context and pipeline parallelism are built into the layers (they take their
process groups); what this module applies only changes how the same computation runs. The layers
declare what it may change, and decide nothing themselves:

- FP8: every `ColumnParallelLinear` / `RowParallelLinear` has an `fp8` slot, and the routed
  experts an `attach_fp8` method (`fp8.attach_fp8` fills them for the FP8 layers).
- compile: a module's `compilable` maps an attribute to the `ExecutionConfig` switch that compiles
  it (a dotted path reaches a plain object the module holds, such as a token dispatcher). A
  function is replaced by its compiled version; a flag (the loss's) is turned on.
- recompute: a `TransformerBlock` runs its layers in `segments` (`recompute_segments`), and each
  attention module holds its `core_attention` as a submodule that selective recomputation wraps;
  a mixture-of-experts layer re-runs its MLP when `recompute_mlp` is set.
"""
from typing import Optional

from megatron.core.transformer.block import RecomputedCoreAttention, recompute_segments
from megatron.core.transformer.fp8 import DelayedScaling, attach_fp8
from megatron.core.utils import compiled


def parallelize(model, execution, *, device) -> Optional[DelayedScaling]:
    """Applies `execution`'s FP8, compile and recompute choices to `model` (a module with a
    `decoder` TransformerBlock), in this order; returns the FP8 delayed-scaling state the model's
    forward advances (None without it)."""
    # 1. FP8 first: it gives the linears their FP8 GEMMs (and casts, compiled with the elementwise
    #    fusions); what follows wraps whole modules and is indifferent to how their GEMMs run.
    scaling = attach_fp8(model.decoder, execution, model.config.num_layers, device) if execution.fp8 else None
    # 2. Compile the declared elementwise chains (norms, RoPE, SwiGLU, loss, MoE routing/permutation).
    compile_declared(model, execution)
    # 3. Recompute last: a re-run in backward replays the modules exactly as steps 1 and 2 left them.
    apply_recompute(model.decoder, execution)
    return scaling


def compile_declared(model, execution) -> None:
    """Compiles each attribute a module declares in `compilable`, when its switch is on; those it
    also names in `compiled_dynamic` (shapes that change between steps) with automatic dynamic shapes."""
    for module in model.modules():
        varying = getattr(module, "compiled_dynamic", ())
        for path, switch in getattr(module, "compilable", {}).items():
            if not getattr(execution, switch):
                continue
            *owners, name = path.split(".")
            owner = module
            for step in owners:
                owner = getattr(owner, step)
            value = getattr(owner, name)
            if value is not None:
                dynamic = None if path in varying else False
                setattr(owner, name, True if isinstance(value, bool) else compiled(value, dynamic))


def apply_recompute(block, execution) -> None:
    """--recompute-granularity full (uniform or block: whole layers re-run), selective (the
    attention core re-run) and --moe-layer-recompute (each MoE block re-run) on one block."""
    block.segments = recompute_segments(execution, len(block.layers))
    for layer in block.layers:
        if execution.recompute_granularity == "selective":
            attention = layer.self_attention
            attention.core_attention = RecomputedCoreAttention(attention.core_attention, block.rng_tracker)
        layer.recompute_mlp = layer.is_moe and execution.moe_layer_recompute
