"""The attention core under context parallelism: same interface as `CoreAttention`, any comm type.

`SelfAttention` uses this module instead of `CoreAttention` when the context-parallel group has
more than one rank. Its inputs are this rank's chunks of the sequence (see `layout`); its output
equals the rows of full causal attention over the whole sequence for those tokens.
"""
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.a2a import a2a_attention
from megatron.core.context_parallel.all_gather import all_gather_attention
from megatron.core.context_parallel.documents import document_masked_attention
from megatron.core.context_parallel.kernels import flash_attn_package_usable, select_kernel
from megatron.core.context_parallel.layout import check_divisible
from megatron.core.context_parallel.ring import ring_attention
from megatron.core.distributed import comm

logger = logging.getLogger(__name__)

COMM_TYPES = ("p2p", "all_gather", "a2a")           # built here
MEGATRON_COMM_TYPES = COMM_TYPES + ("a2a+p2p",)      # Megatron's values of --cp-comm-type


def check_context_parallel(*, cp_size: int, comm_type: str, num_local_heads: int, num_local_groups: int,
                           attention_dropout: float = 0.0, seq_length: Optional[int] = None) -> None:
    """Raises ValueError, naming the flags, for what context parallelism cannot run."""
    if cp_size == 1:
        return
    if comm_type not in MEGATRON_COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(MEGATRON_COMM_TYPES)}, got {comm_type!r}")
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type} (hierarchical all-to-all + ring) is not built in this version; "
                         f"use p2p, all_gather or a2a")
    if attention_dropout > 0.0:
        raise ValueError(f"--attention-dropout ({attention_dropout}) must be 0 with --context-parallel-size "
                         f"{cp_size}: the context-parallel attention kernels run without dropout")
    if seq_length is not None:
        check_divisible(seq_length, cp_size)
    if comm_type == "a2a":
        for what, count in (("query heads", num_local_heads), ("key/value groups", num_local_groups)):
            if count % cp_size != 0:
                raise ValueError(
                    f"`cp_comm_type` a2a splits attention heads over the context-parallel ranks: {what} per "
                    f"tensor-parallel rank ({count}, from `num_attention_heads` / `num_query_groups` and "
                    f"`tensor_model_parallel_size`) must be divisible by `context_parallel_size` ({cp_size}); "
                    f"use `cp_comm_type` p2p or all_gather")


class ContextParallelAttention(torch.nn.Module):
    """Causal softmax(q k^T / sqrt(d)) v over the context-parallel sequence, for local heads; with
    an attention mask (packed documents), the masked attention of `documents`.

    q/k: [b, nq|nkv, s/C, d], v: [b, nkv, s/C, dv] (this rank's two chunks) -> [b, nq, s/C, dv];
    dv may differ from d (multi-latent attention, `one_head_dim`)."""

    def __init__(self, config, *, execution, cp_group, num_local_heads: int, num_local_groups: int):
        super().__init__()
        self.cp_group = cp_group
        self.comm_type = execution.cp_comm_type
        check_context_parallel(cp_size=comm.size(cp_group), comm_type=self.comm_type,
                               num_local_heads=num_local_heads, num_local_groups=num_local_groups,
                               attention_dropout=config.attention_dropout)
        self.use_flash_attn_package = False
        if execution.attention_backend == "flash_attn":
            self.use_flash_attn_package = flash_attn_package_usable()
            if not self.use_flash_attn_package:
                logger.warning("--use-flash-attn: flash-attn >= 2.6 is not installed; context-parallel attention "
                               "uses SDPA's flash kernel")

    def forward(self, q, k, v, attention_mask=None):
        value_dim = v.shape[-1]
        q, k, v = one_head_dim(q, k, v)
        out = self._attend(q, k, v, attention_mask)
        return out if out.shape[-1] == value_dim else out[..., :value_dim]

    def _attend(self, q, k, v, attention_mask):
        if attention_mask is not None:  # packed documents: [b, 1, s/C, s] from context_parallel_document_mask
            return document_masked_attention(q, k, v, attention_mask, self.cp_group)
        if self.comm_type == "a2a":
            return a2a_attention(q, k, v, self.cp_group)
        kernel = select_kernel(q.device, q.dtype, self.use_flash_attn_package)
        attend = ring_attention if self.comm_type == "p2p" else all_gather_attention
        return attend(q, k, v, self.cp_group, kernel)


def one_head_dim(q, k, v) -> tuple:
    """q, k, v at one head dim D = max(d, dv). The block kernels take one head dim for all three,
    and the exchanges move them together (the ring and the all-gather stack k with v, a2a packs
    q, k and v), but multi-latent attention's values are narrower than its queries and keys
    (DeepSeek-V3: 128 against 192; Transformer Engine pads them the same way for its flash kernels).
    The narrower side gets zero channels: zero value channels give zero output channels, which the
    caller cuts off; zero query/key channels leave q.k unchanged, and q is scaled by sqrt(D / d) so
    that the kernels' 1/sqrt(D) is the attention's 1/sqrt(d)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    if dv > d:
        return F.pad(q, (0, dv - d)) * (dv / d) ** 0.5, F.pad(k, (0, dv - d)), v
    return q, k, v
