"""Self-attention: project, rotate, attend, project.

Heads are split over tensor-parallel ranks: each rank holds num_attention_heads/tp query heads and
the key/value groups they read. When TP exceeds the number of query groups, each group's key/value
projection is replicated on the tp/groups ranks that use it (their gradients are summed after
backward, see `TPLayout.sum_partial_replica_grads`).
"""
import importlib.util
import logging

import torch
import torch.nn.functional as F

from megatron.core.context_parallel import ContextParallelAttention
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, Part, RowParallelLinear
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.core.transformer.fusions import pick, rotary, rotary_interleaved
from megatron.core.transformer.norm import build_norm

logger = logging.getLogger(__name__)

_SDPA_HAS_GQA = "enable_gqa" in F.scaled_dot_product_attention.__doc__


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over local heads.

    q: [b, nq, s, d], k/v: [b, nkv, s, d] -> [b, nq, s, d]. The module boundary is what selective
    recomputation re-runs, and what context parallelism replaces with ring attention.
    """

    def __init__(self, config, rng_tracker):
        super().__init__()
        self.dropout = config.attention_dropout
        self.rng_tracker = rng_tracker
        self.use_flash_attn_package = config.attention_backend == "flash_attn" and flash_attn_available()

    def forward(self, q, k, v, attention_mask=None):
        dropout = self.dropout if self.training else 0.0
        if dropout > 0.0 and self.rng_tracker is not None:
            with self.rng_tracker.fork():
                return self._attend(q, k, v, attention_mask, dropout)
        return self._attend(q, k, v, attention_mask, dropout)

    def _attend(self, q, k, v, attention_mask, dropout):
        if self.use_flash_attn_package and attention_mask is None:
            from flash_attn import flash_attn_func

            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  dropout_p=dropout, causal=True)
            return out.transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        if group > 1 and not _SDPA_HAS_GQA:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        extra = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
        if attention_mask is not None:  # [b, 1, s, s] bool, True = may attend
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout, **extra)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, **extra)


class SelfAttention(torch.nn.Module):
    def __init__(self, config, *, tp_group, tp_size: int, tp_rank: int, rng_tracker: RNGStatesTracker, device,
                 cp_group=None):
        super().__init__()
        config.check_tensor_parallel(tp_size)
        self.config = config
        kv_shards = min(tp_size, config.num_query_groups)
        self.num_local_heads = config.num_attention_heads // tp_size
        self.num_local_groups = config.num_query_groups // kv_shards
        self.head_dim = config.kv_channels
        parts = (
            Part("q", config.query_projection_size, tp_size),
            Part("k", config.kv_projection_size, kv_shards, sum_replica_grads=True),
            Part("v", config.kv_projection_size, kv_shards, sum_replica_grads=True),
        )
        common = dict(tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank,
                      sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype, device=device)
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, None, parts=parts,
                                               bias=config.add_bias_linear or config.add_qkv_bias, **common)
        if cp_group is None:
            self.core_attention = CoreAttention(config, rng_tracker)
        else:  # context parallelism: this rank holds part of the sequence (None is a group of one)
            self.core_attention = ContextParallelAttention(
                config, cp_group=cp_group, num_local_heads=self.num_local_heads, num_local_groups=self.num_local_groups)
        self.linear_proj = RowParallelLinear(config.query_projection_size, config.hidden_size,
                                             bias=config.add_bias_linear, **common)
        self._rotate = pick(rotary_interleaved if config.rotary_interleaved else rotary, config.fuse_elementwise)
        if config.qk_layernorm:
            # One weight over each head's channels, shared by all heads; each rank normalizes its
            # own heads, so the gradients are partial sums over the TP group.
            norm = dict(tp_size=tp_size, tp_rank=tp_rank, device=device, partial_grads=True)
            self.q_layernorm = build_norm(config, config.kv_channels, **norm)
            self.k_layernorm = build_norm(config, config.kv_channels, **norm)
        else:
            self.q_layernorm = self.k_layernorm = None

    def forward(self, x, rotary_cos_sin=None, attention_mask=None):
        # x: [s, b, h] (or [s/tp, b, h] with sequence parallelism; linear_qkv gathers it)
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        q_size = self.num_local_heads * self.head_dim
        kv_size = self.num_local_groups * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(s, b, self.num_local_heads, self.head_dim)
        k = k.view(s, b, self.num_local_groups, self.head_dim)
        v = v.view(s, b, self.num_local_groups, self.head_dim)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_cos_sin is not None:
            cos, sin = rotary_cos_sin
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = self.core_attention(q, k, v, attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, q_size)  # [s, b, nq*d]
        return self.linear_proj(out)
