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
  shrinks the pipeline bubble by V. Micro-batches go through the chunks in groups of G
  (`--microbatch-group-size-per-virtual-pipeline-stage`, default P).

Data: `data_iterator` is one iterator per rank (each micro-batch is read once and handed to every
chunk that runs it), or a list of one iterator per model chunk.

Communication (`p2p.Pipe`): with `overlap_p2p_comm` a receive is posted one step ahead and waited
for just before its tensor is used, and sends are not waited for until the next send, so transfers
run while the stage computes; without it every batch is waited for as posted. Either way a sent
output's data is freed right away (`deallocate_pipeline_outputs`, always on in Megatron): backward
then runs through the autograd engine directly, which needs the output's graph, not its data.

Data-parallel reduction: every backward of a chunk but its last runs inside the chunk's
`no_sync()`, so the (possibly overlapped) gradient reduction of a chunk starts only once all its
micro-batches are done, as in Megatron.
"""
import contextlib
from typing import Callable, Optional

import torch
from torch.autograd import Variable

from megatron.core.pipeline_parallel import p2p
from megatron.core.pipeline_parallel.layout import check_microbatch_groups


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def set_moe_aux_loss_scale(model, scale_loss: Callable, cp_size: int, divisor: int) -> None:
    """Mixture-of-experts models: the auxiliary losses' gradients are scaled as the loss is (loss
    scale, context-parallel size, micro-batches), as Megatron-Core's schedules do."""
    holder = getattr(getattr(model, "module", model), "moe_aux_loss_scale", None)
    if holder is not None:
        holder.value = scale_loss(torch.ones(())) * cp_size / divisor


def _backward(output: torch.Tensor, output_grad: Optional[torch.Tensor]) -> None:
    """Backward from `output`. With a gradient, through the engine directly: `output`'s data may
    have been freed after its send, and `torch.autograd.backward` would check its shape."""
    if output_grad is None:
        torch.autograd.backward(output)
        return
    Variable._execution_engine.run_backward((output,), (output_grad,), False, False, (), True, True)


class _MicroBatches:
    """One rank's data iterator shared by its model chunks: micro-batch m is read once, when the
    first chunk runs it, handed to each chunk that runs it, and dropped after the last."""

    def __init__(self, iterator, num_chunks: int):
        self.iterator = iterator
        self.num_chunks = num_chunks
        self.cache = {}
        self.uses = {}
        self.read = 0

    def for_microbatch(self, microbatch: int):
        while self.read <= microbatch:
            self.cache[self.read] = next(self.iterator)
            self.read += 1
        batch = self.cache[microbatch]
        self.uses[microbatch] = self.uses.get(microbatch, 0) + 1
        if self.uses[microbatch] == self.num_chunks:
            del self.cache[microbatch], self.uses[microbatch]
        return iter([batch])


def _data_source(data_iterator, num_chunks: int) -> Callable:
    """(chunk, micro-batch) -> the iterator to hand to forward_step_func."""
    if isinstance(data_iterator, list):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {num_chunks} model chunks; "
                             "pass one iterator per rank or one per chunk")
        return lambda chunk, _microbatch: data_iterator[chunk]
    if num_chunks == 1:
        return lambda _chunk, _microbatch: data_iterator
    shared = _MicroBatches(data_iterator, num_chunks)
    return lambda _chunk, microbatch: shared.for_microbatch(microbatch)


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model_chunks: list,
                                   num_microbatches: int, groups, forward_only: bool = False,
                                   scale_loss: Callable = _identity, loss_divisor: Optional[int] = None,
                                   **_unused) -> list:
    """Gradient accumulation on one stage: forward and backward each micro-batch in turn; only the
    last micro-batch's backward may trigger the data-parallel reduction."""
    if len(model_chunks) != 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    model = model_chunks[0]
    iterator = _data_source(data_iterator, 1)(0, 0)
    reported = []
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        no_sync = getattr(model, "no_sync", None)
        context = no_sync() if (no_sync is not None and not last and not forward_only) else contextlib.nullcontext()
        with context, (torch.no_grad() if forward_only else contextlib.nullcontext()):
            set_moe_aux_loss_scale(model, scale_loss, groups.cp_size, loss_divisor or num_microbatches)
            output, loss_func = forward_step_func(iterator, model)
            loss, values = loss_func(output)
            if not forward_only:
                scale_loss(loss / (loss_divisor or num_microbatches)).backward()
        reported.append(values)
    return reported


