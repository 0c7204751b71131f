"""Forward/backward schedules over the micro-batches of one optimizer step.

A schedule calls `forward_step_func(data_iterator, model) -> (output, loss_func)` for each
micro-batch; on the last pipeline stage `loss_func(output) -> (loss, reported)` gives the scalar
to differentiate and a dict of values to log. Backward runs on `scale_loss(loss / num_microbatches)`
(the loss-scaler for fp16), or on `loss / loss_divisor` when given (1 for losses that are sums the
caller normalizes afterwards). Returns the list of `reported` dicts (empty off the last stage).

Three schedules (pictures and the bubble arithmetic in docs/parallelism.md):

- `forward_backward_no_pipelining`: one stage; gradient accumulation over the micro-batches.
- `forward_backward_pipelining_without_interleaving` (1F1B): rank r runs P-r-1 warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards.
- `forward_backward_pipelining_with_interleaving`: each rank holds V model chunks (virtual
  stages); the same warm-up / steady / cool-down pattern over N*V chunk-micro-batches, which
  shrinks the pipeline bubble by V.

Data-parallel reduction: every backward of a chunk but its last runs inside the chunk's
`no_sync()`, so the (possibly overlapped) gradient reduction of a chunk starts only once all its
micro-batches are done, as in Megatron.
"""
import contextlib
from typing import Callable, Optional

import torch

from megatron.core.pipeline_parallel import p2p


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model_chunks: list,
                                   num_microbatches: int, groups, forward_only: bool = False,
                                   scale_loss: Callable = _identity, loss_divisor: Optional[int] = None,
                                   **_unused) -> list:
    """Gradient accumulation on one stage: forward and backward each micro-batch in turn; only the
    last micro-batch's backward may trigger the data-parallel reduction."""
    if len(model_chunks) != 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    model = model_chunks[0]
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    reported = []
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        no_sync = getattr(model, "no_sync", None)
        context = no_sync() if (no_sync is not None and not last and not forward_only) else contextlib.nullcontext()
        with context, (torch.no_grad() if forward_only else contextlib.nullcontext()):
            output, loss_func = forward_step_func(iterator, model)
            loss, values = loss_func(output)
            if not forward_only:
                scale_loss(loss / (loss_divisor or num_microbatches)).backward()
        reported.append(values)
    return reported


