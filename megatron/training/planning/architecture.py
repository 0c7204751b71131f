"""The model's shape as the planner reads it, and its parameter counts.

`architecture()` is the one place that reads the model description (the core `TransformerConfig`
with its derived values: padded vocabulary, FFN size default, kv channels, query groups). Every
other planning module takes the `Architecture` it returns, so a change to the model description
changes this function alone. Mixture-of-experts layers (per --moe-layer-freq) count their router,
shared experts and routed experts in place of the dense MLP; the routed experts' parameters are
counted apart (`stage_expert_parameters`), since EP x ETP splits them and the expert-data-parallel
group, not the data-parallel one, replicates them.
"""
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.moe.router import aux_loss_coeffs


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int                # padded (divisible by make-vocab-size-divisible-by x TP)
    gated_linear_unit: bool        # SwiGLU: fc1 holds gate and up projections
    layernorm: bool                # LayerNorm (weight and bias, mean and rstd saved) or RMSNorm
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    learned_positions: bool        # learned absolute position embeddings (else RoPE or none)
    rope: bool
    rotary_dim: int                # channels RoPE rotates (kv channels x rotary percent)
    max_position_embeddings: int
    tied_embeddings: bool
    hidden_dropout: float
    attention_dropout: float
    layer_norms: int = 2           # norms over the hidden size per layer (1: --parallel_attn with one norm, Falcon-7B)
    # Multi-latent attention (--multi-latent-attention; mla False: the fields are unused)
    mla: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (num_experts None: a dense model; the other fields then unused)
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_shared_expert_size: int = 0          # total hidden size of the shared experts (0: none)
    moe_shared_expert_gate: bool = False
    moe_layers: tuple = ()                   # 1 per mixture-of-experts layer, 0 per dense layer
    moe_dispatcher: str = "allgather"
    moe_capacity_factor: Optional[float] = None
    moe_pad_to_capacity: bool = False
    moe_router_fp32: bool = False            # --moe-router-dtype fp32/fp64: the router runs wider
    moe_aux_loss: bool = False               # a load-balancing loss is attached (its scores are saved)
    moe_grouped_gemm: bool = False           # the local experts run as one grouped GEMM per linear

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layer_count(self, first_layer: int, num_layers: int) -> int:
        """Mixture-of-experts layers among layers first_layer .. first_layer + num_layers - 1."""
        return sum(self.moe_layers[first_layer:first_layer + num_layers]) if self.is_moe else 0

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    def local_heads(self, tp: int) -> int:
        """Query heads on one tensor-parallel rank."""
        return self.num_attention_heads // tp

    def local_kv_size(self, tp: int) -> int:
        """Key (or value) channels on one tensor-parallel rank: the groups split over the ranks, or
        one group per rank, replicated, when TP exceeds the groups."""
        return self.kv_channels * self.num_query_groups // min(tp, self.num_query_groups)


def architecture(model_config) -> Architecture:
    """The planner's view of a `TransformerConfig` (its derived values already filled in)."""
    c = model_config
    return Architecture(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups, kv_channels=c.kv_channels, ffn_hidden_size=c.ffn_hidden_size,
        vocab_size=c.padded_vocab_size, gated_linear_unit=c.swiglu,
        layernorm=c.normalization == "LayerNorm", add_bias_linear=c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        qk_layernorm=c.qk_layernorm, learned_positions=c.position_embedding_type == "learned_absolute",
        rope=c.position_embedding_type == "rope", rotary_dim=int(c.kv_channels * c.rotary_percent),
        max_position_embeddings=c.max_position_embeddings,
        tied_embeddings=not c.untie_embeddings_and_output_weights, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout, layer_norms=1 if c.parallel_attn and not c.parallel_layernorm else 2,
        **_mla_fields(c), **_moe_fields(c))


def _mla_fields(c) -> dict:
    if not c.multi_latent_attention:
        return {}
    return dict(mla=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_head_dim,
                qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim)


