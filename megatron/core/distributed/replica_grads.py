"""Summing gradients over the tensor-parallel ranks that replicate a slice of a parameter, for many
parameters in one all-reduce. It reads only each parameter's layout (`TPLayout`: its parts, their
shards and replicas), so data parallelism's `finalize_model_grads` calls it without depending on
the tensor-parallel layers."""
import torch

from megatron.core.distributed import comm


def all_reduce_partial_replica_grads(layouts_and_grads: list, group) -> None:
    """`TPLayout.sum_partial_replica_grads` for many (layout, grad) pairs with one all-reduce per
    gradient dtype instead of one per part (sequence-parallel norms and biases, replicated key/value
    heads). A part replicated on every rank is summed as is; a part whose slices are each replicated
    on a subset of ranks is placed in a zeroed full-size tensor at its slice's offset, so one sum over
    the whole group adds exactly the replicas of each slice."""
    pieces = []  # (local view, payload summed over the group, (dim, start, length) within the payload or None)
    for layout, grad in layouts_and_grads:
        for part, offset, length in layout.local_offsets():
            if not part.sum_replica_grads or layout.replicas(part) == 1:
                continue
            local = grad.narrow(layout.dim, offset, length)
            if part.num_shards == 1:
                pieces.append((local, local, None))
                continue
            start, _ = layout.local_range(part)
            shape = list(local.shape)
            shape[layout.dim] = part.full_size
            slots = local.new_zeros(shape)
            slots.narrow(layout.dim, start, length).copy_(local)
            pieces.append((local, slots, (layout.dim, start, length)))
    for dtype in dict.fromkeys(local.dtype for local, _, _ in pieces):
        same = [piece for piece in pieces if piece[0].dtype == dtype]
        flat = torch.cat([payload.reshape(-1) for _, payload, _ in same])
        comm.all_reduce(flat, group)
        offset = 0
        for local, payload, where in same:
            reduced = flat[offset:offset + payload.numel()].view(payload.shape)
            offset += payload.numel()
            local.copy_(reduced if where is None else reduced.narrow(*where))
