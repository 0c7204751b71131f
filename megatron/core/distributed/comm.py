"""Every collective the framework issues goes through this module.

Convention: a process group of `None` stands for a group of one rank, so every function here is a
no-op (or a copy) for it. This lets a model built for a single process run without
`torch.distributed` being initialized at all. (It never means the default world group.)

Gloo lacks some collectives on some PyTorch versions; each such case has a fallback built from
collectives gloo does have, chosen by backend, so every parallel feature runs on CPU.

`record_collectives(events)` appends an event when each data-parallel collective is issued and when
it has completed, so tests can check the order of communication against the computation.
"""
import contextlib
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

_events: Optional[list] = None  # set by record_collectives


@contextlib.contextmanager
def record_collectives(events: list):
    """While active, appends ("start", name, tensor) to `events` when `all_reduce`, `all_reduce_mean`,
    `all_gather_into_tensor`, `reduce_scatter_tensor` or `reduce_scatter_mean` is issued on a real
    group, and ("done", name, tensor) once it has completed (returned, or its handle's `wait()`
    returned). `tensor` is the buffer the collective fills (the input for a reduce-scatter)."""
    global _events
    previous, _events = _events, events
    try:
        yield events
    finally:
        _events = previous


def _traced(name: str, tensor: torch.Tensor, work):
    """`work` (a handle, or None for a completed call) with the trace events of `record_collectives`."""
    if _events is None:
        return work
    events = _events
    events.append(("start", name, tensor))
    if work is None:
        events.append(("done", name, tensor))
        return None
    return PendingWork(work, lambda: events.append(("done", name, tensor)))


# PyTorch 2.13 renamed the tensor collectives to *_single (the old names now warn on every rank);
# older versions have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce. Returns a work handle when async_op (None for a group of one)."""
    if group is None:
        return None
    if op == dist.ReduceOp.AVG and _is_gloo(group):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        tensor.div_(size(group))
        return _traced("all_reduce", tensor, None)
    return _traced("all_reduce", tensor, dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def all_reduce_max(tensor: torch.Tensor, group: Group) -> None:
    all_reduce(tensor, group, op=dist.ReduceOp.MAX)


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group: Group, async_op: bool = False):
    """Gathers equal-sized `input_` from every rank into `output` along dim 0."""
    if group is None:
        output.copy_(input_)
        return None
    work = _all_gather_single(output, input_.contiguous(), group=group, async_op=async_op)
    return _traced("all_gather_into_tensor", output, work)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, group: Group, async_op: bool = False):
    """Sums `input_` over ranks and leaves rank r's dim-0 chunk in `output`."""
    if group is None:
        output.copy_(input_)
        return None
    return _traced("reduce_scatter_tensor", input_, _reduce_scatter_sum(output, input_, group, async_op))


def _reduce_scatter_sum(output: torch.Tensor, input_: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    if _is_gloo(group):
        # Gloo: all-reduce the whole tensor and keep this rank's chunk. More traffic, same result.
        reduced = input_.contiguous().clone()
        work = dist.all_reduce(reduced, group=group, async_op=async_op)
        keep_chunk = lambda: output.copy_(reduced.chunk(size(group), dim=0)[rank(group)])  # noqa: E731
        return _finish_later(work, keep_chunk)
    return _reduce_scatter_single(output, input_.contiguous(), group=group, async_op=async_op)


class PendingWork:
    """A collective's work handle plus the local step that completes it (a copy, a division),
    run once by `wait()`. Lets the gloo fallbacks stay asynchronous."""

    def __init__(self, work, then):
        self._work = work
        self._then = then

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _finish_later(work, then):
    """Runs `then` now for a synchronous call (work None); otherwise defers it to `wait()`."""
    if work is None:
        then()
        return None
    return PendingWork(work, then)


def all_reduce_mean(tensor: torch.Tensor, group: Group, async_op: bool = False):
    """In-place average over `group` inside the collective (ReduceOp.AVG where the backend has it;
    on gloo a sum followed by a division). Returns a handle when async_op."""
    if group is None:
        return None
    if _is_gloo(group):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return _traced("all_reduce_mean", tensor, _finish_later(work, lambda: tensor.div_(size(group))))
    return _traced("all_reduce_mean", tensor,
                   dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=async_op))


def reduce_scatter_mean(output: torch.Tensor, input_: torch.Tensor, group: Group, async_op: bool = False):
    """`reduce_scatter_tensor` with the result divided by the group size (AVG in the collective
    where the backend has it)."""
    if group is None:
        output.copy_(input_)
        return None
    if _is_gloo(group):
        work = _reduce_scatter_sum(output, input_, group, async_op)
        return _traced("reduce_scatter_mean", input_, _finish_later(work, lambda: output.div_(size(group))))
    return _traced("reduce_scatter_mean", input_, _reduce_scatter_single(
        output, input_.contiguous(), op=dist.ReduceOp.AVG, group=group, async_op=async_op))


def new_gloo_group(timeout) -> dist.ProcessGroup:
    """A gloo group of every rank, apart from the training groups (checkpoint planning and commits,
    also from an async save's background thread)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def barrier(group: Group = None) -> None:
    """Barrier over `group`; with None, over the world when distributed is initialized."""
    if group is not None:
        dist.barrier(group=group)
    elif dist.is_available() and dist.is_initialized():
        dist.barrier()


def batch_send_recv(ops: list) -> list:
    """Runs point-to-point ops given as (kind, tensor, peer_global_rank, group), kind 'send'/'recv'.

    Batched (one `batch_isend_irecv`) where the backend allows; returns the request handles.
    """
    if not ops:
        return []
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group)
           for kind, tensor, peer, group in ops]
    return dist.batch_isend_irecv(p2p)


def wait_all(requests: list) -> None:
    for request in requests:
        request.wait()


def global_rank(group: Group, group_rank: int) -> int:
    """The global rank of `group`'s member `group_rank` (point-to-point ops address global ranks)."""
    if group is None:
        return dist.get_rank() if dist.is_initialized() else 0
    return dist.get_global_rank(group, group_rank)


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: Group) -> list:
    """Starts sending `send` to the next rank of `group` (group rank + 1, wrapping round) and
    receiving into `recv` from the previous one; returns the handles for `wait_all`. Several
    exchanges started in the same order on every rank are matched in that order."""
    me, world = rank(group), size(group)
    ops = [("send", send, global_rank(group, (me + 1) % world), group),
           ("recv", recv, global_rank(group, (me - 1) % world), group)]
    return batch_send_recv(ops)


def all_to_all_single(output: torch.Tensor, input_: torch.Tensor, group: Group) -> None:
    """Rank r's dim-0 chunk j of `input_` lands as dim-0 chunk r of `output` on rank j."""
    if group is None:
        output.copy_(input_)
        return
    if not output.is_contiguous():  # the backend writes the raw buffer
        staging = torch.empty_like(output, memory_format=torch.contiguous_format)
        dist.all_to_all_single(staging, input_.contiguous(), group=group)
        output.copy_(staging)
        return
    dist.all_to_all_single(output, input_.contiguous(), group=group)


def all_to_all_uneven(output: torch.Tensor, input_: torch.Tensor, group: Group, output_splits: list,
                      input_splits: list) -> None:
    """All-to-all with per-rank row counts: rows input_splits[j] of `input_` (in order) go to rank j;
    `output` receives output_splits[j] rows from rank j (mixture-of-experts token dispatch)."""
    if group is None:
        output.copy_(input_)
        return
    dist.all_to_all_single(output, input_.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
