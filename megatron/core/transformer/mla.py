"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention semantics).

Queries: hidden -> q_lora_rank latent -> norm -> heads x (qk_head_dim + qk_pos_emb_head_dim)
(or hidden -> heads directly without --q-lora-rank). Keys and values: hidden -> one latent of
kv_lora_rank channels plus one rotated key part of qk_pos_emb_head_dim channels shared by all
heads; the latent is normalized and projected to each head's key (qk_head_dim) and value
(v_head_dim). The latents' norms are there with --qk-layernorm, as in Megatron-Core's layer spec
(DeepSeek-V3 has them). Only the rotated parts carry the rotary embedding ("decoupled RoPE"); the attention
runs on [no-position part; rotated part] (scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times
YaRN's mscale(factor, --mscale-all-dim)^2 with --rope-type yarn, as Megatron-Core and DeepSeek-V3;
applied to the queries, so that every attention kernel takes it).

Tensor parallelism splits the heads: the up projections are column-parallel and the output
projection row-parallel; the down projections are whole on every rank. With sequence parallelism
the down projections and the latents' norms run on this rank's tokens (their weight gradients are
then partial sums over the TP group), and the up projections gather the latents along the
sequence, as the column-parallel linears of the other attention gather their input; the shared
rotated key part is gathered the same way (and its gradient, which each rank's heads give in part,
summed over the group with or without sequence parallelism).

Context parallelism: this rank's tokens (its two chunks of the sequence) go through the layers as
any others; the rotary embedding comes from their global position ids (`slice_batch` keeps them),
and the attention core is `ContextParallelAttention` with any `--cp-comm-type`, which pads the
values to the query/key head dim for its kernels and exchanges and cuts the output back.
"""
import torch
import torch.nn.functional as F

from megatron.core.context_parallel import ContextParallelAttention
from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, replicated_layout, set_layout
from megatron.core.tensor_parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from megatron.core.transformer.attention import CoreAttention
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.flops import causal_attention_flops_per_token, matmul_flops_per_token
from megatron.core.transformer.fusions import rotary, rotary_interleaved
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.rope import yarn_softmax_correction


def _norm(norm, x):
    return x if norm is None else norm(x)


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T with W whole on every TP rank (no bias). `partial_grads`: the ranks feed it
    different tokens (sequence parallelism), so its gradients are summed over the TP group."""

    def __init__(self, input_size: int, output_size: int, *, tp: TensorParallel, partial_grads: bool, params_dtype,
                 device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype, device=device))
        set_layout(self.weight, replicated_layout(self.weight.shape, tp.size, tp.rank, partial_grads), "normal")

    def forward(self, x):
        return F.linear(x, self.weight)


class MultiLatentAttention(torch.nn.Module):
    compilable = {"_rotate": "fuse_elementwise"}  # parallelize.py

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp: TensorParallel = TensorParallel(), rng_tracker,
                 device, cp_group=None):
        super().__init__()
        config.check_tensor_parallel(tp.size)
        self.tp_group = tp.group
        self.num_local_heads = config.local_heads(tp.size)
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.sequence_parallel = execution.sequence_parallel and tp.size > 1
        heads, h = config.num_attention_heads, config.hidden_size
        common = dict(tp=tp, bias=False,
                      sequence_parallel=execution.sequence_parallel, params_dtype=execution.params_dtype,
                      device=device, gradient_accumulation_fusion=execution.gradient_accumulation_fusion)
        whole = dict(tp=tp, partial_grads=self.sequence_parallel,
                     params_dtype=execution.params_dtype, device=device)
        norm = dict(execution=execution, tp=tp, device=device)
        q_size = heads * (self.nope_dim + self.rope_dim)
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_size, **common)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, **whole)
            self.q_layernorm = build_norm(config, config.q_lora_rank, **norm) if config.qk_layernorm else None
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_size, **common)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim, **whole)
        self.kv_layernorm = build_norm(config, self.kv_lora_rank, **norm) if config.qk_layernorm else None
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), **common)
        if cp_group is None:
            self.core_attention = CoreAttention(config, rng_tracker, execution=execution)
        else:  # context parallelism: every head has its own key and value
            n = self.num_local_heads
            self.core_attention = ContextParallelAttention(config, execution=execution, cp_group=cp_group,
                                                           num_local_heads=n, num_local_groups=n)
        self.linear_proj = RowParallelLinear(heads * self.v_dim, h, **dict(common, bias=config.add_bias_linear))
        self._rotate = rotary_interleaved if config.rotary_interleaved else rotary
        self.softmax_correction = yarn_softmax_correction(config)

    def forward(self, x, rotary_cos_sin=None, attention_mask=None):
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism: the down projections see this rank's tokens)
        n = self.num_local_heads
        if hasattr(self, "linear_q_proj"):
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(_norm(self.q_layernorm, self.linear_q_down_proj(x)))
        s, b = q.shape[:2]
        q_nope, q_rot = q.view(s, b, n, self.nope_dim + self.rope_dim).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rot = self.linear_kv_down_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        kv = self.linear_kv_up_proj(_norm(self.kv_layernorm, latent)).view(s, b, n, self.nope_dim + self.v_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        # The shared rotated key part meets this rank's heads only: its gradient is a partial sum over
        # the TP group (reduce-scattered with the gather under sequence parallelism, else all-reduced).
        if self.sequence_parallel:
            k_rot = gather_from_sequence_parallel_region(k_rot, self.tp_group)
        else:
            k_rot = copy_to_tensor_parallel_region(k_rot, self.tp_group)
        k_rot = k_rot.unsqueeze(2)  # [s, b, 1, rope]: one for all heads
        if rotary_cos_sin is not None:
            cos, sin = rotary_cos_sin
            q_rot, k_rot = self._rotate(q_rot, cos, sin), self._rotate(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)  # [s, b, n, nope + rope]
        if self.softmax_correction != 1.0:
            q = q * self.softmax_correction
        k = torch.cat((k_nope, k_rot.expand(-1, -1, n, -1)), dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, n, s, d]
        out = self.core_attention(q, k, v, attention_mask)  # [b, n, s, v_dim]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, n * self.v_dim))

    def flops_per_token(self, seq_length: int) -> int:
        """Forward FLOPs per token (transformer.flops): the down, up and output projections, and the
        causal attention products of this rank's heads (queries and keys of nope + rope channels,
        values of v_head_dim)."""
        return matmul_flops_per_token(self, seq_length) + causal_attention_flops_per_token(
            seq_length, self.num_local_heads, self.nope_dim + self.rope_dim, self.v_dim)
