"""Point-to-point communication between neighbouring pipeline stages.

Activations travel forward (to `groups.pp_next_rank`), their gradients backward (to
`groups.pp_prev_rank`). The ring wraps round, which the interleaved schedule uses to pass a
virtual stage's output from the last rank to the next chunk on the first rank. Every message has
the shape and dtype the schedule passes in (known from the flags), so no shape handshake precedes
it; the sends and receives a schedule posts together go out as one batch (`comm.batch_send_recv`).

`Pipe` posts batches for a schedule. Blocking (`overlap=False`), each batch is waited for as it is
posted. With `overlap=True` nothing is waited for when posted: a received tensor is waited for
(`Received.wait()`) just before it is used, and a batch that sends is waited for when the next
batch in the same direction is posted (or at `finish()`), so transfers run while the stage computes.
Either way a sent output's data is freed once it is handed to the send (`deallocate_output`): the
autograd graph behind it is all that backward needs, as in Megatron.

Ordering. Two messages between the same pair of ranks are matched in the order they were posted.
Every rank posts the messages of one direction in the order of the micro-batches, and within one
batch the forward direction first (send to next, receive from prev), then the backward direction
(send to prev, receive from next), so messages match even when prev == next (two stages,
interleaved).
"""
from typing import Optional

import torch

from megatron.core.distributed import comm


class Batch:
    """The request handles of one posted batch of sends and receives."""

    def __init__(self, requests: list):
        self._requests = requests

    def wait(self) -> None:
        if self._requests:
            comm.wait_all(self._requests)
        self._requests = None


class Received:
    """A tensor being received in a posted batch."""

    def __init__(self, tensor: torch.Tensor, batch: Batch, activation: bool):
        self.tensor = tensor
        self.batch = batch
        self.activation = activation

    def wait(self) -> torch.Tensor:
        """The tensor, once arrived. Received activations require grad (the stage differentiates
        with respect to them)."""
        self.batch.wait()
        if self.activation and not self.tensor.requires_grad:
            self.tensor.requires_grad_(True)
        return self.tensor


def wait(received: Optional[Received]) -> Optional[torch.Tensor]:
    return None if received is None else received.wait()


def deallocate_output(output: Optional[torch.Tensor]) -> None:
    """Frees the data of an output already handed to a send; its autograd graph stays. A view is
    left alone (its base would keep the memory anyway)."""
    if output is not None and output._base is None and output.numel() > 1:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def post(groups, *, tensor_shape, dtype, send_next: Optional[torch.Tensor] = None,
         send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
         recv_next: bool = False) -> tuple:
    """Posts one batch; returns (Received from prev or None, Received from next or None, Batch)."""
    from_prev = _empty(tensor_shape, dtype, groups) if recv_prev else None
    from_next = _empty(tensor_shape, dtype, groups) if recv_next else None
    ops = []
    if send_next is not None:
        ops.append(("send", _checked(send_next, tensor_shape, dtype), groups.pp_next_rank, groups.pp))
    if from_prev is not None:
        ops.append(("recv", from_prev, groups.pp_prev_rank, groups.pp))
    if send_prev is not None:
        ops.append(("send", _checked(send_prev, tensor_shape, dtype), groups.pp_prev_rank, groups.pp))
    if from_next is not None:
        ops.append(("recv", from_next, groups.pp_next_rank, groups.pp))
    batch = Batch(comm.batch_send_recv(ops))
    return (None if from_prev is None else Received(from_prev, batch, activation=True),
            None if from_next is None else Received(from_next, batch, activation=False), batch)


class Pipe:
    """A schedule's point-to-point traffic: posts batches (blocking or overlapped, see the module
    notes), frees sent outputs, and waits for every send at `finish()`."""

    def __init__(self, groups, tensor_shape, dtype, *, overlap: bool, deallocate: bool = True):
        self.groups = groups
        self.shape = dict(tensor_shape=tensor_shape, dtype=dtype)
        self.overlap = overlap
        self.deallocate = deallocate
        self._sending = {"forward": None, "backward": None}  # the last batch that sent, per direction

    def post(self, *, output: Optional[torch.Tensor] = None, input_grad: Optional[torch.Tensor] = None,
             recv_prev: bool = False, recv_next: bool = False) -> tuple:
        """Sends `output` to the next stage and `input_grad` to the previous one, and receives what is
        asked, in one batch. Returns (Received from prev or None, Received from next or None)."""
        from_prev, from_next, batch = post(self.groups, **self.shape, send_next=output, send_prev=input_grad,
                                           recv_prev=recv_prev, recv_next=recv_next)
        if not self.overlap:
            batch.wait()
        for direction, sent in (("forward", output), ("backward", input_grad)):
            if sent is not None:
                previous, self._sending[direction] = self._sending[direction], batch
                if previous is not None:
                    previous.wait()
        if self.deallocate:
            deallocate_output(output)
        return from_prev, from_next

    def finish(self) -> None:
        for batch in self._sending.values():
            if batch is not None:
                batch.wait()
        self._sending = {"forward": None, "backward": None}


def _empty(tensor_shape, dtype, groups) -> torch.Tensor:
    return torch.empty(tuple(tensor_shape), dtype=dtype, device=groups.device)


def _checked(tensor: torch.Tensor, tensor_shape, dtype) -> torch.Tensor:
    """The tensor to send, contiguous and detached; a wrong shape is a bug in the caller's layout
    (for example a sequence-parallel shard size), so fail loudly instead of hanging the peer."""
    if tuple(tensor.shape) != tuple(tensor_shape) or tensor.dtype != dtype:
        raise RuntimeError(f"pipeline send of shape {tuple(tensor.shape)} {tensor.dtype}, but the schedule expects "
                           f"{tuple(tensor_shape)} {dtype} (tensor_shape from `seq_length`, `micro_batch_size`, "
                           f"`hidden_size` and sequence parallelism)")
    return tensor.detach().contiguous()
