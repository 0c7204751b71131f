"""The contract of a model chunk wrapped for data parallelism, which the training loop, the pipeline
schedules and the optimizer use: DDP (`ddp.DistributedDataParallel`) and FSDP2
(`fsdp.FullyShardedDataParallel`) both are one."""
import contextlib

import torch


class ModelChunk(torch.nn.Module):
    """A wrapped model chunk: `module` (a GPTModel stage), its process `groups`, and the hooks around
    a step. The defaults are for a wrapper that reduces gradients during backward by itself."""

    def __init__(self, module: torch.nn.Module, groups):
        super().__init__()
        self.module = module
        self.groups = groups

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        """The activation received from the previous pipeline stage."""
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside this block only accumulate gradients (where the wrapper can defer the
        reduction)."""
        yield

    def zero_grad_buffer(self) -> None:
        raise NotImplementedError

    def start_grad_sync(self) -> None:
        """Starts the gradient reductions not yet started (after the last micro-batch's backward)."""

    def finish_grad_sync(self) -> None:
        """Waits for the gradient reductions; the gradients are then the data-parallel average."""

    def finish_param_sync(self) -> None:
        """Waits for parameter gathers still in flight (before parameters are read outside a forward)."""
