"""`all_gather` context parallelism: gather K/V over the CP group, attend locally, reduce-scatter dK/dV.

Each rank gathers every rank's key/value chunks (in rank order, then permuted to the natural
order), and attends each of its two query chunks (global index m) to the keys before it: the
chunks 0..m-1 in full, chunk m with the causal kernel; the two parts merge by log-sum-exp. The
gathered K/V are not kept for backward (only the local ones): backward gathers them again, then
reduce-scatters dK/dV so each rank receives the sum of every rank's gradient for its own chunks.
The gather cannot overlap the attention (unlike `p2p`), but it is one collective, which suits
small CP groups on fast links.
"""
import torch

from megatron.core.context_parallel import kernels
from megatron.core.context_parallel.layout import chunk_ids, to_rank_order, to_sequence_order
from megatron.core.context_parallel.merge import empty_partial, merge_block
from megatron.core.distributed import comm


def _gather_kv(k, v, group) -> torch.Tensor:
    """[2, b, nkv, C*s, d]: every rank's K and V, in the natural sequence order."""
    size = comm.size(group)
    kv = torch.stack([k, v])  # [2, b, nkv, s, d]
    gathered = kv.new_empty((size * 2, *kv.shape[1:]))
    comm.all_gather_into_tensor(gathered, kv, group)
    two, b, n, s, d = kv.shape
    gathered = gathered.view(size, two, b, n, s, d).permute(1, 2, 3, 0, 4, 5).reshape(two, b, n, size * s, d)
    return to_sequence_order(gathered, 3, size)


def attended_blocks(cp_size: int, cp_rank: int, local_length: int) -> list:
    """(query rows, key rows of the whole sequence, causal) of every block this rank attends."""
    chunk = local_length // 2
    blocks = []
    for half, m in enumerate(chunk_ids(cp_size, cp_rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        blocks.append((rows, slice(m * chunk, (m + 1) * chunk), True))
        if m > 0:
            blocks.append((rows, slice(0, m * chunk), False))
    return blocks


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel):
        size, rank = comm.size(group), comm.rank(group)
        kv = _gather_kv(k, v, group)
        out, lse = empty_partial(q)
        states = []
        for rows, cols, causal in attended_blocks(size, rank, q.shape[2]):
            block_out, block_lse, state = kernels.block_forward(kernel, q[:, :, rows], kv[0][:, :, cols],
                                                                kv[1][:, :, cols], causal)
            merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            states.append(state)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.states = group, kernel, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size, rank = comm.size(group), comm.rank(group)
        dout = dout.contiguous()
        kv = _gather_kv(k, v, group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for (rows, cols, causal), state in zip(attended_blocks(size, rank, q.shape[2]), ctx.states):
            dq_block, dk_block, dv_block = kernels.block_backward(
                ctx.kernel, dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                lse[:, :, rows], causal, state)
            dq[:, :, rows] += dq_block
            dkv[0][:, :, cols] += dk_block
            dkv[1][:, :, cols] += dv_block
        two, b, n, total, d = dkv.shape
        per_rank = to_rank_order(dkv, 3, size).view(two, b, n, size, total // size, d)
        per_rank = per_rank.permute(3, 0, 1, 2, 4, 5).reshape(size * two, b, n, total // size, d)
        mine = dkv.new_empty((two, b, n, total // size, d))
        comm.reduce_scatter_tensor(mine, per_rank, group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


def all_gather_attention(q, k, v, group, kernel: str) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (context-parallel) sequence."""
    return _AllGatherAttention.apply(q, k, v, group, kernel)