class _Stage:
    """One model chunk's side of a schedule: runs forward/backward steps on it and keeps count of
    its backwards (the last one may start the data-parallel reduction)."""

    def __init__(self, model, iterator, *, is_first: bool, is_last: bool, forward_step_func: Callable,
                 num_microbatches: int, scale_loss: Callable, forward_only: bool, reported: list,
                 loss_divisor: Optional[int] = None):
        self.model = model
        self.iterator = iterator
        self.is_first = is_first   # holds the embedding: no activation to receive
        self.is_last = is_last     # holds the loss: no activation to send
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.scale_loss = scale_loss
        self.forward_only = forward_only
        self.reported = reported
        self.loss_divisor = loss_divisor or num_microbatches
        self.backwards_done = 0

    def forward(self, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Runs one micro-batch; returns the activation to send (or, last stage, the scaled loss)."""
        self.model.set_input_tensor(input_tensor)
        output, loss_func = self.forward_step_func(self.iterator, self.model)
        if not self.is_last:
            return output
        loss, values = loss_func(output)
        self.reported.append(values)
        return loss if self.forward_only else self.scale_loss(loss / self.loss_divisor)

    def backward(self, input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backpropagates one micro-batch; returns the gradient w.r.t. the received activation."""
        self.backwards_done += 1
        no_sync = getattr(self.model, "no_sync", None)
        last = self.backwards_done == self.num_microbatches
        with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
            torch.autograd.backward(output, grad_tensors=None if self.is_last else output_grad)
        return None if input_tensor is None else input_tensor.grad


def _check_common(model_chunks: list, data_iterator, num_microbatches: int) -> list:
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    if len(iterators) != len(model_chunks):
        raise ValueError(f"got {len(iterators)} data iterators for {len(model_chunks)} model chunks; "
                         "pass one iterator per chunk")
    if num_microbatches < 1:
        raise ValueError(f"number of micro-batches ({num_microbatches}) must be >= 1")
    return iterators


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator, model_chunks: list, num_microbatches: int, groups,
        forward_only: bool = False, scale_loss: Callable = _identity, tensor_shape, dtype,
        loss_divisor: Optional[int] = None, **_unused) -> list:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Rank r keeps at most P-r micro-batches' activations alive (P for the first stage), whatever N."""
    if len(model_chunks) != 1:
        raise ValueError(f"the non-interleaved schedule takes one model chunk per rank, got {len(model_chunks)}")
    iterators = _check_common(model_chunks, data_iterator, num_microbatches)
    reported = []
    stage = _Stage(model_chunks[0], iterators[0], is_first=groups.is_first_stage, is_last=groups.is_last_stage,
                   forward_step_func=forward_step_func, num_microbatches=num_microbatches, scale_loss=scale_loss,
                   forward_only=forward_only, reported=reported, loss_divisor=loss_divisor)
    shape = dict(tensor_shape=tensor_shape, dtype=dtype)

    def receive_forward():
        return None if stage.is_first else p2p.recv_forward(groups, **shape)

    def send_forward(output):
        if not stage.is_last:
            p2p.send_forward(output, groups, **shape)

    num_warmup = min(groups.pp_size - groups.pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    in_flight = []  # (input, output) of micro-batches whose backward is pending, oldest first

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for _ in range(num_warmup):
            input_tensor = receive_forward()
            output = stage.forward(input_tensor)
            send_forward(output)
            if not forward_only:
                in_flight.append((input_tensor, output))

        input_tensor = receive_forward() if num_steady > 0 else None
        for index in range(num_steady):
            last_steady = index == num_steady - 1
            output = stage.forward(input_tensor)
            if forward_only:
                send_forward(output)
                input_tensor = None if last_steady else receive_forward()
                continue
            output_grad = None if stage.is_last else p2p.send_forward_recv_backward(output, groups, **shape)
            in_flight.append((input_tensor, output))
            oldest_input, oldest_output = in_flight.pop(0)
            input_grad = stage.backward(oldest_input, oldest_output, output_grad)
            if last_steady:
                input_tensor = None
                if not stage.is_first:
                    p2p.send_backward(input_grad, groups, **shape)
            elif stage.is_first:
                input_tensor = None
            else:
                input_tensor = p2p.send_backward_recv_forward(input_grad, groups, **shape)

        if not forward_only:
            for _ in range(num_warmup):
                oldest_input, oldest_output = in_flight.pop(0)
                output_grad = None if stage.is_last else p2p.recv_backward(groups, **shape)
                input_grad = stage.backward(oldest_input, oldest_output, output_grad)
                if not stage.is_first:
                    p2p.send_backward(input_grad, groups, **shape)
    return reported


def model_chunk_id(step: int, pp_size: int, virtual_size: int, *, forward: bool) -> int:
    """The chunk that runs the step-th forward (or backward) on a rank of the interleaved schedule.

    Micro-batches go through the chunks in groups of P: P forwards on chunk 0, P on chunk 1, ...,
    then the next P micro-batches; backwards visit the chunks in the reverse order."""
    chunk = (step % (pp_size * virtual_size)) // pp_size
    return chunk if forward else virtual_size - chunk - 1


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model_chunks: list, num_microbatches: int, groups,
        forward_only: bool = False, scale_loss: Callable = _identity, tensor_shape, dtype,
        loss_divisor: Optional[int] = None, **_unused) -> list:
    """Interleaved 1F1B over V model chunks per rank (N*V chunk-micro-batches per rank)."""
    iterators = _check_common(model_chunks, data_iterator, num_microbatches)
    pp, rank, virtual = groups.pp_size, groups.pp_rank, len(model_chunks)
    if num_microbatches % pp != 0:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a "
                         f"multiple of --pipeline-model-parallel-size ({pp})")
    reported = []
    stages = [_Stage(chunk, iterator, is_first=groups.is_first_stage and index == 0,
                     is_last=groups.is_last_stage and index == virtual - 1, forward_step_func=forward_step_func,
                     num_microbatches=num_microbatches, scale_loss=scale_loss, forward_only=forward_only,
                     reported=reported, loss_divisor=loss_divisor)
              for index, (chunk, iterator) in enumerate(zip(model_chunks, iterators))]
    shape = dict(tensor_shape=tensor_shape, dtype=dtype)
    first_rank, last_rank = groups.is_first_stage, groups.is_last_stage
    total = num_microbatches * virtual
    if num_microbatches == pp or forward_only:
        num_warmup, all_warmup = total, True   # no steady state: every forward, then every backward
    else:
        num_warmup, all_warmup = min((pp - rank - 1) * 2 + (virtual - 1) * pp, total), False
    num_steady = total - num_warmup

    inputs = [[] for _ in range(virtual)]        # received activations, per chunk, oldest first
    outputs = [[] for _ in range(virtual)]       # outputs awaiting backward
    output_grads = [[] for _ in range(virtual)]  # received gradients of those outputs

    def chunk_of(step, forward):
        return model_chunk_id(step, pp, virtual, forward=forward)

    def forward_step(step):
        chunk = chunk_of(step, True)
        if stages[chunk].is_first and len(inputs[chunk]) == len(outputs[chunk]):
            inputs[chunk].append(None)
        output = stages[chunk].forward(inputs[chunk][-1])
        outputs[chunk].append(output)
        if forward_only:
            inputs[chunk].pop()
            outputs[chunk].pop()
        return None if stages[chunk].is_last else output

    def backward_step(step):
        chunk = chunk_of(step, False)
        if stages[chunk].is_last and not output_grads[chunk]:
            output_grads[chunk].append(None)
        input_grad = stages[chunk].backward(inputs[chunk].pop(0), outputs[chunk].pop(0), output_grads[chunk].pop(0))
        return None if stages[chunk].is_first else input_grad

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        if not first_rank:
            inputs[0].append(p2p.recv_forward(groups, **shape))
        for k in range(num_warmup):
            output = forward_step(k)
            next_chunk = chunk_of(k + 1, True)
            recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                    output, None, groups, **shape, recv_prev=recv_prev, recv_next=not last_rank)
                output_grads[virtual - 1].append(output_grad)
            else:
                input_tensor = p2p.send_forward_recv_forward(output, groups, **shape, recv=recv_prev)
            if recv_prev:
                inputs[next_chunk].append(input_tensor)

        for k in range(num_steady):
            forward_k, backward_k = k + num_warmup, k
            output = forward_step(forward_k)
            input_grad = backward_step(backward_k)
            # What arrives now was sent by the neighbour in this same step; on the first (last) rank
            # that is the last (first) rank, P-1 steps ahead in its own sequence.
            if first_rank:
                next_forward_chunk = chunk_of(forward_k - (pp - 1), True)
                recv_prev = next_forward_chunk != virtual - 1
                next_forward_chunk += 1
            else:
                next_forward_chunk = chunk_of(forward_k + 1, True)
                recv_prev = True
            if last_rank:
                next_backward_chunk = chunk_of(backward_k - (pp - 1), False)
                recv_next = next_backward_chunk != 0
                next_backward_chunk -= 1
            else:
                next_backward_chunk = chunk_of(backward_k + 1, False)
                recv_next = True
            if k == num_steady - 1:
                recv_prev = False
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, input_grad, groups, **shape, recv_prev=recv_prev, recv_next=recv_next)
            if recv_prev:
                inputs[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_grads[next_backward_chunk].append(output_grad)

        if not forward_only:
            if all_warmup and not last_rank:
                output_grads[virtual - 1].append(p2p.recv_backward(groups, **shape))
            for k in range(num_steady, total):
                input_grad = backward_step(k)
                next_chunk = chunk_of(k + 1, False)
                recv_next = not (last_rank and next_chunk == virtual - 1) and k != total - 1
                output_grad = p2p.send_backward_recv_backward(input_grad, groups, **shape, recv=recv_next)
                if recv_next:
                    output_grads[next_chunk].append(output_grad)
    return reported


def get_forward_backward_func(pipeline_model_parallel_size: int, virtual_pipeline_size: int = 1) -> Callable:
    """The schedule for this layout: no pipelining, 1F1B, or interleaved 1F1B (V > 1)."""
    if pipeline_model_parallel_size == 1:
        if virtual_pipeline_size > 1:
            raise ValueError(f"{virtual_pipeline_size} virtual pipeline stages need "
                             "--pipeline-model-parallel-size > 1 (got 1)")
        return forward_backward_no_pipelining
    if virtual_pipeline_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