class _Stage:
    """One model chunk's side of a schedule: runs forward/backward steps on it and keeps count of
    its backwards (the last one may start the data-parallel reduction)."""

    def __init__(self, model, *, is_first: bool, is_last: bool, forward_step_func: Callable,
                 num_microbatches: int, scale_loss: Callable, forward_only: bool, reported: list,
                 loss_divisor: Optional[int] = None, cp_size: int = 1):
        self.model = model
        self.cp_size = cp_size
        self.is_first = is_first   # holds the embedding: no activation to receive
        self.is_last = is_last     # holds the loss: no activation to send
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.scale_loss = scale_loss
        self.forward_only = forward_only
        self.reported = reported
        self.loss_divisor = loss_divisor or num_microbatches
        self.backwards_done = 0

    def forward(self, input_tensor: Optional[torch.Tensor], iterator) -> torch.Tensor:
        """Runs one micro-batch; returns the activation to send (or, last stage, the scaled loss)."""
        self.model.set_input_tensor(input_tensor)
        set_moe_aux_loss_scale(self.model, self.scale_loss, self.cp_size, self.loss_divisor)
        output, loss_func = self.forward_step_func(iterator, self.model)
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
            _backward(output, None if self.is_last else output_grad)
        return None if input_tensor is None else input_tensor.grad


def _check_microbatches(num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise ValueError(f"number of micro-batches ({num_microbatches}) must be >= 1")


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator, model_chunks: list, num_microbatches: int, groups,
        forward_only: bool = False, scale_loss: Callable = _identity, tensor_shape, dtype,
        overlap_p2p_comm: bool = False, deallocate_pipeline_outputs: bool = True,
        loss_divisor: Optional[int] = None, **_unused) -> list:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Rank r keeps at most P-r micro-batches' activations alive (P for the first stage), whatever N."""
    if len(model_chunks) != 1:
        raise ValueError(f"the non-interleaved schedule takes one model chunk per rank, got {len(model_chunks)}")
    _check_microbatches(num_microbatches)
    reported = []
    stage = _Stage(model_chunks[0], is_first=groups.is_first_stage, is_last=groups.is_last_stage,
                   forward_step_func=forward_step_func, num_microbatches=num_microbatches, scale_loss=scale_loss,
                   forward_only=forward_only, reported=reported, loss_divisor=loss_divisor,
                   cp_size=groups.cp_size)
    iterator = _data_source(data_iterator, 1)(0, 0)
    pipe = p2p.Pipe(groups, tensor_shape, dtype, overlap=overlap_p2p_comm, deallocate=deallocate_pipeline_outputs)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        if forward_only:
            _forward_only_1f1b(stage, pipe, iterator, num_microbatches)
        elif overlap_p2p_comm:
            _overlapped_1f1b(stage, pipe, iterator, num_microbatches, groups)
        else:
            _blocking_1f1b(stage, pipe, iterator, num_microbatches, groups)
    pipe.finish()
    return reported


def _forward_only_1f1b(stage: _Stage, pipe: p2p.Pipe, iterator, n: int) -> None:
    incoming = None if stage.is_first else pipe.post(recv_prev=True)[0]
    for index in range(n):
        output = stage.forward(p2p.wait(incoming), iterator)
        recv = not stage.is_first and index + 1 < n
        incoming = pipe.post(output=None if stage.is_last else output, recv_prev=recv)[0]


