"""Packed documents under context parallelism (--sft conversations): each query attends only to the
keys at or before it in its own document, across the whole context-parallel sequence.

The ring, all-gather and all-to-all schemes attend whole chunks with the causal kernel and know no
document boundaries. With a document mask, every rank instead gathers the keys and values of the
whole sequence (an all-gather over the CP group whose backward reduce-scatters dK/dV, as
`all_gather` does) and attends its own queries to them under a boolean mask built from the global
positions and the gathered document ids: [b, 1, s/C, s] per micro-batch, s x s / C booleans, in
place of the block kernels' log-sum-exp merge. Packed conversations are padded so that each is a
multiple of 2 x CP tokens (megatron/core/datasets/sft.py), so the load-balanced split cuts every
one evenly.
"""
import torch
import torch.nn.functional as F

from megatron.core.context_parallel.layout import local_positions, to_sequence_order
from megatron.core.distributed import comm
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def _gather_sequence(x: torch.Tensor, cp_group) -> torch.Tensor:
    """[s/C, ...] local (rank order) -> [s, ...] whole sequence in natural order; not differentiable."""
    size = comm.size(cp_group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, x.contiguous(), cp_group)
    return to_sequence_order(out, 0, size)


def context_parallel_document_mask(document_ids: torch.Tensor, cp_group) -> torch.Tensor:
    """[b, 1, s/C, s] bool from this rank's document ids [b, s/C] (its two chunks, local order):
    query i (local) may attend key j (global) when j is at or before i's global position and in
    i's document."""
    size, rank = comm.size(cp_group), comm.rank(cp_group)
    local = document_ids.shape[1]
    whole = _gather_sequence(document_ids.t(), cp_group).t()  # [b, s]
    query_positions = local_positions(local * size, size, rank, device=document_ids.device)  # [s/C]
    key_positions = torch.arange(local * size, device=document_ids.device)  # [s]
    causal = query_positions.unsqueeze(-1) >= key_positions.unsqueeze(0)  # [s/C, s]
    same_document = document_ids.unsqueeze(-1) == whole.unsqueeze(-2)  # [b, s/C, s]
    return (causal & same_document).unsqueeze(1)


def document_masked_attention(q, k, v, mask: torch.Tensor, cp_group) -> torch.Tensor:
    """q: [b, nq, s/C, d], k/v: [b, nkv, s/C, d] (this rank's chunks), mask [b, 1, s/C, s] ->
    [b, nq, s/C, d]: this rank's queries over the keys and values of the whole sequence."""
    size = comm.size(cp_group)

    def whole(x):  # [b, n, s/C, d] -> [b, n, s, d], natural order; backward reduce-scatters
        gathered = gather_from_sequence_parallel_region(x.permute(2, 0, 1, 3), cp_group)  # [s, b, n, d], rank order
        return to_sequence_order(gathered, 0, size).permute(1, 2, 0, 3)

    return F.scaled_dot_product_attention(q, whole(k), whole(v), attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
