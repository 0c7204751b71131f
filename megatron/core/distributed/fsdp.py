"""FSDP2 (`--use-torch-fsdp2`): parameters, gradients and optimizer state sharded over data ranks
by PyTorch's `fully_shard`.

Each transformer layer is its own FSDP unit (gathered just before its forward and backward, freed
after), and the root unit holds the rest (embeddings, final norm, output layer). Parameters are
kept sharded in fp32 (the masters the optimizer steps in place); with --bf16/--fp16 they are
gathered in that dtype for compute, and gradients are reduce-scattered in fp32, or in bf16 with
`--grad-reduce-in-bf16` (`MixedPrecisionPolicy`). Sharding is over the data-parallel
(x context-parallel) group only: tensor parallelism stays inside the model, so with TP the layout
is a 2-D mesh of which FSDP uses the data-parallel dimension. Each pipeline model chunk is wrapped
on its own. Not combined with the distributed optimizer (see `ddp.validate_data_parallel`).

Start-up never holds the whole model on one device: a model built on the meta device is sharded,
each rank allocates only its fp32 shards, and fills them with its rows of the same
layout-independent initial values as the unsharded model (generated one parameter at a time, in
the model's dtype, as `GPTModel.initialize_parameters` does), so any layout starts from the
single-process weights. A model already on a real device is sharded as it is.

Gradient accumulation: every micro-batch's backward reduce-scatters into the fp32 gradient shards
(`no_sync` does not suspend it), so no unsharded gradient is held between micro-batches.

The wrapper offers the interface of `DistributedDataParallel` (zero_grad_buffer, no_sync,
finish_grad_sync, set_input_tensor, module). Gradients are the parameters' sharded `.grad`
(DTensors); `finish_grad_sync` adds the tensor-parallel sums of partial replica gradients on the
shards, which `finalize_model_grads` does for the DDP buffers.
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.distributed import comm
from megatron.core.distributed.chunk import ModelChunk
from megatron.core.parallel_state import ParallelGroups

_PARAM_ATTRIBUTES = ("tp_layout", "shared_embedding", "init", "is_embedding_or_output_parameter")


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


class FullyShardedDataParallel(ModelChunk):
    def __init__(self, module: torch.nn.Module, groups: ParallelGroups, *, compute_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: torch.dtype = torch.float32, init_seed: Optional[int] = None):
        """`module`: a GPTModel, on the meta device (then `init_seed` gives its initial values) or
        already initialized. `reduce_dtype`: the dtype of the gradient reduce-scatter."""
        super().__init__(module, groups)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ValueError("`use_torch_fsdp2` needs torch.distributed: launch with torchrun")
        on_meta = any(p.is_meta for p in module.parameters())
        if on_meta and init_seed is None:
            raise ValueError("a model built on the meta device needs init_seed to be initialized")
        compute_dtype = compute_dtype or next(module.parameters()).dtype
        self.compute_dtype = compute_dtype
        attributes = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
                      for name, p in module.named_parameters()}
        module.to(torch.float32)  # sharded masters in fp32 (no memory yet on the meta device)
        policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                      reduce_dtype=reduce_dtype)
        mesh = _data_parallel_mesh(groups)
        for layer in module.decoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        if on_meta:
            module.to_empty(device=groups.device)
        for name, param in module.named_parameters():  # sharding (and to_empty) made new parameters
            for attribute, value in attributes[name].items():
                setattr(param, attribute, value)
        if on_meta:
            self._initialize_shards(init_seed, compute_dtype)
        self.params = [p for p in module.parameters() if p.requires_grad]

    @torch.no_grad()
    def _initialize_shards(self, seed: int, model_dtype: torch.dtype) -> None:
        """Each fp32 shard gets its rows of the parameter's initial value, rounded to the model's dtype
        as an unsharded model's would be. One parameter at a time, the only full-size temporary is the
        generated fp32 value of that parameter (the model's `initial_values(name, param, seed, device)`).
        Non-persistent buffers (rotary frequencies) are recomputed by their modules' `reset_buffers()`."""
        model = self.module
        for submodule in model.modules():
            if hasattr(submodule, "reset_buffers"):
                submodule.reset_buffers()
        for name, param in model.named_parameters():
            full = model.initial_values(name, param, seed, self.groups.device)
            local = param.to_local()
            rows = _local_rows(full, param.tp_layout, shard_row_start(param, self.groups), local.shape[0])
            local.copy_(rows.to(model_dtype))

    # no_sync: gradient reduction is not suspended (ModelChunk's): each micro-batch's backward
    # reduce-scatters into the fp32 gradient shards, so no unsharded gradient is held from one
    # micro-batch to the next.
    def zero_grad_buffer(self) -> None:
        for param in self.params:
            param.grad = None

    def finish_grad_sync(self) -> None:
        """The reduce-scatters are complete when backward returns; sums the tensor-parallel partial
        replica gradients on this rank's shards."""
        if self.groups.tp_size == 1:
            return
        for param in self.params:
            if param.grad is not None:
                sum_partial_replica_shard(param, param.grad.to_local(), self.groups)


def _local_rows(full: dict, layout, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of this tensor-parallel rank's slice of the full logical tensors
    (`TPLayout.full_to_local` restricted to those rows, without building the whole slice)."""
    if layout.dim != 0:
        pieces = [full[part.name].narrow(layout.dim, *layout.local_range(part)) for part in layout.parts]
        local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=layout.dim)
        return local[start:start + count]
    pieces = []
    for part, offset, length in layout.local_offsets():
        lo, hi = max(offset, start), min(offset + length, start + count)
        if lo < hi:
            part_start, _ = layout.local_range(part)
            pieces.append(full[part.name].narrow(0, part_start + lo - offset, hi - lo))
    if not pieces:
        first = full[layout.parts[0].name]
        return first.new_empty((0, *first.shape[1:]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


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