def _blocking_1f1b(stage: _Stage, pipe: p2p.Pipe, iterator, n: int, groups) -> None:
    """Each batch waited for as posted: after a forward, the send goes with the receive of the
    gradient the next backward needs; after a backward, with the receive of the next input."""
    first, last = stage.is_first, stage.is_last
    num_warmup = min(groups.pp_size - groups.pp_rank - 1, n)
    in_flight = []  # (input, output) of micro-batches whose backward is pending, oldest first
    for _ in range(num_warmup):
        input_tensor = None if first else p2p.wait(pipe.post(recv_prev=True)[0])
        output = stage.forward(input_tensor, iterator)
        pipe.post(output=None if last else output)
        in_flight.append((input_tensor, output))
    num_steady = n - num_warmup
    input_tensor = None if first or num_steady == 0 else p2p.wait(pipe.post(recv_prev=True)[0])
    for index in range(num_steady):
        output = stage.forward(input_tensor, iterator)
        output_grad = None if last else p2p.wait(pipe.post(output=output, recv_next=True)[1])
        in_flight.append((input_tensor, output))
        input_grad = stage.backward(*in_flight.pop(0), output_grad)
        recv = not first and index < num_steady - 1
        input_tensor = p2p.wait(pipe.post(input_grad=None if first else input_grad, recv_prev=recv)[0])
    for _ in range(num_warmup):
        output_grad = None if last else p2p.wait(pipe.post(recv_next=True)[1])
        input_grad = stage.backward(*in_flight.pop(0), output_grad)
        pipe.post(input_grad=None if first else input_grad)


def _overlapped_1f1b(stage: _Stage, pipe: p2p.Pipe, iterator, n: int, groups) -> None:
    """Receives posted one step ahead: after a forward, the send goes with the receive of the next
    input (which arrives during the backward); after a backward, with the receive of the next
    gradient (which arrives during the forward)."""
    first, last = stage.is_first, stage.is_last
    num_warmup = min(groups.pp_size - groups.pp_rank - 1, n)
    incoming = None if first else pipe.post(recv_prev=True)[0]
    in_flight = []

    def forward(index):
        nonlocal incoming
        input_tensor = p2p.wait(incoming)
        output = stage.forward(input_tensor, iterator)
        in_flight.append((input_tensor, output))
        incoming = pipe.post(output=None if last else output, recv_prev=not first and index + 1 < n)[0]

    for index in range(num_warmup):
        forward(index)
    gradient = None if last else pipe.post(recv_next=True)[1]
    for index in range(n):
        if num_warmup + index < n:
            forward(num_warmup + index)
        input_grad = stage.backward(*in_flight.pop(0), p2p.wait(gradient))
        gradient = pipe.post(input_grad=None if first else input_grad, recv_next=not last and index + 1 < n)[1]


def schedule_table(num_microbatches: int, virtual_size: int, group_size: int) -> list:
    """(micro-batch, chunk) of each forward step of a rank in the interleaved schedule: groups of
    `group_size` micro-batches go through chunk 0, then chunk 1, ...; the last group takes the
    remaining micro-batches (Megatron's table). Backward step k runs the same micro-batch on chunk
    V - 1 - chunk."""
    table = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table.extend((microbatch, chunk) for chunk in range(virtual_size) for microbatch in range(first, last))
    return table


