"""The start-up line names the implementation that runs on this device, not the one asked for."""
import dataclasses

import torch

from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.layers import _mixed_dtype_addmm_works
from megatron.training.reporting.fast_paths import fast_paths_line
from tests.distributed.parity import llama_config, split_overrides

CPU = torch.device("cpu")


def _line(optimizer_name="adam", **overrides):
    architecture, execution = split_overrides(overrides)
    config = llama_config(**architecture)
    groups = single_process()
    model = GPTModel(config, groups, execution=execution)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer=optimizer_name, bf16=True),
                                       [DistributedDataParallel(model, groups)], groups)
    return fast_paths_line(execution, no_torch_compile=False, device=CPU,
                           attention_report="attention: SDPA, kernel chosen by PyTorch (CPU)", optimizer=optimizer)


def test_the_line_names_what_runs_on_the_cpu():
    line = _line(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="delayed")
    parts = dict(part.split(": ", 1) for part in line.removeprefix("fast paths: ").split(" | "))
    assert list(parts) == ["compile", "weight-gradient GEMM", "cross entropy", "attention", "FP8", "optimizer"]
    assert parts["compile"] == "off (CPU)"
    # The CPU has no GEMM with an fp32 output from bf16 operands: the line follows the probe.
    assert not _mixed_dtype_addmm_works(CPU)
    assert parts["weight-gradient GEMM"] == "product in bfloat16, then added to main_grad (no fp32-output GEMM on cpu)"
    assert parts["cross entropy"] == "fused, chunked, one-pass backward, eager"
    assert parts["attention"] == "SDPA, kernel chosen by PyTorch (CPU)"
    # torch._scaled_mm writes an fp32 output on the CPU (and with tensorwise scaling on every GPU).
    assert parts["FP8"] == ("hybrid delayed, each tensor cast once, "
                            "weight-gradient GEMM writes into fp32 main_grad on a step's first micro-batch")
    assert parts["optimizer"] == "fused AdamW, clipping in its kernel"


def test_switched_off_paths_say_so():
    line = _line("sgd", gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False)
    assert "weight-gradient GEMM: off: bf16 gradient, then added to main_grad" in line
    assert "cross entropy: plain, fp32 copy of the logits (--no-cross-entropy-loss-fusion)" in line
    assert "FP8: off" in line and "optimizer: SGD, clipping a pass of its own" in line
    assert "weight-gradient GEMM: one fp32 GEMM" in _line(params_dtype=torch.float32)


def test_the_fp8_part_names_the_experts_path():
    from megatron.core.transformer.config import ExecutionConfig

    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise")
    model = GPTModel(llama_config(), single_process(), execution=execution)
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True), [DistributedDataParallel(model, single_process())],
                                       single_process())
    line = fast_paths_line(execution, no_torch_compile=False, device=CPU, attention_report="attention: SDPA",
                           optimizer=optimizer, num_experts=8)
    assert "FP8: hybrid tensorwise, each tensor cast once, weight-gradient GEMM writes into fp32 main_grad on a " \
           "step's first micro-batch; experts: per-expert scales, rows padded to 16, a loop of GEMMs" in line
    assert "experts" not in _line(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise")
    padded = dataclasses.replace(execution, moe_router_padding_for_fp8=True)
    line = fast_paths_line(padded, no_torch_compile=False, device=CPU, attention_report="attention: SDPA",
                           optimizer=optimizer, num_experts=8)
    assert "experts: per-expert scales, routing padded to 16, one grouped GEMM of the dequantized casts " \
           "(no FP8 grouped GEMM on cpu)" in line


def test_the_weight_gradient_part_names_the_experts_path():
    from megatron.core.transformer.config import ExecutionConfig

    execution = ExecutionConfig(params_dtype=torch.bfloat16)
    model = GPTModel(llama_config(), single_process(), execution=execution)
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True), [DistributedDataParallel(model, single_process())],
                                       single_process())

    def part(execution, num_experts=8):
        line = fast_paths_line(execution, no_torch_compile=False, device=CPU, attention_report="attention: SDPA",
                               optimizer=optimizer, num_experts=num_experts)
        return dict(p.split(": ", 1) for p in line.removeprefix("fast paths: ").split(" | "))["weight-gradient GEMM"]

    assert part(execution).endswith("; experts: a grouped GEMM product added into main_grad (eager, two passes)")
    compiled = dataclasses.replace(execution, fuse_elementwise=True)
    assert part(compiled).endswith("; experts: a grouped GEMM product added into main_grad (compiled)")
    triton = dataclasses.replace(execution, moe_grouped_wgrad="triton")
    assert part(triton).endswith("; experts: a Triton grouped GEMM adding into main_grad")
    per_expert = dataclasses.replace(execution, moe_grouped_wgrad="per-expert")
    assert part(per_expert).endswith("; experts: a GEMM per expert accumulating into main_grad (counts copied "
                                     "to the host without waiting)")
    assert "experts" not in part(execution, num_experts=None)
    assert "experts" not in part(dataclasses.replace(execution, gradient_accumulation_fusion=False))