def _moe_fields(c) -> dict:
    if c.num_experts is None:
        return {}
    return dict(num_experts=c.num_experts, moe_ffn_hidden_size=c.moe_ffn_hidden_size, moe_router_topk=c.moe_router_topk,
                moe_shared_expert_size=c.moe_shared_expert_intermediate_size or 0,
                moe_shared_expert_gate=bool(c.moe_shared_expert_intermediate_size and c.moe_shared_expert_gate),
                moe_layers=c.moe_layers,
                moe_dispatcher=c.moe_token_dispatcher_type, moe_capacity_factor=c.moe_expert_capacity_factor,
                moe_pad_to_capacity=bool(c.moe_pad_expert_input_to_capacity),
                moe_router_fp32=c.moe_router_dtype is not None, moe_aux_loss=bool(aux_loss_coeffs(c)),
                moe_grouped_gemm=bool(c.moe_grouped_gemm))


def _norm_parameters(arch: Architecture, width: int) -> int:
    return (2 if arch.layernorm else 1) * width  # weight (+ bias)


def mlp_parameters(arch: Architecture, ffn_hidden_size: int, tp: int) -> int:
    """Elements of one MLP (fc1, the activation, fc2) of this hidden size on one tensor-parallel rank."""
    h, f = arch.hidden_size, ffn_hidden_size
    fc1_out = (2 if arch.gated_linear_unit else 1) * f // tp
    return h * fc1_out + f // tp * h + ((fc1_out + h) if arch.add_bias_linear else 0)


def layer_parameters(arch: Architecture, tp: int, moe: bool = False) -> int:
    """Elements of one decoder layer's parameters on one tensor-parallel rank (key/value heads are
    replicated when TP exceeds the query groups). A mixture-of-experts layer (`moe`) holds the
    router [E, h] and the shared experts (with their gate) in place of the MLP; its routed experts
    are `expert_layer_parameters`."""
    a, h = arch, arch.hidden_size
    if a.mla:
        attention = mla_parameters(a, tp)
    else:
        q_local = a.query_size // tp
        kv_local = a.local_kv_size(tp)
        qkv_out = q_local + 2 * kv_local
        qkv = h * qkv_out + (qkv_out if a.add_bias_linear or a.add_qkv_bias else 0)
        attention = qkv + q_local * h + (h if a.add_bias_linear else 0)
    if moe:
        mlp = a.num_experts * h
        if a.moe_shared_expert_size:
            mlp += mlp_parameters(a, a.moe_shared_expert_size, tp) + (h if a.moe_shared_expert_gate else 0)
    else:
        mlp = mlp_parameters(a, a.ffn_hidden_size, tp)
    qk_norms = 2 * _norm_parameters(a, a.kv_channels) if a.qk_layernorm and not a.mla else 0
    return a.layer_norms * _norm_parameters(a, h) + attention + qk_norms + mlp


def mla_parameters(arch: Architecture, tp: int) -> int:
    """Elements of one multi-latent attention on one tensor-parallel rank: the down projections
    and the latents' norms (--qk-layernorm) whole, the up projections and the output projection
    split by heads."""
    a, h = arch, arch.hidden_size
    heads = a.local_heads(tp)
    q_head = a.qk_head_dim + a.qk_pos_emb_head_dim

    def latent_norm(width: int) -> int:  # the latents' norms come with --qk-layernorm
        return _norm_parameters(a, width) if a.qk_layernorm else 0

    if a.q_lora_rank is None:
        query = h * heads * q_head
    else:
        query = h * a.q_lora_rank + a.q_lora_rank * heads * q_head + latent_norm(a.q_lora_rank)
    key_value = (h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank * heads * (a.qk_head_dim + a.v_head_dim)
                 + latent_norm(a.kv_lora_rank))
    return query + key_value + heads * a.v_head_dim * h + (h if a.add_bias_linear else 0)


def expert_layer_parameters(arch: Architecture, ep: int, etp: int, weights_only: bool = False) -> int:
    """Elements of one layer's routed experts on one rank: E/EP experts, each MLP split over ETP
    (fc2's bias whole on every expert-tensor-parallel rank; `weights_only`: the GEMMs' weights, no bias)."""
    f, h = arch.moe_ffn_hidden_size, arch.hidden_size
    fc1_out = (2 if arch.gated_linear_unit else 1) * f // etp
    one = h * fc1_out + f // etp * h + ((fc1_out + h) if arch.add_bias_linear and not weights_only else 0)
    return arch.num_experts // ep * one


