"""FSDP2 (`--use-torch-fsdp2`): parameters, gradients and optimizer state sharded over data ranks
by PyTorch's `fully_shard`.

Each transformer layer is its own FSDP unit (gathered just before its forward and backward, freed
after), and the root unit holds the rest (embeddings, final norm, output layer). Parameters are
kept sharded in fp32; with --bf16/--fp16 they are gathered in that dtype for compute and gradients
are reduced in fp32 (`MixedPrecisionPolicy`). Sharding is over the data-parallel (x context-parallel)
group only: tensor parallelism stays inside the model, so with TP the layout is a 2-D mesh of
which FSDP uses the data-parallel dimension. Not combined with pipeline parallelism or the
distributed optimizer (see `ddp.validate_data_parallel`).

The wrapper offers the interface of `DistributedDataParallel` (zero_grad_buffer, no_sync,
finish_grad_sync, set_input_tensor, module). Gradients are the parameters' sharded `.grad`
(DTensors); `finish_grad_sync` adds the tensor-parallel sums of partial replica gradients on the
shards, which `finalize_model_grads` does for the DDP buffers.
"""
import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.distributed import comm
from megatron.core.parallel_state import ParallelGroups

_PARAM_ATTRIBUTES = ("tp_layout", "shared_embedding", "is_embedding_or_output_parameter")


def _data_parallel_mesh(groups: ParallelGroups):
    from torch.distributed.device_mesh import DeviceMesh

    group = groups.dp_cp
    if group is None:
        # FSDP needs a real group even for one data-parallel rank: a group of one per rank
        # (created by every rank, in the same order).
        for rank in range(dist.get_world_size()):
            singleton = dist.new_group([rank])
            if rank == dist.get_rank():
                group = singleton
    return DeviceMesh.from_group(group, groups.device.type, mesh_dim_names=("dp_cp",))


class FullyShardedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, groups: ParallelGroups, *, compute_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: torch.dtype = torch.float32):
        super().__init__()
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ValueError("--use-torch-fsdp2 needs torch.distributed: launch with torchrun")
        self.module = module
        self.groups = groups
        compute_dtype = compute_dtype or next(module.parameters()).dtype
        self.compute_dtype = compute_dtype
        attributes = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
                      for name, p in module.named_parameters()}
        module.to(torch.float32)  # sharded masters in fp32; compute in `compute_dtype`
        policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                      reduce_dtype=reduce_dtype)
        mesh = _data_parallel_mesh(groups)
        for layer in module.decoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        for name, param in module.named_parameters():
            for attribute, value in attributes[name].items():
                setattr(param, attribute, value)
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside this block accumulate unsharded gradients without reduce-scatter."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def zero_grad_buffer(self) -> None:
        for param in self.params:
            param.grad = None

    def start_grad_sync(self) -> None:
        """FSDP2 issues its reduce-scatters during backward."""

    def finish_grad_sync(self) -> None:
        """The reduce-scatters are complete when backward returns; sums the tensor-parallel partial
        replica gradients on this rank's shards."""
        if self.groups.tp_size == 1:
            return
        for param in self.params:
            if param.grad is not None:
                sum_partial_replica_shard(param, param.grad.to_local(), self.groups)

    def finish_param_sync(self) -> None:
        """Parameters are gathered by FSDP itself before each forward."""


def shard_row_start(param, groups: ParallelGroups) -> int:
    """First dim-0 row of this rank's FSDP shard (FSDP2 splits dim 0 like `torch.chunk`)."""
    rows = param.shape[0]
    per_rank = -(-rows // groups.dp_cp_size)
    return min(groups.dp_cp_rank * per_rank, rows)


def sum_partial_replica_shard(param, local_grad: torch.Tensor, groups: ParallelGroups) -> None:
    """`TPLayout.sum_partial_replica_grads` on a dim-0 shard of the gradient (rows
    [row_start, row_start + len)). Tensor-parallel peers hold the same rows of their local tensors."""
    layout = param.tp_layout
    if layout.dim != 0:
        layout.sum_partial_replica_grads(local_grad, groups.tp)
        return
    row_start = shard_row_start(param, groups)
    row_end = row_start + local_grad.shape[0]
    for part, offset, length in layout.local_offsets():
        if not part.sum_replica_grads or layout.replicas(part) == 1:
            continue
        lo, hi = max(offset, row_start), min(offset + length, row_end)
        if lo >= hi:
            continue
        local = local_grad[lo - row_start:hi - row_start]
        if part.num_shards == 1:
            reduced = local.contiguous()
            comm.all_reduce(reduced, groups.tp)
        else:
            start, _ = layout.local_range(part)
            slots = local.new_zeros((part.full_size, *local.shape[1:]))
            where = start + lo - offset
            slots[where:where + hi - lo].copy_(local)
            comm.all_reduce(slots, groups.tp)
            reduced = slots[where:where + hi - lo]
        local.copy_(reduced)