class _Interleaved:
    """The state of one interleaved schedule on one rank: which chunk and micro-batch each step
    runs, the received inputs and gradients per chunk (by micro-batch), and the outputs awaiting
    backward."""

    def __init__(self, stages: list, groups, table: list, source: Callable, pipe: p2p.Pipe):
        self.stages = stages
        self.groups = groups
        self.table = table
        self.source = source
        self.pipe = pipe
        self.virtual = len(stages)
        self.inputs = [{} for _ in stages]        # chunk -> {micro-batch: Received or None}
        self.outputs = [{} for _ in stages]       # chunk -> {micro-batch: output}
        self.output_grads = [{} for _ in stages]  # chunk -> {micro-batch: Received or None}
        self.received = [0] * len(stages)         # inputs received so far, per chunk
        self.grads_received = [0] * len(stages)

    def chunk(self, step: int, forward: bool) -> int:
        chunk = self.table[step % len(self.table)][1]
        return chunk if forward else self.virtual - 1 - chunk

    def microbatch(self, step: int) -> int:
        return self.table[step][0]

    def incoming(self, step: int, forward: bool) -> tuple:
        """(whether a tensor arrives for the step after `step`, the chunk it is for), in the forward
        (activations) or backward (gradients) direction. The leading rank (the first rank forward,
        the last backward) receives what the ending rank sent P - 1 steps earlier in its own
        sequence; the ending rank's last chunk sends nothing."""
        pp = self.groups.pp_size
        leading = self.groups.is_first_stage if forward else self.groups.is_last_stage
        if not leading:
            return True, self.chunk(step + 1, forward)
        if step < pp - 1:
            return False, None
        sender_chunk = self.chunk(step - (pp - 1), forward)
        if sender_chunk == (self.virtual - 1 if forward else 0):
            return False, None
        return True, sender_chunk + (1 if forward else -1)

    def add_input(self, chunk: int, received) -> None:
        self.inputs[chunk][self.received[chunk]] = received
        self.received[chunk] += 1

    def add_output_grad(self, chunk: int, received) -> None:
        self.output_grads[chunk][self.grads_received[chunk]] = received
        self.grads_received[chunk] += 1

    def forward(self, step: int) -> Optional[torch.Tensor]:
        """Runs forward step `step`; returns the output to send (None on the model's last chunk)."""
        chunk, microbatch = self.chunk(step, True), self.microbatch(step)
        stage = self.stages[chunk]
        input_tensor = None if stage.is_first else p2p.wait(self.inputs[chunk][microbatch])
        self.inputs[chunk][microbatch] = input_tensor
        output = stage.forward(input_tensor, self.source(chunk, microbatch))
        if stage.forward_only:
            del self.inputs[chunk][microbatch]
        else:
            self.outputs[chunk][microbatch] = output
        return None if stage.is_last else output

    def backward(self, step: int) -> Optional[torch.Tensor]:
        """Runs backward step `step`; returns the input gradient to send (None on the first chunk)."""
        chunk, microbatch = self.chunk(step, False), self.microbatch(step)
        stage = self.stages[chunk]
        output_grad = None if stage.is_last else p2p.wait(self.output_grads[chunk].pop(microbatch))
        input_grad = stage.backward(self.inputs[chunk].pop(microbatch), self.outputs[chunk].pop(microbatch),
                                    output_grad)
        return None if stage.is_first else input_grad

    def send_forward(self, step: int, output, *, last_forward: bool, recv: bool = True) -> None:
        arrives, chunk = self.incoming(step, True)
        arrives = arrives and not last_forward and recv
        received, _ = self.pipe.post(output=output, recv_prev=arrives)
        if arrives:
            self.add_input(chunk, received)

    def send_backward(self, step: int, input_grad, *, last_backward: bool = False) -> None:
        arrives, chunk = self.incoming(step, False)
        arrives = arrives and not last_backward
        _, received = self.pipe.post(input_grad=input_grad, recv_next=arrives)
        if arrives:
            self.add_output_grad(chunk, received)

    def send_both(self, forward_step: int, output, backward_step: int, input_grad, *, last_forward: bool) -> None:
        """One batch carrying both directions (the blocking steady state)."""
        forward_arrives, forward_chunk = self.incoming(forward_step, True)
        backward_arrives, backward_chunk = self.incoming(backward_step, False)
        forward_arrives = forward_arrives and not last_forward
        received_input, received_grad = self.pipe.post(output=output, input_grad=input_grad,
                                                       recv_prev=forward_arrives, recv_next=backward_arrives)
        if forward_arrives:
            self.add_input(forward_chunk, received_input)
        if backward_arrives:
            self.add_output_grad(backward_chunk, received_grad)


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model_chunks: list, num_microbatches: int, groups,
        forward_only: bool = False, scale_loss: Callable = _identity, tensor_shape, dtype,
        overlap_p2p_comm: bool = False, overlap_p2p_comm_warmup_flush: bool = False,
        microbatch_group_size: Optional[int] = None, deallocate_pipeline_outputs: bool = True,
        loss_divisor: Optional[int] = None, **_unused) -> list:
    """Interleaved 1F1B over V model chunks per rank (N*V chunk-micro-batches per rank)."""
    _check_microbatches(num_microbatches)
    pp, rank, virtual = groups.pp_size, groups.pp_rank, len(model_chunks)
    group_size = check_microbatch_groups(num_microbatches, pp, microbatch_group_size)
    reported = []
    stages = [_Stage(chunk, is_first=groups.is_first_stage and index == 0,
                     is_last=groups.is_last_stage and index == virtual - 1, forward_step_func=forward_step_func,
                     num_microbatches=num_microbatches, scale_loss=scale_loss, forward_only=forward_only,
                     reported=reported, loss_divisor=loss_divisor, cp_size=groups.cp_size)
              for index, chunk in enumerate(model_chunks)]
    pipe = p2p.Pipe(groups, tensor_shape, dtype, overlap=overlap_p2p_comm, deallocate=deallocate_pipeline_outputs)
    run = _Interleaved(stages, groups, schedule_table(num_microbatches, virtual, group_size),
                       _data_source(data_iterator, virtual), pipe)
    total = num_microbatches * virtual
    num_warmup = total if forward_only else min((pp - rank - 1) * 2 + (virtual - 1) * group_size, total)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        if not groups.is_first_stage:
            run.add_input(0, pipe.post(recv_prev=True)[0])
        if overlap_p2p_comm:
            _overlapped_interleaved(run, total, num_warmup, forward_only, overlap_p2p_comm_warmup_flush)
        else:
            _blocking_interleaved(run, total, num_warmup, forward_only)
    pipe.finish()
    return reported