def test_the_fp8_part_names_the_triton_weight_gradients():
    from megatron.core.transformer.config import ExecutionConfig

    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise",
                                moe_router_padding_for_fp8=True, moe_grouped_wgrad="triton")
    model = GPTModel(llama_config(), single_process(), execution=execution)
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True), [DistributedDataParallel(model, single_process())],
                                       single_process())
    line = fast_paths_line(execution, no_torch_compile=False, device=CPU, attention_report="attention: SDPA",
                           optimizer=optimizer, num_experts=8)
    assert line.endswith("weight gradients added into main_grad by a Triton grouped GEMM from the casts | "
                         "optimizer: fused AdamW, clipping in its kernel")
    # On a GPU with the FP8 grouped kernel: hybrid's E5M2 gradients by the Triton kernels, else widened.
    import megatron.training.reporting.fast_paths as fast_paths
    original = fast_paths.grouped_fp8_supported
    try:
        fast_paths.grouped_fp8_supported = lambda probe, rowwise: True
        assert "grouped GEMMs (E4M3) and Triton FP8 grouped GEMMs for the E5M2 gradients" in fast_paths_line(
            execution, no_torch_compile=False, device=CPU, attention_report="SDPA", optimizer=optimizer, num_experts=8)
        assert "bf16 grouped GEMMs of the widened casts" in fast_paths_line(
            dataclasses.replace(execution, moe_grouped_wgrad="grouped-mm"), no_torch_compile=False, device=CPU,
            attention_report="SDPA", optimizer=optimizer, num_experts=8)
    finally:
        fast_paths.grouped_fp8_supported = original
    per_expert = dataclasses.replace(execution, moe_grouped_wgrad="per-expert")
    line = fast_paths_line(per_expert, no_torch_compile=False, device=CPU, attention_report="SDPA",
                           optimizer=optimizer, num_experts=8)
    assert ("one grouped GEMM of the dequantized casts (no FP8 grouped GEMM on cpu); gradient GEMMs per expert "
            "(torch._scaled_mm of the casts, counts copied to the host without waiting)") in line
    try:
        fast_paths.grouped_fp8_supported = lambda probe, rowwise: True
        assert "grouped GEMMs (E4M3) forward; gradient GEMMs per expert (torch._scaled_mm" in fast_paths_line(
            per_expert, no_torch_compile=False, device=CPU, attention_report="SDPA", optimizer=optimizer,
            num_experts=8)
    finally:
        fast_paths.grouped_fp8_supported = original
    rowwise = dataclasses.replace(execution, fp8_recipe="rowwise")
    assert "Triton" not in fast_paths_line(rowwise, no_torch_compile=False, device=CPU, attention_report="SDPA",
                                           optimizer=optimizer, num_experts=8)
