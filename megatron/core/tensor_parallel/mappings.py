"""Paired autograd collectives for tensor and sequence parallelism.

Each function is one communication pattern whose backward is its conjugate, so model code states
where a tensor enters or leaves a parallel region and autograd does the rest:

| function                                   | forward                  | backward                 |
|--------------------------------------------|--------------------------|--------------------------|
| copy_to_tensor_parallel_region             | identity                 | all-reduce               |
| reduce_from_tensor_parallel_region         | all-reduce               | identity                 |
| scatter_to_tensor_parallel_region          | keep my last-dim chunk   | all-gather last dim      |
| gather_from_tensor_parallel_region         | all-gather last dim      | keep my last-dim chunk   |
| scatter_to_sequence_parallel_region        | keep my dim-0 chunk      | all-gather dim 0         |
| gather_from_sequence_parallel_region       | all-gather dim 0         | reduce-scatter dim 0     |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 0     | all-gather dim 0         |
| all_to_all (row counts per rank)           | all-to-all dim 0         | all-to-all back          |

Activations are sequence-first ([s, b, h]), so sequence parallelism shards dim 0.
"""
import torch

from megatron.core.distributed import comm


def _all_reduce(x, group):
    if comm.size(group) == 1:
        return x
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def _split_last(x, group):
    world = comm.size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[comm.rank(group)].contiguous()


def _gather_last(x, group):
    world = comm.size(group)
    if world == 1:
        return x
    moved = x.movedim(-1, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into_tensor(out, moved, group)
    return out.movedim(0, -1).contiguous()


def _split_first(x, group):
    world = comm.size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=0)[comm.rank(group)].contiguous()


def _gather_first(x, group):
    world = comm.size(group)
    if world == 1:
        return x
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, x.contiguous(), group)
    return out


def _reduce_scatter_first(x, group):
    world = comm.size(group)
    if world == 1:
        return x
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    comm.reduce_scatter_tensor(out, x.contiguous(), group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if comm.size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_grad_is_partial):
        ctx.group = group
        ctx.output_grad_is_partial = output_grad_is_partial
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.output_grad_is_partial:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        comm.all_to_all_uneven(out, x, group, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        comm.all_to_all_uneven(out, grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits)
        return out, None, None, None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToTP.apply(x, group) if comm.size(group) > 1 else x


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromTP.apply(x, group) if comm.size(group) > 1 else x


def scatter_to_tensor_parallel_region(x, group):
    return _ScatterToTP.apply(x, group) if comm.size(group) > 1 else x


def gather_from_tensor_parallel_region(x, group):
    return _GatherFromTP.apply(x, group) if comm.size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSP.apply(x, group) if comm.size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, output_grad_is_partial: bool = True):
    """All-gather along the sequence. `output_grad_is_partial`: the gradient arriving in backward is
    a per-rank partial sum (it feeds a tensor-parallel GEMM), so it is reduce-scattered; otherwise
    every rank holds the full gradient and just keeps its chunk."""
    return _GatherFromSP.apply(x, group, output_grad_is_partial) if comm.size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSP.apply(x, group) if comm.size(group) > 1 else x


def all_to_all(x, group, output_splits: list, input_splits: list):
    """Rows input_splits[j] of x go to rank j; returns the output_splits[j] rows from each rank j
    (in rank order). Backward sends the gradients back the same way (mixture-of-experts dispatch)."""
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits)) if comm.size(group) > 1 else x
