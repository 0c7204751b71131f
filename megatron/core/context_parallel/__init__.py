"""Context parallelism: the sequence split over ranks, with attention across the split.

- `layout`: the load-balanced chunk layout (rank r holds chunks r and 2C-1-r of 2C) and the
  helpers that slice batches and permute gathered chunks;
- `kernels`: block attention returning the log-sum-exp (CPU flash, SDPA flash/efficient, flash-attn);
- `merge`: the online-softmax merge of partial results;
- `ring` (`p2p`), `all_gather`, `a2a`: the three communication schemes of `--cp-comm-type`;
- `attention.ContextParallelAttention`: the attention core `SelfAttention` uses when CP > 1.
"""
from megatron.core.context_parallel.attention import (
    COMM_TYPES,
    MEGATRON_COMM_TYPES,
    ContextParallelAttention,
    check_context_parallel,
)
from megatron.core.context_parallel.layout import local_positions, slice_batch, slice_sequence

__all__ = ["COMM_TYPES", "MEGATRON_COMM_TYPES", "ContextParallelAttention", "check_context_parallel",
           "local_positions", "slice_batch", "slice_sequence"]
