"""Context parallelism on one process: the chunk layout, and the block decomposition and merge of the
ring (`p2p`) and `all_gather` schemes replayed rank by rank against full causal attention.

The multi-process runs (real communication, whole models) are in tests/distributed/test_context_parallel.py.
"""
import pytest
import torch

from megatron.core.context_parallel import check_context_parallel, local_positions, slice_batch, slice_sequence
from megatron.core.context_parallel import all_gather as all_gather_scheme
from megatron.core.context_parallel.kernels import CPU_FLASH, block_backward, block_forward
from megatron.core.context_parallel.layout import chunk_ids, to_rank_order, to_sequence_order
from megatron.core.context_parallel.merge import empty_partial, merge_block
from megatron.core.context_parallel.ring import step_blocks

SEQ, BATCH, HEADS, DIM = 32, 2, 4, 8


def test_chunk_layout_balances_causal_work():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (2, 4):
        held = torch.cat([local_positions(SEQ, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(SEQ))
        # Causal work of a token = its position + 1; every rank gets the same total.
        work = {sum(p + 1 for p in local_positions(SEQ, cp, r).tolist()) for r in range(cp)}
        assert len(work) == 1


def test_slice_batch_and_chunk_permutations():
    batch = {"tokens": torch.arange(2 * 16).view(2, 16), "position_ids": torch.arange(16).expand(2, 16)}
    sliced = slice_batch(batch, 2, 1)
    assert sliced["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sliced["tokens"][1].tolist() == [20, 21, 22, 23, 24, 25, 26, 27]
    x = torch.randn(3, SEQ, 5)
    rank_order = torch.cat([slice_sequence(x, 1, 4, r) for r in range(4)], dim=1)
    assert torch.equal(to_sequence_order(rank_order, 1, 4), x)
    assert torch.equal(to_rank_order(x, 1, 4), rank_order)
    documents = slice_batch({**batch, "document_ids": torch.arange(16).expand(2, 16) // 5}, 2, 1)
    assert documents["document_ids"][0].tolist() == [0, 1, 1, 1, 1, 1, 2, 2]  # positions 4..11, like the tokens
    with pytest.raises(ValueError, match=r"--seq-length \(12\) must be divisible by 2 x --context-parallel-size \(4\)"):
        local_positions(12, 4, 0)


def _full_attention(groups: int):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, requires_grad=True)
    k = torch.randn(BATCH, HEADS // groups, SEQ, DIM, generator=generator, requires_grad=True)
    v = torch.randn(BATCH, HEADS // groups, SEQ, DIM, generator=generator, requires_grad=True)
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) / DIM ** 0.5
    scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(groups, 1)
    dout = torch.randn(out.shape, generator=generator)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return dict(q=q.detach(), k=k.detach(), v=v.detach(), out=out.detach(), lse=scores.logsumexp(-1).detach(),
                dout=dout, dq=dq, dk=dk, dv=dv)


def _ring_blocks(cp: int, rank: int) -> list:
    """(local query rows, key positions, causal) of every block rank `rank` attends in the ring."""
    local_length = SEQ // cp
    blocks = []
    for step in range(cp):
        rows, cols, causal = step_blocks(step, rank, cp, local_length)
        source = local_positions(SEQ, cp, (rank - step) % cp)
        blocks.append((rows, source[cols], causal))
    return blocks


def _all_gather_blocks(cp: int, rank: int) -> list:
    return [(rows, torch.arange(SEQ)[cols], causal)
            for rows, cols, causal in all_gather_scheme.attended_blocks(cp, rank, SEQ // cp)]


def _replay(full: dict, blocks_of, cp: int) -> None:
    """Each rank's blocks, attended with the kernel and merged, give its rows of the full output and
    log-sum-exp; each block's backward from the merged output sums to the full gradients."""
    dk, dv = torch.zeros_like(full["k"]), torch.zeros_like(full["v"])
    for rank in range(cp):
        rows = local_positions(SEQ, cp, rank)
        q = full["q"][:, :, rows]
        out, lse = empty_partial(q)
        blocks = blocks_of(cp, rank)
        for q_rows, k_pos, causal in blocks:
            block_out, block_lse, _ = block_forward(CPU_FLASH, q[:, :, q_rows], full["k"][:, :, k_pos],
                                                    full["v"][:, :, k_pos], causal)
            merge_block(out[:, :, q_rows], lse[:, :, q_rows], block_out, block_lse)
        torch.testing.assert_close(out, full["out"][:, :, rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, full["lse"][:, :, rows], rtol=1e-5, atol=1e-6)
        dq = torch.zeros_like(q)
        for q_rows, k_pos, causal in blocks:
            grads = block_backward(CPU_FLASH, full["dout"][:, :, rows[q_rows]], q[:, :, q_rows], full["k"][:, :, k_pos],
                                   full["v"][:, :, k_pos], out[:, :, q_rows], lse[:, :, q_rows], causal, None)
            dq[:, :, q_rows] += grads[0]
            dk[:, :, k_pos] += grads[1]
            dv[:, :, k_pos] += grads[2]
        torch.testing.assert_close(dq, full["dq"][:, :, rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, full["dk"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv, full["dv"], rtol=1e-5, atol=1e-6)


def _assert_blocks_cover_the_causal_mask_once(blocks_of, cp: int) -> None:
    """No fully masked block is computed, non-causal blocks are fully visible, causal blocks are
    diagonal (same positions for queries and keys), and together they cover every visible pair once."""
    for rank in range(cp):
        covered = torch.zeros(SEQ, SEQ, dtype=torch.int64)
        for q_rows, k_pos, causal in blocks_of(cp, rank):
            q_pos = local_positions(SEQ, cp, rank)[q_rows]
            visible = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)
            if causal:
                assert torch.equal(q_pos, k_pos)
                covered[q_pos.unsqueeze(1), k_pos.unsqueeze(0)] += visible.long()
            else:
                assert visible.all(), (rank, q_pos.tolist(), k_pos.tolist())
                covered[q_pos.unsqueeze(1), k_pos.unsqueeze(0)] += 1
        rows = local_positions(SEQ, cp, rank)
        expected = torch.zeros(SEQ, SEQ, dtype=torch.int64)
        expected[rows] = torch.ones(SEQ, SEQ, dtype=torch.int64).tril()[rows]
        assert torch.equal(covered, expected), rank


@pytest.mark.parametrize("scheme", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("groups", [1, 4])  # 4 query heads per key/value group: GQA with 1 group < cp
def test_blocks_merge_to_full_causal_attention(scheme, cp, groups):
    blocks_of = _ring_blocks if scheme == "p2p" else _all_gather_blocks
    _assert_blocks_cover_the_causal_mask_once(blocks_of, cp)
    _replay(_full_attention(groups), blocks_of, cp)


def test_ring_steps_are_balanced():
    """Every step but the first attends half of the local queries to the whole source block or all of
    them to half of it: the same number of scores, so no rank waits for another."""
    for cp in (2, 4, 8):
        for rank in range(cp):
            for step in range(1, cp):
                rows, cols, causal = step_blocks(step, rank, cp, 8)
                assert not causal
                assert len(range(8)[rows]) * len(range(8)[cols]) == 32


def test_merge_is_order_independent():
    generator = torch.Generator().manual_seed(3)
    parts = [(torch.randn(1, 2, 5, 4, generator=generator), torch.randn(1, 2, 5, generator=generator))
             for _ in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1]):
        out, lse = empty_partial(parts[0][0])
        for index in order:
            merge_block(out, lse, *parts[index])
        results.append((out, lse))
    torch.testing.assert_close(results[0], results[1])
    expected_lse = torch.stack([p[1] for p in parts]).logsumexp(0)
    torch.testing.assert_close(results[0][1], expected_lse)


@pytest.mark.parametrize("kwargs, message", [
    (dict(comm_type="a2a+p2p"), r"--cp-comm-type a2a\+p2p \(hierarchical all-to-all \+ ring\) is not built"),
    (dict(comm_type="ring"), r"--cp-comm-type must be one of p2p, all_gather, a2a, a2a\+p2p, got 'ring'"),
    (dict(comm_type="a2a", num_local_heads=6, cp_size=4), r"query heads per tensor-parallel rank \(6"),
    (dict(comm_type="a2a", num_local_groups=2, cp_size=4), r"key/value groups per tensor-parallel rank \(2"),
    (dict(attention_dropout=0.1), r"--attention-dropout \(0.1\) must be 0 with --context-parallel-size 2"),
    (dict(seq_length=10), r"--seq-length \(10\) must be divisible by 2 x --context-parallel-size \(2\) = 4"),
])
def test_what_context_parallelism_refuses(kwargs, message):
    arguments = dict(cp_size=2, comm_type="p2p", num_local_heads=8, num_local_groups=4) | kwargs
    with pytest.raises(ValueError, match=message):
        check_context_parallel(**arguments)


def test_a2a_accepts_divisible_heads_and_cp1_accepts_anything():
    check_context_parallel(cp_size=2, comm_type="a2a", num_local_heads=8, num_local_groups=2, seq_length=8)
    check_context_parallel(cp_size=1, comm_type="a2a+p2p", num_local_heads=3, num_local_groups=1, attention_dropout=0.1)


def test_pipeline_activation_shape_splits_the_sequence_over_cp_and_sequence_parallel_ranks():
    from types import SimpleNamespace

    from megatron.core.parallel_state import ParallelGroups
    from megatron.training.training import _activation_shape

    def shape(cp, tp, sequence_parallel):
        return _activation_shape(
            SimpleNamespace(seq_length=64, micro_batch_size=2), ParallelGroups(cp_size=cp, tp_size=tp),
            SimpleNamespace(config=SimpleNamespace(hidden_size=8),
                            execution=SimpleNamespace(sequence_parallel=sequence_parallel)))

    assert shape(2, 1, False) == (32, 2, 8)
    assert shape(4, 2, True) == (8, 2, 8)
    assert shape(2, 2, False) == (32, 2, 8)
