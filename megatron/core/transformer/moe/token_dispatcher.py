"""Token dispatchers: bring each token to the ranks holding its experts, sorted by expert, and back.

    dispatch: hidden [T, h], probs [T, E], routing_map [T, E]
              -> tokens [N, h] sorted by local expert, tokens_per_expert, probs [N]
    combine:  expert outputs [N, h] (already weighted by probs) -> hidden [T, h], summed over experts

`allgather` (--moe-token-dispatcher-type allgather): the etp x ep ranks all-gather every token with
its routing, each keeps the tokens routed to its own experts, and the outputs return by a
reduce-scatter (which also adds the expert-tensor-parallel partial sums).
`alltoall`: each rank sends each token only to the ranks holding its chosen experts (all-to-all
over ep), then expert-tensor-parallel ranks all-gather what each of them received (each holds a part
of every local expert); combine runs the same steps back, summing the etp partial sums.

Communication is only through `tensor_parallel.mappings` (paired autograd collectives).
"""
import torch

from megatron.core.distributed import comm
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

DISPATCHER_TYPES = ("allgather", "alltoall")


def permute(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Rows of `hidden` [T, h] repeated once per chosen expert and sorted by expert (then token):
    (tokens [N, h], probs [N], token index of each row [N], tokens per expert [E])."""
    expert_major = routing_map.t()                           # [E, T]
    token_index = expert_major.nonzero()[:, 1]               # expert-major order
    permuted_probs = probs.t().masked_select(expert_major)   # same order
    return hidden.index_select(0, token_index), permuted_probs, token_index, expert_major.sum(dim=1)


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The inverse of `permute` with the copies of a token summed: [N, h] -> [T, h]."""
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, token_index, rows)


class AllGatherDispatcher:
    def __init__(self, *, num_local_experts: int, expert_offset: int, group):
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.group = group  # etp x ep

    def dispatch(self, hidden, probs, routing_map):
        hidden = gather_from_sequence_parallel_region(hidden, self.group)     # [T*g, h]
        probs = gather_from_sequence_parallel_region(probs, self.group)       # [T*g, E]
        routing_map = _all_gather_rows(routing_map, self.group)
        local = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
        tokens, tokens_probs, self.token_index, per_expert = permute(hidden, probs[:, local], routing_map[:, local])
        self.num_tokens = hidden.shape[0]
        return tokens, per_expert.tolist(), tokens_probs

    def combine(self, expert_output):
        out = unpermute(expert_output, self.token_index, self.num_tokens)
        return reduce_scatter_to_sequence_parallel_region(out, self.group)   # [T, h]


class AllToAllDispatcher:
    def __init__(self, *, num_local_experts: int, ep_group, etp_group):
        self.num_local_experts = num_local_experts
        self.ep_group, self.etp_group = ep_group, etp_group

    def dispatch(self, hidden, probs, routing_map):
        ep = comm.size(self.ep_group)
        tokens, tokens_probs, self.token_index, per_expert = permute(hidden, probs, routing_map)  # all E experts
        self.num_tokens = hidden.shape[0]
        # per_expert [E] -> how many rows go to each ep rank, and how many come back per (rank, expert).
        send_counts = per_expert.view(ep, self.num_local_experts)             # [ep, E_local]
        recv_counts = _exchange_counts(send_counts, self.ep_group)            # [ep, E_local]
        self.send_splits = send_counts.sum(dim=1).tolist()
        self.recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all(tokens, self.ep_group, self.recv_splits, self.send_splits)
        received_probs = all_to_all(tokens_probs.unsqueeze(-1), self.ep_group, self.recv_splits,
                                    self.send_splits).squeeze(-1)
        # Rows arrive grouped by source rank, then expert; the experts want them by expert, then rank.
        # With etp > 1 the etp ranks' received rows are all-gathered: [etp rank][ep rank][expert].
        etp = comm.size(self.etp_group)
        all_counts = _all_gather_rows(recv_counts.reshape(1, -1), self.etp_group).view(etp * ep, -1)
        self.etp_splits = all_counts.sum(dim=1).view(etp, ep).sum(dim=1).tolist()
        received = self._gather_etp(received)
        received_probs = self._gather_etp(received_probs.unsqueeze(-1)).squeeze(-1)
        self.to_expert_order = _chunk_order(all_counts.reshape(-1), self.num_local_experts, etp * ep)
        received = received.index_select(0, self.to_expert_order)
        received_probs = received_probs.index_select(0, self.to_expert_order)
        return received, all_counts.sum(dim=0).tolist(), received_probs

    def combine(self, expert_output):
        back = torch.empty_like(expert_output).index_copy(0, self.to_expert_order, expert_output)
        back = self._reduce_scatter_etp(back)
        returned = all_to_all(back, self.ep_group, self.send_splits, self.recv_splits)
        return unpermute(returned, self.token_index, self.num_tokens)

    def _gather_etp(self, rows):
        """All-gather of uneven row counts over etp, as an all-to-all of copies (backward: the
        copies' gradients come back and are summed, a reduce-scatter)."""
        etp = comm.size(self.etp_group)
        if etp == 1:
            return rows
        return all_to_all(rows.repeat(etp, *([1] * (rows.dim() - 1))), self.etp_group, self.etp_splits,
                          [rows.shape[0]] * etp)

    def _reduce_scatter_etp(self, rows):
        etp = comm.size(self.etp_group)
        if etp == 1:
            return rows
        mine = self.etp_splits[comm.rank(self.etp_group)]
        copies = all_to_all(rows, self.etp_group, [mine] * etp, self.etp_splits)
        return copies.view(etp, mine, *rows.shape[1:]).sum(dim=0)


def _chunk_order(counts: torch.Tensor, inner: int, outer: int) -> torch.Tensor:
    """Row indices that reorder chunks laid out [outer][inner] (sizes `counts`, flattened) into
    [inner][outer] order."""
    starts = torch.cumsum(counts, 0) - counts
    pieces = [torch.arange(starts[o * inner + i], starts[o * inner + i] + counts[o * inner + i], device=counts.device)
              for i in range(inner) for o in range(outer)]
    return torch.cat(pieces) if pieces else counts.new_zeros((0,))


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 of a tensor without gradient (counts, routing maps)."""
    if comm.size(group) == 1:
        return x
    as_int = x.to(torch.int64) if x.dtype == torch.bool else x
    out = as_int.new_empty((comm.size(group) * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, as_int.contiguous(), group)
    return out.bool() if x.dtype == torch.bool else out


def _exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """[ep, E_local] rows this rank sends to each rank's experts -> rows it receives from each rank."""
    if comm.size(group) == 1:
        return send_counts
    received = torch.empty_like(send_counts)
    comm.all_to_all_single(received, send_counts.contiguous(), group)
    return received
