"""Point-to-point communication between neighbouring pipeline stages.

Activations travel forward (to `groups.pp_next_rank`), their gradients backward (to
`groups.pp_prev_rank`). The ring wraps round, which the interleaved schedule uses to pass a
virtual stage's output from the last rank to the next chunk on the first rank. Every message has
the shape and dtype the schedule passes in (known from the flags), so no shape handshake precedes
it; all the sends and receives of one step go out as one batch (`comm.batch_send_recv`).

Ordering. Two messages between the same pair of ranks in one batch (possible when prev == next,
e.g. two stages, interleaved) are matched in the order they were posted. Every rank therefore posts
the forward direction first (send to next, receive from prev), then the backward direction (send to
prev, receive from next): the activation is posted before the gradient on both ends.
"""
from typing import Optional

import torch

from megatron.core.distributed import comm


def communicate(groups, *, tensor_shape, dtype, send_next: Optional[torch.Tensor] = None,
                send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
                recv_next: bool = False) -> tuple:
    """Sends/receives in one batch; returns (received from prev, received from next), None where
    nothing was asked. Received activations require grad (the stage differentiates w.r.t. them)."""
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
    comm.wait_all(comm.batch_send_recv(ops))
    if from_prev is not None:
        from_prev.requires_grad_(True)
    return from_prev, from_next


def _empty(tensor_shape, dtype, groups) -> torch.Tensor:
    return torch.empty(tuple(tensor_shape), dtype=dtype, device=groups.device)


def _checked(tensor: torch.Tensor, tensor_shape, dtype) -> torch.Tensor:
    """The tensor to send, contiguous and detached; a wrong shape is a bug in the caller's layout
    (for example a sequence-parallel shard size), so fail loudly instead of hanging the peer."""
    if tuple(tensor.shape) != tuple(tensor_shape) or tensor.dtype != dtype:
        raise RuntimeError(f"pipeline send of shape {tuple(tensor.shape)} {tensor.dtype}, but the schedule expects "
                           f"{tuple(tensor_shape)} {dtype} (tensor_shape from --seq-length, --micro-batch-size, "
                           f"--hidden-size and sequence parallelism)")
    return tensor.detach().contiguous()


# Named steps, as the schedules use them. `None` to send means nothing is sent.

def recv_forward(groups, tensor_shape, dtype) -> torch.Tensor:
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, recv_prev=True)[0]


def recv_backward(groups, tensor_shape, dtype) -> torch.Tensor:
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, recv_next=True)[1]


def send_forward(output: Optional[torch.Tensor], groups, tensor_shape, dtype) -> None:
    communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_next=output)


def send_backward(input_grad: Optional[torch.Tensor], groups, tensor_shape, dtype) -> None:
    communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_prev=input_grad)


def send_forward_recv_backward(output, groups, tensor_shape, dtype, recv: bool = True):
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_next=output, recv_next=recv)[1]


def send_backward_recv_forward(input_grad, groups, tensor_shape, dtype, recv: bool = True):
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_prev=input_grad, recv_prev=recv)[0]


def send_forward_recv_forward(output, groups, tensor_shape, dtype, recv: bool = True):
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_next=output, recv_prev=recv)[0]


def send_backward_recv_backward(input_grad, groups, tensor_shape, dtype, recv: bool = True):
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_prev=input_grad, recv_next=recv)[1]


def send_forward_backward_recv_forward_backward(output, input_grad, groups, tensor_shape, dtype, *,
                                                recv_prev: bool, recv_next: bool) -> tuple:
    return communicate(groups, tensor_shape=tensor_shape, dtype=dtype, send_next=output, send_prev=input_grad,
                       recv_prev=recv_prev, recv_next=recv_next)
