"""`a2a` context parallelism (DeepSpeed Ulysses): trade the sequence split for a head split.

An all-to-all turns each rank's [its chunks, all local heads] into [the whole sequence, 1/C of the
heads]; ordinary causal attention runs on that (any kernel, no merge); a second all-to-all turns
the output back. Backward is the same two all-to-alls in reverse (an all-to-all is its own
adjoint). It needs the local query heads and key/value groups to divide by C, and moves
q, k, v and the output once each, whatever C: cheap on fast links, and the attention kernel sees
the whole sequence.
"""
import torch
import torch.nn.functional as F

from megatron.core.context_parallel.layout import to_rank_order, to_sequence_order
from megatron.core.distributed import comm

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class _AllToAll(torch.autograd.Function):
    """Dim-0 chunk j goes to rank j; chunk j of the result came from rank j."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x.contiguous(), group) if comm.size(group) > 1 else x


def _causal_attention(q, k, v):
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)


def a2a_attention(q, k, v, group) -> torch.Tensor:
    """q [b, nq, s, d], k/v [b, nkv, s, d] (this rank's chunks) -> [b, nq, s, d]."""
    size = comm.size(group)
    b, nq, s, d = q.shape
    nkv = k.shape[1]

    def by_destination(x):  # [b, n, s, d] -> [C, b, n/C, s, d]: head group j goes to rank j
        return x.reshape(b, size, x.shape[1] // size, s, d).transpose(0, 1)

    packed = torch.cat([by_destination(q), by_destination(k), by_destination(v)], dim=2)
    received = all_to_all(packed, group)  # [C (source rank), b, heads/C, s, d]
    heads = received.shape[2]
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, heads, size * s, d)
    whole = to_sequence_order(whole, 2, size)
    q_, k_, v_ = whole.split([nq // size, nkv // size, nkv // size], dim=1)
    out = to_rank_order(_causal_attention(q_, k_, v_), 2, size)  # [b, nq/C, C*s, d]
    out = out.reshape(b, nq // size, size, s, d).permute(2, 0, 1, 3, 4)  # [C (destination), b, nq/C, s, d]
    back = all_to_all(out, group)  # [C (head group), b, nq/C, s, d]
    return back.permute(1, 0, 2, 3, 4).reshape(b, nq, s, d)
