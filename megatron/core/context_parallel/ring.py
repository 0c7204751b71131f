"""`p2p` context parallelism: ring attention over the load-balanced layout.

Each CP rank holds queries, keys and values of its two chunks (r and 2C-1-r, see `layout`). The
key/value blocks travel round the ring of CP ranks: at step i rank r holds the block of rank
src = r - i (mod C) and attends to it, while the block for step i+1 is already on the wire.
Which part of the work a step needs follows from the chunk order, and every step has the same
cost (half of a local block-pair), so no rank waits for another:

    step 0 (own block):  causal attention over the local sequence (chunk r precedes 2C-1-r)
    src < r:             all local queries  x  the first chunk of src (src); its second chunk is later
    src > r:             the second local chunk (2C-1-r) x both chunks of src; chunk r sees neither

Fully masked blocks are never computed, and only the diagonal (step 0) uses the causal kernel.
Partial results merge by their log-sum-exp (`merge`). The backward runs the ring again: the
key/value blocks travel as in forward, each with a running fp32 dK/dV accumulator that follows its
block round the ring and is sent home after the last step.
"""
import torch

from megatron.core.context_parallel import kernels
from megatron.core.context_parallel.merge import empty_partial, merge_block
from megatron.core.distributed import comm

_ALL = slice(None)


def step_blocks(step: int, cp_rank: int, cp_size: int, local_length: int) -> tuple:
    """(query rows, key rows, causal) of the block attended at `step` (rows of the local sequence of
    this rank and of the source rank); None when nothing is attended (never, for this layout)."""
    half = local_length // 2
    if step == 0:
        return _ALL, _ALL, True
    source = (cp_rank - step) % cp_size
    if source < cp_rank:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def ring_forward(q, k, v, group, kernel: str) -> tuple:
    """q [b, nq, s, d], k/v [b, nkv, s, d] (this rank's chunks) -> (out [b, nq, s, d], lse fp32, states)."""
    size, rank = comm.size(group), comm.rank(group)
    out, lse = empty_partial(q)
    kv = torch.stack([k, v])
    states = []
    for step in range(size):
        handles, incoming = [], None
        if step < size - 1:
            incoming = torch.empty_like(kv)
            handles = comm.ring_exchange(kv, incoming, group)
        rows, cols, causal = step_blocks(step, rank, size, q.shape[2])
        block_out, block_lse, state = kernels.block_forward(kernel, q[:, :, rows], kv[0][:, :, cols],
                                                            kv[1][:, :, cols], causal)
        merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        states.append(state)
        comm.wait_all(handles)
        kv = incoming if incoming is not None else kv
    return out.to(q.dtype), lse, states


def ring_backward(dout, q, k, v, out, lse, group, kernel: str, states: list) -> tuple:
    size, rank = comm.size(group), comm.rank(group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv = None  # accumulator of the block in hand (owned by rank - step)
    for step in range(size):
        handles, incoming, incoming_dkv = [], None, None
        if step < size - 1:
            incoming = torch.empty_like(kv)
            handles += comm.ring_exchange(kv, incoming, group)
        if step > 0:  # the previous step's accumulator moves on with its block
            incoming_dkv = torch.empty_like(dkv)
            handles += comm.ring_exchange(dkv, incoming_dkv, group)
        rows, cols, causal = step_blocks(step, rank, size, q.shape[2])
        dq_block, dk_block, dv_block = kernels.block_backward(
            kernel, dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
            lse[:, :, rows], causal, states[step])
        dq[:, :, rows] += dq_block
        comm.wait_all(handles)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if step == 0 else incoming_dkv
        dkv[0][:, :, cols] += dk_block
        dkv[1][:, :, cols] += dv_block
        kv = incoming if incoming is not None else kv
    if size > 1:  # the last accumulator belongs to the next rank; ours arrives from the previous one
        home = torch.empty_like(dkv)
        comm.wait_all(comm.ring_exchange(dkv, home, group))
        dkv = home
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, kernel):
        out, lse, states = ring_forward(q, k, v, group, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.states = group, kernel, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.kernel, ctx.states)
        return dq, dk, dv, None, None


def ring_attention(q, k, v, group, kernel: str) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (context-parallel) sequence."""
    return _RingAttention.apply(q, k, v, group, kernel)
