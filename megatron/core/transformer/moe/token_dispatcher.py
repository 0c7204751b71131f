"""Token dispatchers: bring each token to the ranks holding its experts, sorted by expert, and back.

    dispatch: hidden [T, h], probs [T, E], routing_map [T, E]
              -> rows [N, h] sorted by local expert, tokens_per_expert [E_local] (a device tensor)
    combine:  expert outputs [N, h] -> hidden [T, h]: each row weighted by its routing probability
              and summed into its token (each token's top-k rows gathered and summed; a scatter-add
              where tokens have no fixed number of rows: padded or capacity-padded routing)

The permutation has static shapes: each token has top-k slots, so N = T x topk rows (x the ranks
whose tokens an all-gather brought); one stable sort of the slots' expert indices orders them by
expert, then token, and one gather builds the rows. Slots that carry nothing for this rank's experts
(tokens dropped by capacity; experts of other ranks under the all-gather dispatcher) sort into a
sentinel group after the last expert, which the grouped GEMMs' offsets leave out. So neither the
routing nor `tokens_per_expert` ever comes back to the host: at EP 1 and with the all-gather
dispatcher the layer makes no host synchronization. Only --moe-pad-expert-input-to-capacity (rows
per expert fixed, per token not) still counts its rows on the host.

--moe-router-padding-for-fp8 (FP8 experts, alltoall dispatcher) pads the routing map instead of the
experts' rows, as Megatron-Core does: each expert is also given the first tokens (in token order) not
routed to it, with probability 0, until its count is a multiple of the FP8 alignment (16). A token
then fills more than top-k slots, so the rows are taken expert-major from the [E, T] map: at most
T x topk + E x 15 of them (rounded up to a multiple of 16), the rest in the sentinel group.

`allgather` (--moe-token-dispatcher-type allgather): the etp x ep ranks all-gather every token with
its routing, each keeps the tokens routed to its own experts, and the outputs return by a
reduce-scatter (which also adds the expert-tensor-parallel partial sums).
`alltoall`: each rank sends each token only to the ranks holding its chosen experts (all-to-all
over ep), then expert-tensor-parallel ranks all-gather what each of them received (each holds a part
of every local expert); combine runs the same steps back, summing the etp partial sums. Its split
sizes come back to the host once per layer and micro-batch (all of them in one read); the routing
probabilities stay on the token's rank and weight the returned rows there.

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
    (tokens [N, h], probs [N], token index of each row [N], tokens per expert [E]). N is the number
    of routed entries, read back from the device (`nonzero`): only routing maps of no fixed size per
    token (--moe-pad-expert-input-to-capacity) take this path; `permute_static` serves the others."""
    expert_major = routing_map.t()                           # [E, T]
    token_index = expert_major.nonzero()[:, 1]               # expert-major order
    permuted_probs = probs.t().masked_select(expert_major)   # same order
    return hidden.index_select(0, token_index), permuted_probs, token_index, expert_major.sum(dim=1)


def sort_by_expert(probs: torch.Tensor, routing_map: torch.Tensor, *, topk: int, first_expert: int = 0,
                   num_experts: int, may_drop: bool):
    """The permutation of a routing in static shapes: each token has `topk` slots, N = T x topk rows.

    Returns (token index of each row [N], its probability [N], tokens per expert [num_experts] on the
    device, row_valid [N] or None, slot_row [N]). Rows are sorted by expert (experts first_expert ..
    first_expert + num_experts - 1), then by token, with one sort. With `may_drop` (capacity, or
    experts held by other ranks) a slot whose entry was dropped or whose expert is not among these
    goes to a sentinel group after the last expert: those rows are at the end, past the last GEMM
    offset, and `row_valid` marks them False. `slot_row` is the inverse permutation: the row of token
    t's j-th slot at t x topk + j (what lets the combine and the dispatch's backward gather a token's
    rows and sum them instead of scattering, `_SumSlots`)."""
    present, chosen = routing_map.to(torch.uint8).topk(topk, dim=1)   # [T, k] each token's slots
    slot_probs = probs.gather(1, chosen)                               # [T, k]
    local = chosen - first_expert
    if may_drop:
        valid = present.bool() & (local >= 0) & (local < num_experts)
        local = local.masked_fill(~valid, num_experts)                 # the sentinel group sorts last
    order = torch.argsort(local.reshape(-1), stable=True)              # [N]: by expert, then token
    token_index = torch.div(order, topk, rounding_mode="floor")
    row_probs = slot_probs.reshape(-1).index_select(0, order)
    tokens_per_expert = routing_map[:, first_expert:first_expert + num_experts].sum(dim=0)
    row_valid = local.reshape(-1).index_select(0, order) < num_experts if may_drop else None
    slot_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return token_index, row_probs, tokens_per_expert, row_valid, slot_row


