"""Out of memory during training: the start-up estimate next to the measured peak, and the flags
that reduce memory, instead of a bare allocator traceback."""
from typing import Callable

import torch

from megatron.core import utils
from megatron.training.errors import DeviceOutOfMemory
from megatron.training.memory import theoretical_bytes

_GIB = 1024 ** 3
_CPU_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in _CPU_MESSAGES))


def memory_flags(config, groups) -> list:
    """The flags that would reduce this run's memory, given what it already uses."""
    t, p = config.training, config.parallel
    flags = []
    if t.recompute_granularity is None:
        flags.append("--recompute-granularity selective (attention), or full with --recompute-method uniform "
                     "--recompute-num-layers 1 (activations)")
    elif t.recompute_granularity == "selective":
        flags.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 (activations)")
    if t.micro_batch_size > 1:
        flags.append(f"--micro-batch-size {t.micro_batch_size // 2} (same --global-batch-size: more micro-batches; "
                     "activations)")
    flags.append(f"--tensor-model-parallel-size {2 * groups.tp_size}" + ("" if p.sequence_parallel else
                 " with --sequence-parallel") + " (weights and activations)")
    flags.append(f"--pipeline-model-parallel-size {2 * groups.pp_size} (weights; activations of fewer layers)")
    if not (p.use_distributed_optimizer or p.use_torch_fsdp2) and groups.dp_size * groups.cp_size > 1:
        flags.append("--use-distributed-optimizer (optimizer state sharded over data-parallel ranks), or "
                     "--use-torch-fsdp2 (weights and gradients too)")
    return flags


def out_of_memory_message(error: BaseException, config, groups, chunks: list, optimizer, iteration: int) -> str:
    """The error's first line, the start-up estimate of `chunks` and `optimizer` beside the measured
    peak, and the flags that would reduce memory."""
    figures = theoretical_bytes(chunks, optimizer)
    estimate = figures["parameters"] + figures["gradients"] + figures["optimizer_state"]
    peak = utils.peak_memory_bytes(groups.device)
    capacity = utils.memory_capacity_bytes(groups.device)
    text = str(error).strip()
    first_line = text[text.index("DefaultCPUAllocator: "):] if "DefaultCPUAllocator: " in text else text.split("\n")[0]
    return (f"out of memory on rank {groups.global_rank} ({groups.device}) with {iteration} iterations completed: "
            f"{first_line[:200]}\n"
            f"  start-up estimate: {estimate / _GIB:.3f} GiB (parameters {figures['parameters'] / _GIB:.3f}, gradients "
            f"{figures['gradients'] / _GIB:.3f}, optimizer state {figures['optimizer_state'] / _GIB:.3f}; activations "
            f"not included)\n"
            f"  measured peak: {peak / _GIB:.2f} GiB of {capacity / _GIB:.2f} GiB (the excess over the estimate is "
            f"activations and temporary buffers)\n"
            f"  to use less memory: " + "; ".join(memory_flags(config, groups)))


class MemoryWatch:
    """Turns an out-of-memory error inside its `with` block into `DeviceOutOfMemory`."""

    def __init__(self, config, groups, chunks: list, optimizer, iteration: Callable[[], int]):
        self.config = config
        self.groups = groups
        self.chunks = chunks
        self.optimizer = optimizer
        self.iteration = iteration

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not is_out_of_memory(error):
            return False
        raise DeviceOutOfMemory(out_of_memory_message(error, self.config, self.groups, self.chunks, self.optimizer,
                                                     self.iteration())) from error
