"""The model's shape as the planner reads it, and its parameter and FLOP counts.

`architecture()` is the one place that reads the model description (the core `TransformerConfig`
with its derived values: padded vocabulary, FFN size default, kv channels, query groups). Every
other planning module takes the `Architecture` it returns. Parameters and FLOPs are not formulas
here: they are counted on the model the description builds, on the meta device (planning/built.py),
so a new family or layer is planned as it is built. The analytic fields serve the activation and
time terms. The routed experts' parameters are counted apart (`stage_expert_parameters`), since
EP x ETP splits them and the expert-data-parallel group, not the data-parallel one, replicates them.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.core.transformer.moe.router import aux_loss_coeffs
from megatron.training.planning import built


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
    rotary_dim: int                # channels RoPE rotates (kv channels x rotary percent; MLA: its rotated part)
    max_position_embeddings: int
    tied_embeddings: bool
    hidden_dropout: float
    attention_dropout: float
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
    # The model description itself: parameters and FLOPs are counted on the model it builds
    # (planning/built.py), the fields above serve the analytic activation and time terms.
    model: Any = field(default=None, compare=False, repr=False)
    model_key: str = field(default="", compare=False, repr=False)

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
        rope=c.position_embedding_type == "rope", rotary_dim=(c.qk_pos_emb_head_dim if c.multi_latent_attention
                                                                  else int(c.kv_channels * c.rotary_percent)),
        max_position_embeddings=c.max_position_embeddings,
        tied_embeddings=not c.untie_embeddings_and_output_weights, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
        model=c, model_key=built.model_key(c), **_mla_fields(c), **_moe_fields(c))


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


def layer_parameters(arch: Architecture, tp: int, moe: bool = False) -> int:
    """Elements of one decoder layer's parameters on one tensor-parallel rank, counted on the layer
    built on the meta device (planning/built.py). A mixture-of-experts layer (`moe`) holds the
    router and the shared experts in place of the MLP; its routed experts are
    `expert_layer_parameters`."""
    return built.layer_counts(arch.model, arch.model_key, "moe" if moe else "dense", tp).dense


def expert_layer_parameters(arch: Architecture, ep: int, etp: int, weights_only: bool = False) -> int:
    """Elements of one layer's routed experts on one rank: E/EP experts, each MLP split over ETP
    (`weights_only`: the GEMMs' weights, no bias)."""
    counts = built.layer_counts(arch.model, arch.model_key, "moe", etp, ep, etp)  # built where TP = ETP
    return counts.expert_weights if weights_only else counts.experts


def stage_parameters(arch: Architecture, tp: int, num_layers: int, *, first: bool, last: bool, pp: int,
                     first_layer: int = 0) -> int:
    """Elements of one pipeline stage's parameters on one tensor-parallel rank, routed experts
    excepted: layers first_layer .. first_layer + num_layers - 1, the embeddings on the first stage,
    the final norm, the output layer (a pipeline's last stage holds its own copy of a tied
    embedding) and the multi-token prediction modules on the last. Counted on the model built on
    the meta device (planning/built.py); `pp` > 1 never puts the first and last stage together."""
    del pp  # the built stage's ends follow from first and last
    return built.stage_counts(arch.model, arch.model_key, tp, 1, 1, num_layers, first_layer,
                              first=first, last=last).dense


def stage_expert_parameters(arch: Architecture, ep: int, etp: int, num_layers: int, first_layer: int = 0,
                            weights_only: bool = False, last: bool = False) -> int:
    """Elements of the routed experts of a stage's layers on one rank (`last`: with the
    mixture-of-experts prediction modules the last stage holds)."""
    if not arch.is_moe:
        return 0
    # built where TP = ETP (ETP is 1 or TP): the experts' shards depend on EP and ETP alone
    counts = built.stage_counts(arch.model, arch.model_key, etp, ep, etp, num_layers, first_layer, first=False,
                                last=last)
    return counts.expert_weights if weights_only else counts.experts


def total_parameters(arch: Architecture) -> int:
    """Elements of the whole model (tied embeddings counted once, every expert)."""
    return (stage_parameters(arch, 1, arch.num_layers, first=True, last=True, pp=1)
            + stage_expert_parameters(arch, 1, 1, arch.num_layers, last=True))


def active_parameters(arch: Architecture) -> int:
    """Elements one token runs through: the top-k routed experts of each mixture-of-experts layer
    (the prediction modules' included) instead of all of them (the dense model: every parameter)."""
    if not arch.is_moe:
        return total_parameters(arch)
    experts = stage_expert_parameters(arch, 1, 1, arch.num_layers, last=True)  # every layer's E equal experts
    return total_parameters(arch) - experts * (arch.num_experts - arch.moe_router_topk) // arch.num_experts


def flops_per_iteration(arch: Architecture, global_batch_size: int, seq_length: int) -> float:
    """Model FLOPs per iteration of this architecture (planning/built.py: counted on the model built
    on the meta device; the log line's TFLOP/s counts the same)."""
    return built.flops_per_iteration(arch.model, global_batch_size, seq_length, arch.model_key)


def model_flops(model_config, global_batch_size: int, seq_length: int) -> float:
    """Model FLOPs per iteration of a model description (the log line's TFLOP/s; planning/built.py)."""
    return built.flops_per_iteration(model_config, global_batch_size, seq_length)
