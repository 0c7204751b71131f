"""The start-up line naming which implementation of each speed-critical path this run uses.

    > fast paths: compile: on | weight-gradient GEMM: one GEMM into fp32 main_grad | cross entropy:
      fused, chunked, compiled | attention: auto -> flash (...) | FP8: off | optimizer: fused AdamW,
      clipping in its kernel

With --num-experts the FP8 part also names the experts' FP8 GEMMs: grouped (torch._scaled_grouped_mm)
or a loop of torch._scaled_mm.

Each part says what runs, not what was asked for: the weight-gradient GEMM's fp32-output kernel is
probed on the device (the CPU has none), so is FP8's (`_scaled_mm` writing into the fp32 main_grad),
the attention part is the kernel the start-up probe chose, and the FP8 part names the linears a
start-up probe left in bf16 because their GEMMs ran slower in FP8. bench/bench_pretrain.py prints the
line and bench/gpu_report.py records it per run.
"""
import importlib.util

import torch

from megatron.core.tensor_parallel.layers import _mixed_dtype_addmm_works
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.fp8 import writes_into
from megatron.core.transformer.moe.fp8_experts import grouped_fp8_supported


def _compile(execution: ExecutionConfig, no_torch_compile: bool, device) -> str:
    if execution.fuse_elementwise:
        return "on (norms, RoPE, SwiGLU, loss chunks, FP8 casts)"
    if no_torch_compile:
        return "off (--no-torch-compile)"
    if device.type == "cpu":
        return "off (CPU)"
    return "off (Triton not installed)" if importlib.util.find_spec("triton") is None else "off"


def _weight_gradient(execution: ExecutionConfig, device) -> str:
    if not execution.gradient_accumulation_fusion:
        return "off: bf16 gradient, then added to main_grad (--no-gradient-accumulation-fusion or FSDP2)"
    if execution.params_dtype.is_floating_point and execution.params_dtype.itemsize == 4:
        return "one fp32 GEMM accumulating into main_grad"
    if _mixed_dtype_addmm_works(device):
        return "one GEMM with fp32 output accumulating into main_grad"
    return f"product in {str(execution.params_dtype).removeprefix('torch.')}, then added to main_grad " \
           f"(no fp32-output GEMM on {device.type})"


def _experts_weight_gradient(execution: ExecutionConfig, num_experts) -> str:
    if not num_experts or not execution.gradient_accumulation_fusion or execution.fp8:
        return ""
    if execution.moe_grouped_wgrad == "triton":
        return "; experts: a Triton grouped GEMM adding into main_grad"
    if execution.moe_grouped_wgrad == "per-expert":
        return "; experts: a GEMM per expert accumulating into main_grad (counts copied to the host without waiting)"
    compiled = "compiled" if execution.fuse_elementwise else "eager, two passes"
    return f"; experts: a grouped GEMM product added into main_grad ({compiled})"


def _cross_entropy(execution: ExecutionConfig) -> str:
    if not execution.cross_entropy_loss_fusion:
        return "plain, fp32 copy of the logits (--no-cross-entropy-loss-fusion)"
    return "fused, chunked, one-pass backward" + (", compiled" if execution.fuse_elementwise else ", eager")


