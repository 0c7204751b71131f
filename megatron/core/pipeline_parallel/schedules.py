"""Forward/backward schedules over the micro-batches of one optimizer step.

A schedule calls `forward_step_func(data_iterator, model) -> (output, loss_func)` for each
micro-batch; on the last pipeline stage `loss_func(output) -> (loss, reported)` gives the scalar
to differentiate and a dict of values to log. Backward runs on `scale_loss(loss / num_microbatches)`
(the loss-scaler for fp16). Returns the list of `reported` dicts (empty off the last stage).
"""
import contextlib
from typing import Callable

import torch


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model_chunks: list,
                                   num_microbatches: int, groups, forward_only: bool = False,
                                   scale_loss: Callable = _identity, **_unused) -> list:
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
                scale_loss(loss / num_microbatches).backward()
        reported.append(values)
    return reported


def get_forward_backward_func(pipeline_model_parallel_size: int, virtual_pipeline_size: int = 1) -> Callable:
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise ValueError("pipeline parallelism is not available in this build")
