"""Load-balanced sequence layout for context parallelism.

With causal attention a token attends to every token before it, so the last tokens of a sequence
cost the most. Cutting the sequence into C contiguous pieces would give the last CP rank C times
the attention work of the first. Instead the sequence is cut into 2C chunks and CP rank r holds
chunks r and 2C-1-r, an early one and a late one, so every rank does the same work:

    C = 2, chunks 0..3:   rank 0 holds [0, 3]   rank 1 holds [1, 2]
    C = 4, chunks 0..7:   rank 0 [0, 7]   rank 1 [1, 6]   rank 2 [2, 5]   rank 3 [3, 4]

A rank's local sequence is its two chunks, concatenated. Gathering the local sequences of all
ranks in rank order gives the chunks in "rank order" (0, 2C-1, 1, 2C-2, ...); `to_sequence_order`
and `to_rank_order` permute between that and the natural order.
"""
import torch


def chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The two global chunk indices CP rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_divisible(seq_length: int, cp_size: int) -> None:
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size "
                         f"({cp_size}) = {2 * cp_size}: each sequence is cut into 2 chunks per context-parallel rank")


def local_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global token positions this rank holds, in local order ([seq_length / cp_size])."""
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_size, cp_rank)])


def slice_sequence(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of `tensor` along `dim` (the whole tensor when cp_size is 1)."""
    if cp_size == 1:
        return tensor
    index = local_positions(tensor.shape[dim], cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(dim, index)


def slice_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """A micro-batch of [b, s] tensors (tokens, labels, loss mask, position ids, document ids) cut
    to this rank's chunks. Position ids keep their values, so rotary and learned position
    embeddings see the true positions; the model gathers the document ids of the whole sequence
    for its mask (`documents.context_parallel_document_mask`)."""
    if cp_size == 1:
        return batch
    return {key: slice_sequence(value, 1, cp_size, cp_rank) for key, value in batch.items()}


def _rank_order_chunks(cp_size: int) -> list:
    """Global chunk index at each position of the rank order."""
    return [c for rank in range(cp_size) for c in chunk_ids(cp_size, rank)]


def to_sequence_order(x: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """Chunks along `dim` from rank order (the local sequences of ranks 0..C-1, concatenated) to the
    natural order of the sequence."""
    order = _rank_order_chunks(cp_size)
    where = [order.index(c) for c in range(2 * cp_size)]
    return _permute_chunks(x, dim, cp_size, where)


def to_rank_order(x: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """The inverse of `to_sequence_order`."""
    return _permute_chunks(x, dim, cp_size, _rank_order_chunks(cp_size))


def _permute_chunks(x: torch.Tensor, dim: int, cp_size: int, source_chunks: list) -> torch.Tensor:
    dim = dim % x.dim()
    chunks = 2 * cp_size
    chunk = x.shape[dim] // chunks
    split = x.reshape(*x.shape[:dim], chunks, chunk, *x.shape[dim + 1:])
    picked = split.index_select(dim, torch.tensor(source_chunks, device=x.device))
    return picked.reshape(x.shape)