def _fp8(execution: ExecutionConfig, num_experts, device, fp8_choice: str = "") -> str:
    if not execution.fp8:
        return "off"
    per_axis = execution.fp8_recipe in ("rowwise", "blockwise")
    once = "cast per GEMM axis" if per_axis else "each tensor cast once"
    if not execution.gradient_accumulation_fusion:
        wgrad = "weight gradient added to main_grad by the gradient hook"
    elif execution.fp8_recipe == "blockwise":
        wgrad = "weight-gradient GEMM product added to main_grad (the block-scaled GEMM has no output argument)"
    elif writes_into(torch.empty(0, device=device), execution.fp8_recipe == "rowwise"):
        wgrad = "weight-gradient GEMM writes into fp32 main_grad on a step's first micro-batch"
    else:
        wgrad = f"weight-gradient GEMM product added to main_grad (no fp32-output FP8 GEMM on {device.type})"
    padding = "routing padded to 16" if execution.moe_router_padding_for_fp8 else "rows padded to 16"
    experts = f"; experts: per-expert scales, {padding}, {_fp8_experts_gemms(execution, device)}" \
        if num_experts else ""
    if num_experts and _fp8_wgrad_choice(execution, "triton"):
        experts += ", weight gradients added into main_grad by a Triton grouped GEMM from the casts"
    chosen = f"; {fp8_choice}" if fp8_choice else ""
    return f"{execution.fp8} {execution.fp8_recipe}, {once}, {wgrad}{experts}{chosen}"


def _fp8_wgrad_choice(execution: ExecutionConfig, choice: str) -> bool:
    """--moe-grouped-wgrad `choice` where FP8 experts take it: the grouped path (padded routing,
    tensorwise or delayed) with the weight gradients fused into main_grad."""
    return (execution.moe_grouped_wgrad == choice and execution.gradient_accumulation_fusion
            and execution.moe_router_padding_for_fp8 and execution.fp8_recipe in ("tensorwise", "delayed"))


def _fp8_experts_gemms(execution: ExecutionConfig, device) -> str:
    probe = torch.empty(0, device=device, dtype=execution.params_dtype)
    per_expert = ("; gradient GEMMs per expert (torch._scaled_mm of the casts, counts copied to the host "
                  "without waiting)") if _fp8_wgrad_choice(execution, "per-expert") else ""
    if not grouped_fp8_supported(probe, execution.fp8_recipe == "rowwise"):
        if execution.moe_router_padding_for_fp8 and execution.fp8_recipe in ("tensorwise", "delayed"):
            return f"one grouped GEMM of the dequantized casts (no FP8 grouped GEMM on {device.type}){per_expert}"
        return "a loop of GEMMs"
    if per_expert:
        return f"grouped GEMMs (E4M3) forward{per_expert}"
    if execution.fp8 == "hybrid" and _fp8_wgrad_choice(execution, "triton"):
        return "grouped GEMMs (E4M3) and Triton FP8 grouped GEMMs for the E5M2 gradients"
    if execution.fp8 == "hybrid":
        return "grouped GEMMs (E4M3) and bf16 grouped GEMMs of the widened casts for the E5M2 gradients"
    return "grouped GEMMs"


def _optimizer(optimizer) -> str:
    groups = optimizer.param_groups
    if groups and all(group.get("fused") for group in groups):
        return "fused AdamW, clipping in its kernel"
    return f"{type(optimizer.optimizer).__name__}, clipping a pass of its own"


def fast_paths_line(execution: ExecutionConfig, *, no_torch_compile: bool, device, attention_report: str,
                    optimizer, num_experts=None, fp8_choice: str = "", wgrad_choice: str = "") -> str:
    """`fp8_choice`: the linears the start-up probe left in bf16 (`fp8.choose_fp8_linears`);
    `wgrad_choice`: the experts' weight-gradient path --moe-grouped-wgrad auto chose and its times
    (`wgrad_choice.choose_expert_wgrad`)."""
    chosen = f" [{wgrad_choice}]" if wgrad_choice else ""
    parts = {
        "compile": _compile(execution, no_torch_compile, device),
        "weight-gradient GEMM": (_weight_gradient(execution, device) + _experts_weight_gradient(execution, num_experts)
                                 + (chosen if not execution.fp8 else "")),
        "cross entropy": _cross_entropy(execution),
        "attention": attention_report.removeprefix("attention: "),
        "FP8": _fp8(execution, num_experts, device, fp8_choice) + (chosen if execution.fp8 else ""),
        "optimizer": _optimizer(optimizer),
    }
    return "fast paths: " + " | ".join(f"{name}: {value}" for name, value in parts.items())
