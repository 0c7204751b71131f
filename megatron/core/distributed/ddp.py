"""Data parallelism: gradients accumulate into one contiguous fp32 buffer, reduced over data ranks.

Every parameter that trains gets `param.main_grad`, a view into the buffer. A hook run after
autograd accumulates `param.grad` adds it to `main_grad` and frees `param.grad`, so gradient
accumulation over micro-batches happens in fp32 whatever the parameter dtype. After the last
micro-batch, `finish_grad_sync` averages the buffer over the data-parallel (x context-parallel)
group in one collective.
"""
import contextlib

import torch

from megatron.core.distributed import comm
from megatron.core.parallel_state import ParallelGroups


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, groups: ParallelGroups, *, grad_dtype=torch.float32):
        super().__init__()
        self.module = module
        self.groups = groups
        self.params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else groups.device
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        offset = 0
        for param in self.params:
            param.main_grad = self.grad_buffer[offset: offset + param.numel()].view(param.shape)
            offset += param.numel()
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside this block only accumulate (the reduction happens once, at the end)."""
        yield

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()

    def start_grad_sync(self) -> None:
        """Hook for overlapped reduction; the reduction here is issued in `finish_grad_sync`."""

    def finish_grad_sync(self) -> None:
        if self.groups.dp_cp_size > 1:
            self.grad_buffer.div_(self.groups.dp_cp_size)
            comm.all_reduce(self.grad_buffer, self.groups.dp_cp)


def _accumulate_into_main_grad(param: torch.nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def finalize_model_grads(model_chunks: list, groups: ParallelGroups) -> None:
    """After the last backward of a step: data-parallel reduction, then the tensor-parallel sums of
    partial replica gradients (sequence-parallel norms, replicated key/value heads), then the tied
    embedding copies across the first and last pipeline stages."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if groups.tp_size > 1:
        for chunk in model_chunks:
            for param in chunk.module.parameters():
                if param.requires_grad:
                    param.tp_layout.sum_partial_replica_grads(param.main_grad, groups.tp)
    _sync_tied_embeddings(model_chunks, groups)


def _sync_tied_embeddings(model_chunks: list, groups: ParallelGroups) -> None:
    if groups.embedding is None:
        return
    for chunk in model_chunks:
        for param in shared_embedding_params(chunk.module):
            comm.all_reduce(param.main_grad, groups.embedding)


def shared_embedding_params(module: torch.nn.Module) -> list:
    """The tied word-embedding parameter(s) held by this stage, first or last (empty if untied)."""
    model = module
    found = []
    if getattr(model, "share_embeddings", False):
        if getattr(model, "pre_process", False):
            found.append(model.embedding.word_embeddings.weight)
        elif getattr(model, "post_process", False):
            found.append(model.output_layer)
    return found