def pad_routing_map(routing_map: torch.Tensor, multiple: int) -> torch.Tensor:
    """[T, E] bool -> [T, E]: each expert's count rounded up to a multiple of `multiple` by routing to
    it the first tokens not yet routed to it (Megatron-Core's pad_routing_map). It always succeeds
    when T is a multiple of `multiple` (an expert short of r entries then has at least r free tokens)."""
    missing = (-routing_map.sum(dim=0)) % multiple                   # [E] entries to add per expert
    free_rank = (~routing_map).cumsum(dim=0)                         # [T, E] 1, 2, ... over free tokens
    return routing_map | (~routing_map & (free_rank <= missing))


def sort_padded_by_expert(probs: torch.Tensor, routing_map: torch.Tensor, *, topk: int, first_expert: int,
                          num_experts: int, multiple: int):
    """`sort_by_expert` for a routing map padded by `pad_routing_map` (some tokens then have more
    than `topk` entries): one stable sort of the [E, T] map's entries by expert, the entries not set
    last (the sentinel group), keeping N = min(T x topk + E x (multiple - 1), E x T) rows, a bound on
    the set entries (routed ones at most T x topk, padding under `multiple` per expert), rounded up to
    a multiple of `multiple` (the FP8 grouped GEMMs take the [n, N] transposes only with 16-byte
    aligned rows). Same outputs; row_valid is always given. Padding rows carry probability 0 (`probs`
    is 0 off the routing)."""
    local_map = routing_map[:, first_expert:first_expert + num_experts]          # [T, E]
    num_tokens = local_map.shape[0]
    bound = num_tokens * topk + num_experts * (multiple - 1)
    num_rows = min(-(-bound // multiple) * multiple, num_tokens * num_experts)
    experts = torch.arange(num_experts, device=routing_map.device).view(-1, 1)
    key = torch.where(local_map.t(), experts, num_experts).reshape(-1)          # [E*T] expert-major
    order = torch.argsort(key, stable=True)[:num_rows]                          # by expert, then token
    token_index = order % num_tokens
    row_probs = probs[:, first_expert:first_expert + num_experts].t().reshape(-1).index_select(0, order)
    row_valid = key.index_select(0, order) < num_experts
    return token_index, row_probs, local_map.sum(dim=0), row_valid


def gather_rows(hidden: torch.Tensor, token_index: torch.Tensor, row_valid=None, slot_row=None) -> torch.Tensor:
    """hidden [T, h] -> the permuted rows [N, h] (one gather). Sentinel rows are zeros, so that what
    the experts leave in them (their GEMMs stop at the last offset) never reaches hidden's gradient.
    Given `slot_row` (every token has exactly N / T rows) the backward gathers each token's rows and
    sums them (`_CopySlots`) instead of scattering them with atomic adds."""
    if slot_row is not None:
        rows = _CopySlots.apply(hidden, token_index, slot_row)
    else:
        rows = hidden.index_select(0, token_index)
    if row_valid is not None:
        rows = torch.where(row_valid.unsqueeze(-1), rows, 0)
    return rows


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int, probs=None,
              row_valid=None, slot_row=None) -> torch.Tensor:
    """The inverse of the permutation with the copies of a token summed: [N, h] -> [T, h], each row
    weighted by its routing probability `probs` [N] on the way. Sentinel rows (`row_valid` False)
    add nothing. Given `slot_row` (every token has exactly N / T rows): one gather of each token's
    rows and a sum over them, in a fixed order (`_SumSlots`); else one scatter-add."""
    if row_valid is not None:
        rows = torch.where(row_valid.unsqueeze(-1), rows, 0)
    if probs is not None:
        rows = rows * probs.unsqueeze(-1).to(rows.dtype)
    if slot_row is not None:
        return _SumSlots.apply(rows, token_index, slot_row, num_tokens)
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, token_index, rows)