def _blocking_interleaved(run: _Interleaved, total: int, num_warmup: int, forward_only: bool) -> None:
    all_warmup = num_warmup == total
    last_rank = run.groups.is_last_stage
    for step in range(num_warmup):
        output = run.forward(step)
        if step == num_warmup - 1 and not forward_only and not all_warmup:
            # The last warm-up send also receives the first gradient (one batch, as Megatron).
            run.send_both(step, output, -1, None, last_forward=step == total - 1)
        else:
            run.send_forward(step, output, last_forward=step == total - 1)
    num_steady = total - num_warmup
    for step in range(num_steady):
        output = run.forward(step + num_warmup)
        input_grad = run.backward(step)
        run.send_both(step + num_warmup, output, step, input_grad, last_forward=step == num_steady - 1)
    if forward_only:
        return
    if all_warmup and not last_rank:
        run.add_output_grad(run.virtual - 1, run.pipe.post(recv_next=True)[1])
    for step in range(num_steady, total):
        run.send_backward(step, run.backward(step), last_backward=step == total - 1)


def _overlapped_interleaved(run: _Interleaved, total: int, num_warmup: int, forward_only: bool,
                            warmup_flush: bool) -> None:
    """Separate batches per direction, posted right after the step that produces what they send;
    receives waited for just before use. With `warmup_flush`, ranks that receive post the next
    receive before the warm-up forward (cool-down backward) instead of after it."""
    all_warmup = num_warmup == total
    first_rank, last_rank = run.groups.is_first_stage, run.groups.is_last_stage
    for step in range(num_warmup):
        prefetch = warmup_flush and not first_rank
        if prefetch:
            run.send_forward(step, None, last_forward=step == total - 1)
        output = run.forward(step)
        run.send_forward(step, output, last_forward=step == total - 1, recv=not prefetch)
        if step == num_warmup - 1 and not forward_only and not all_warmup:
            run.send_backward(-1, None)  # the first gradient, for the first steady backward
    num_steady = total - num_warmup
    for step in range(num_steady):
        output = run.forward(step + num_warmup)
        run.send_forward(step + num_warmup, output, last_forward=step == num_steady - 1)
        run.send_backward(step, run.backward(step))
    if forward_only:
        return
    if all_warmup and not last_rank:
        run.add_output_grad(run.virtual - 1, run.pipe.post(recv_next=True)[1])
    for step in range(num_steady, total):
        prefetch = warmup_flush and not last_rank
        if prefetch:
            run.send_backward(step, None, last_backward=step == total - 1)
        input_grad = run.backward(step)
        run.pipe.post(input_grad=input_grad) if prefetch else run.send_backward(
            step, input_grad, last_backward=step == total - 1)


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