def stage_parameters(arch: Architecture, tp: int, num_layers: int, *, first: bool, last: bool, pp: int,
                     first_layer: int = 0) -> int:
    """Elements of one pipeline stage's parameters on one tensor-parallel rank, routed experts
    excepted (the last stage of a pipeline with tied embeddings holds its own copy of the embedding
    as the output layer). The stage holds layers first_layer .. first_layer + num_layers - 1."""
    moe = arch.moe_layer_count(first_layer, num_layers)
    total = (num_layers - moe) * layer_parameters(arch, tp)
    if moe:
        total += moe * layer_parameters(arch, tp, moe=True)
    vocabulary = arch.vocab_size // tp * arch.hidden_size
    if first:
        total += vocabulary
        if arch.learned_positions:
            total += arch.max_position_embeddings * arch.hidden_size
    if last:
        total += _norm_parameters(arch, arch.hidden_size)
        if not arch.tied_embeddings or pp > 1:
            total += vocabulary
    return total


def stage_expert_parameters(arch: Architecture, ep: int, etp: int, num_layers: int, first_layer: int = 0,
                            weights_only: bool = False) -> int:
    """Elements of the routed experts of a stage's layers on one rank."""
    moe = arch.moe_layer_count(first_layer, num_layers)
    return moe * expert_layer_parameters(arch, ep, etp, weights_only) if moe else 0


def total_parameters(arch: Architecture) -> int:
    """Elements of the whole model (tied embeddings counted once, every expert)."""
    return (stage_parameters(arch, 1, arch.num_layers, first=True, last=True, pp=1)
            + stage_expert_parameters(arch, 1, 1, arch.num_layers))


def active_parameters(arch: Architecture) -> int:
    """Elements one token runs through: the top-k routed experts of each mixture-of-experts layer
    instead of all of them (the dense model: every parameter)."""
    if not arch.is_moe:
        return total_parameters(arch)
    moe_layers = arch.moe_layer_count(0, arch.num_layers)
    idle = (arch.num_experts - arch.moe_router_topk) * expert_layer_parameters(arch, arch.num_experts, 1)
    return total_parameters(arch) - moe_layers * idle


def megatron_flops(*, global_batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                   ffn_hidden_size: int, query_size: int, kv_channels: int, num_query_groups: int, vocab_size: int,
                   gated: bool, moe_layers: int = 0, moe_active_ffn: int = 0) -> float:
    """Megatron's model FLOPs per iteration, the one definition (the log line's TFLOP/s/GPU and the
    plan's MFU both count this; causal attention counted as half, recomputation not counted):
    6 B s [L (m h f + 2 h q + 2 h k g + s q) + h V]. In the `moe_layers` mixture-of-experts layers f
    is what a token runs through, `moe_active_ffn` = topk x --moe-ffn-hidden-size plus the shared
    experts' size (Megatron-LM's count; the router's GEMM, capacity padding and dropped tokens are
    not counted)."""
    h, q = hidden_size, query_size
    m = 3 if gated else 2
    per_layer = m * h * ffn_hidden_size + 2 * h * q + 2 * h * kv_channels * num_query_groups + seq_length * q
    total = num_layers * per_layer + moe_layers * m * h * (moe_active_ffn - ffn_hidden_size)
    return 6.0 * global_batch_size * seq_length * (total + h * vocab_size)


def flops_per_iteration(arch: Architecture, global_batch_size: int, seq_length: int) -> float:
    """`megatron_flops` of this architecture."""
    a = arch
    moe = dict(moe_layers=a.moe_layer_count(0, a.num_layers),
               moe_active_ffn=a.moe_router_topk * a.moe_ffn_hidden_size + a.moe_shared_expert_size) if a.is_moe else {}
    return megatron_flops(global_batch_size=global_batch_size, seq_length=seq_length, num_layers=a.num_layers,
                          hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size, query_size=a.query_size,
                          kv_channels=a.kv_channels, num_query_groups=a.num_query_groups, vocab_size=a.vocab_size,
                          gated=a.gated_linear_unit, **moe)