def _sum_slots(rows: torch.Tensor, slot_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """rows [N, h] -> [T, h]: token t's sum of rows slot_row[t k .. t k + k - 1] (k = N / T), gathered
    and summed over k in order (fp32 sums for 16-bit rows, one rounding): no atomic adds."""
    return rows.index_select(0, slot_row).view(num_tokens, -1, rows.shape[-1]).sum(dim=1)


class _CopySlots(torch.autograd.Function):
    """hidden [T, h] -> rows [N, h], row i a copy of token token_index[i], each token in N / T rows
    (`slot_row` [N], the inverse permutation, lists them token by token). Backward: each token's
    gradient is the sum of its rows' (`_sum_slots`: a gather and a sum, where index_select's own
    backward scatters with atomic adds)."""

    @staticmethod
    def forward(ctx, hidden, token_index, slot_row):
        ctx.save_for_backward(slot_row)
        ctx.num_tokens = hidden.shape[0]
        return hidden.index_select(0, token_index)

    @staticmethod
    def backward(ctx, grad):
        (slot_row,) = ctx.saved_tensors
        return _sum_slots(grad, slot_row, ctx.num_tokens), None, None


class _SumSlots(torch.autograd.Function):
    """rows [N, h] -> [T, h], each token's N / T rows summed (`slot_row` lists them token by token).
    Backward: each row's gradient is its token's (one gather by `token_index`)."""

    @staticmethod
    def forward(ctx, rows, token_index, slot_row, num_tokens):
        ctx.save_for_backward(token_index)
        return _sum_slots(rows, slot_row, num_tokens)

    @staticmethod
    def backward(ctx, grad):
        (token_index,) = ctx.saved_tensors
        return grad.index_select(0, token_index), None, None, None


def permute_rows(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, *, topk: int,
                 first_expert: int, num_experts: int, may_drop: bool, pad_multiple=None):
    """`sort_by_expert` then `gather_rows` in one function (the one --moe-permute-fusion compiles):
    (rows [N, h], token index [N], row probabilities [N], tokens per expert, row_valid, slot_row or
    None). With `pad_multiple` the routing map is padded first (--moe-router-padding-for-fp8; a token
    then has no fixed number of rows: no slot_row, the combine scatters)."""
    if pad_multiple is None:
        token_index, row_probs, tokens_per_expert, row_valid, slot_row = sort_by_expert(
            probs, routing_map, topk=topk, first_expert=first_expert, num_experts=num_experts, may_drop=may_drop)
    else:
        token_index, row_probs, tokens_per_expert, row_valid = sort_padded_by_expert(
            probs, pad_routing_map(routing_map, pad_multiple), topk=topk, first_expert=first_expert,
            num_experts=num_experts, multiple=pad_multiple)
        slot_row = None
    rows = gather_rows(hidden, token_index, row_valid, slot_row)
    return rows, token_index, row_probs, tokens_per_expert, row_valid, slot_row


class _LocalPermutation:
    """Dispatch within the ranks that hold every token (etp x ep of the all-gather dispatcher, or
    one rank): static shapes, no host synchronization."""

    def __init__(self, *, topk: int, first_expert: int, num_local_experts: int, may_drop: bool,
                 pad_to_capacity: bool, pad_multiple=None):
        self.topk, self.first_expert, self.num_local_experts = topk, first_expert, num_local_experts
        self.may_drop, self.pad_to_capacity, self.pad_multiple = may_drop, pad_to_capacity, pad_multiple
        # --moe-permute-fusion compiles these two (fewer kernels, same result; `MoELayer.compilable`).
        self.permute_rows, self.unpermute = permute_rows, unpermute

    def dispatch(self, hidden, probs, routing_map):
        """-> (rows [N, h] sorted by local expert, tokens per expert [E_local] (device tensor))."""
        self.num_tokens = hidden.shape[0]
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        if self.pad_to_capacity:
            rows, self.row_probs, self.token_index, per_expert = permute(hidden, probs[:, local],
                                                                         routing_map[:, local])
            self.row_valid = self.slot_row = None
            return rows, per_expert
        if self.pad_multiple is not None and self.num_tokens % self.pad_multiple:
            raise ValueError(f"--moe-router-padding-for-fp8 needs the tokens of a rank's micro-batch "
                             f"({self.num_tokens}: sequence length x micro-batch size, / tensor-parallel size "
                             f"with sequence parallelism) to be a multiple of {self.pad_multiple}, so that every "
                             f"expert's count can be padded")
        rows, self.token_index, self.row_probs, per_expert, self.row_valid, self.slot_row = self.permute_rows(
            hidden, probs, routing_map, topk=self.topk, first_expert=self.first_expert,
            num_experts=self.num_local_experts, may_drop=self.may_drop, pad_multiple=self.pad_multiple)
        return rows, per_expert

    def combine(self, expert_output):
        return self.unpermute(expert_output, self.token_index, self.num_tokens, self.row_probs, self.row_valid,
                              self.slot_row)


class AllGatherDispatcher:
    """All-gather over etp x ep, then the local permutation: no host synchronization at any EP size
    (each rank's rows are T x g x topk, those of other ranks' experts in the sentinel group)."""

    def __init__(self, *, num_local_experts: int, expert_offset: int, group, topk: int,
                 num_experts: int, capacity: bool = False, pad_to_capacity: bool = False):
        self.group = group  # etp x ep
        self.local = _LocalPermutation(topk=topk, first_expert=expert_offset, num_local_experts=num_local_experts,
                                       may_drop=capacity or num_local_experts < num_experts,
                                       pad_to_capacity=pad_to_capacity)

    def dispatch(self, hidden, probs, routing_map):
        """hidden [T, h], probs and routing_map [T, E] -> (rows [N, h], tokens per expert [E_local])."""
        hidden = gather_from_sequence_parallel_region(hidden, self.group)     # [T*g, h]
        probs = gather_from_sequence_parallel_region(probs, self.group)       # [T*g, E]
        routing_map = _all_gather_rows(routing_map, self.group)
        return self.local.dispatch(hidden, probs, routing_map)

    def combine(self, expert_output):
        """Expert outputs [N, h] (not yet weighted) -> [T, h], weighted by the routing probabilities."""
        return reduce_scatter_to_sequence_parallel_region(self.local.combine(expert_output), self.group)


class AllToAllDispatcher:
    """Tokens go only to the ranks of their chosen experts. At EP 1 (and ETP 1) this is the local
    permutation; at EP > 1 the split sizes of the all-to-alls are read back once per layer and
    micro-batch (one host synchronization, as Megatron-Core's)."""

    def __init__(self, *, num_local_experts: int, ep_group, etp_group, topk: int, num_experts: int,
                 capacity: bool = False, pad_to_capacity: bool = False, pad_multiple=None):
        self.num_local_experts = num_local_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.exchanges = comm.size(ep_group) > 1 or comm.size(etp_group) > 1
        # Before the exchange every rank sorts its tokens over all experts (no rank-local subset).
        self.local = _LocalPermutation(topk=topk, first_expert=0, num_local_experts=num_experts,
                                       may_drop=capacity, pad_to_capacity=pad_to_capacity,
                                       pad_multiple=pad_multiple)

    def dispatch(self, hidden, probs, routing_map):
        if not self.exchanges:
            return self.local.dispatch(hidden, probs, routing_map)
        ep, etp = comm.size(self.ep_group), comm.size(self.etp_group)
        tokens, per_expert = self.local.dispatch(hidden, probs, routing_map)   # all E experts
        # per_expert [E] -> how many rows go to each ep rank, and how many come back per (rank, expert).
        send_counts = per_expert.view(ep, self.num_local_experts)             # [ep, E_local]
        recv_counts = _exchange_counts(send_counts, self.ep_group)            # [ep, E_local]
        # With etp > 1 the etp ranks' received rows are all-gathered: [etp rank][ep rank][expert].
        all_counts = _all_gather_rows(recv_counts.reshape(1, -1), self.etp_group).view(etp * ep, -1)
        # The one host synchronization: every split size at once.
        host = torch.cat([send_counts.sum(dim=1), recv_counts.sum(dim=1),
                          all_counts.sum(dim=1).view(etp, ep).sum(dim=1)]).tolist()
        self.send_splits, self.recv_splits, self.etp_splits = host[:ep], host[ep:2 * ep], host[2 * ep:]
        # Dropped slots (capacity) sort after the last expert: they are not sent.
        self.num_sent = sum(self.send_splits)
        received = all_to_all(tokens[:self.num_sent], self.ep_group, self.recv_splits, self.send_splits)
        # Rows arrive grouped by source rank, then expert; the experts want them by expert, then rank.
        received = self._gather_etp(received)
        self.to_expert_order = _chunk_order(all_counts.reshape(-1), self.num_local_experts, etp * ep,
                                            sum(self.etp_splits))
        return received.index_select(0, self.to_expert_order), all_counts.sum(dim=0)

    def combine(self, expert_output):
        """Expert outputs [N, h] (not yet weighted) -> [T, h]: back to the tokens' ranks, then weighted
        by the routing probabilities and summed over each token's experts."""
        if not self.exchanges:
            return self.local.combine(expert_output)
        back = torch.empty_like(expert_output).index_copy(0, self.to_expert_order, expert_output)
        back = self._reduce_scatter_etp(back)
        returned = all_to_all(back, self.ep_group, self.send_splits, self.recv_splits)
        local = self.local
        sent = slice(0, self.num_sent)
        # Eager even under --moe-permute-fusion: the row count changes every micro-batch here, and a
        # compiled version would be recompiled for each.
        # Every slot sent (dropless): each token's rows gathered and summed; else a scatter-add.
        slot_row = local.slot_row if self.num_sent == local.token_index.numel() else None
        return unpermute(returned, local.token_index[sent], local.num_tokens, local.row_probs[sent],
                         slot_row=slot_row)

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


def _chunk_order(counts: torch.Tensor, inner: int, outer: int, num_rows: int) -> torch.Tensor:
    """Row indices that reorder chunks laid out [outer][inner] (sizes `counts` [outer*inner], on the
    device; `num_rows` their sum, known on the host) into [inner][outer] order: one stable sort of
    each row's destination chunk, no host synchronization."""
    chunk = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=num_rows)                    # [rows] source chunk
    destination = (chunk % inner) * outer + torch.div(chunk, inner, rounding_mode="floor")
    return torch.argsort(destination, stable=True)


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
