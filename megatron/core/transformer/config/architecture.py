"""TransformerConfig: the model's architecture, once. Field names are Megatron-LM's argument names;
each field's docstring is its --help text and its metadata (see `fields`) says what the flags and
the checkpoints do with it. Hugging Face keys are the families' (models.gpt.families)."""
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.core.transformer.config.fields import ARCHITECTURE, NUMERICS, RUN, Flag, arch_field
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern
from megatron.core.utils import divide


def _rope(config) -> bool:
    return config.position_embedding_type == "rope"


def _rope_scaling(config) -> bool:
    return _rope(config) and config.use_rope_scaling


def _yarn(config) -> bool:
    return config.multi_latent_attention and config.rope_type == "yarn"


def _effective_rope_type(rope_type, config) -> str:
    """YaRN at factor 1 is plain RoPE: checkpoints and conversions compare the two as equal."""
    return "rope" if rope_type == "yarn" and config.rotary_scaling_factor == 1 else rope_type


def _learned_positions_are_a_shape(config) -> str:
    return ARCHITECTURE if config.position_embedding_type == "learned_absolute" else NUMERICS


def _dense_ffn_is_a_shape(config) -> str:
    """--ffn-hidden-size shapes the dense MLPs; with every layer a mixture of experts there are none
    (it is then only the default of --moe-ffn-hidden-size, whose derived value is recorded)."""
    if getattr(config, "num_experts", None) is None:
        return ARCHITECTURE
    return RUN if all(moe_layer_pattern(config.moe_layer_freq, config.num_layers)) else ARCHITECTURE


def _layer_pattern(moe_layer_freq, config) -> list:
    return moe_layer_pattern(moe_layer_freq, config.num_layers)


def _moe(config) -> bool:
    return config.num_experts is not None


def _mla(config) -> bool:
    return config.multi_latent_attention


def _mtp(config) -> bool:
    return config.mtp_num_layers is not None


def _shared_experts(config) -> bool:
    return _moe(config) and config.moe_shared_expert_intermediate_size is not None


@dataclass
class TransformerConfig:
    num_layers: int = arch_field()
    """Number of transformer layers."""
    hidden_size: int = arch_field()
    """Transformer hidden size."""
    num_attention_heads: int = arch_field()
    """Number of attention (query) heads."""
    ffn_hidden_size: Optional[int] = arch_field(None, _dense_ffn_is_a_shape)
    """Hidden size of the MLP; default 4 x --hidden-size, or with --swiglu int(8 x --hidden-size / 3 / 64) x 64 (as Megatron-LM)."""
    kv_channels: Optional[int] = arch_field(None)
    """Channels per attention head; default --hidden-size / --num-attention-heads."""
    group_query_attention: bool = arch_field(False)
    """Use grouped-query attention (see --num-query-groups)."""
    num_query_groups: int = arch_field(1)
    """Number of key/value groups with --group-query-attention."""
    max_position_embeddings: Optional[int] = arch_field(None, _learned_positions_are_a_shape)
    """Maximum sequence length the position embeddings cover; default --seq-length."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = arch_field("learned_absolute")
    """Position embedding: learned absolute (GPT) or rotary (Llama)."""
    rotary_base: int = arch_field(10000, NUMERICS, applies=_rope)
    """Base of the rotary embedding frequencies (Llama 2: 10000, Llama 3: 500000)."""
    rotary_percent: float = arch_field(1.0, NUMERICS, applies=_rope)
    """Fraction of each head's channels that is rotated."""
    rotary_interleaved: bool = arch_field(False, applies=_rope)
    """Rotary embedding on interleaved channel pairs (2i, 2i+1) instead of halves (i, i + d/2)."""
    use_rope_scaling: bool = arch_field(False, NUMERICS, applies=_rope)
    """Apply Llama 3.1 rotary frequency scaling (factor 8, low 1, high 4, original 8192)."""
    rope_scaling_factor: float = arch_field(8.0, NUMERICS, applies=_rope_scaling)
    """Scaling factor for --use-rope-scaling."""
    rope_low_freq_factor: float = arch_field(1.0, NUMERICS, flag=None, applies=_rope_scaling)
    """Llama 3.1 scaling: wavelengths above original / low_freq_factor are slowed by the factor (Megatron-LM's is 1)."""
    rope_high_freq_factor: float = arch_field(4.0, NUMERICS, flag=None, applies=_rope_scaling)
    """Llama 3.1 scaling: wavelengths below original / high_freq_factor are kept (Megatron-LM's is 4)."""
    rope_original_max_position_embeddings: int = arch_field(
        8192, NUMERICS, flag=None, applies=_rope_scaling)
    """Llama 3.1 scaling: the context length the model was first trained at (Megatron-LM's is 8192)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = arch_field("LayerNorm")
    """Normalization layer."""
    norm_epsilon: float = arch_field(1e-5, NUMERICS)
    """Epsilon of the normalization layers."""
    apply_layernorm_1p: bool = arch_field(False)
    """Zero-centered norm weights: every LayerNorm/RMSNorm scales by (1 + weight), with weight starting at 0."""
    qk_layernorm: bool = arch_field(False)
    """Normalize each query and key head (over its channels, with --normalization) before the rotary embedding."""
    swiglu: bool = arch_field(False)
    """Use a SwiGLU MLP (Llama) instead of GeLU."""
    parallel_attn: bool = arch_field(False, flag=Flag("--parallel_attn", aliases=("--parallel-attn",)))
    """Attention and MLP side by side on the same input, both added to the residual: x + attention(norm(x)) + mlp(norm(x)) (Falcon; Megatron-LLM's flag)."""
    parallel_layernorm: bool = arch_field(False, flag=Flag("--parallel_layernorm", aliases=("--parallel-layernorm",)),
                                          applies=lambda config: config.parallel_attn)
    """With --parallel_attn: the MLP reads a norm of its own, x + attention(norm1(x)) + mlp(norm2(x)) (Falcon-40B's new decoder architecture); without, one norm feeds both (Falcon-7B)."""
    openai_gelu: bool = arch_field(False, NUMERICS, applies=lambda config: not config.swiglu)
    """Use the tanh approximation of GeLU (GPT-2)."""
    untie_embeddings_and_output_weights: bool = arch_field(False)
    """Separate input embedding and output layer weights."""
    # -- Multi-latent attention (DeepSeek-V3; the fields apply only with --multi-latent-attention) ---
    multi_latent_attention: bool = arch_field(False)
    """Multi-latent attention (DeepSeek-V2/V3): queries and keys/values are projected through low-rank latents, and each head's query and key are a part without position embedding and a rotated part (the key's shared by all heads)."""
    q_lora_rank: Optional[int] = arch_field(None, applies=_mla)
    """Rank of the query latent (normalized, then projected to the heads); unset: queries are projected from the hidden state directly."""
    kv_lora_rank: int = arch_field(32, applies=_mla)
    """Rank of the key/value latent (normalized, then projected to each head's key and value)."""
    qk_head_dim: int = arch_field(128, applies=_mla)
    """Channels per query/key head without position embedding."""
    qk_pos_emb_head_dim: int = arch_field(64, applies=_mla)
    """Channels per query/key head that carry the rotary embedding (projected from the hidden state for the key, shared by all heads)."""
    v_head_dim: int = arch_field(128, applies=_mla)
    """Channels per value head."""
    rope_type: Optional[Literal["rope", "yarn"]] = arch_field(None, NUMERICS, applies=_mla,
                                                              compared_as=_effective_rope_type)
    """Rotary embedding of multi-latent attention: rope, or yarn (YaRN: --rotary-scaling-factor, --mscale, --mscale-all-dim, --yarn-*); unset: yarn when --rotary-scaling-factor is not 1, else rope (Megatron-LM's default is yarn, which at factor 1 is plain RoPE). Other attention ignores it, as in Megatron-Core (Megatron-LM's --position-embedding-type yarn is not built)."""
    rotary_scaling_factor: float = arch_field(1.0, NUMERICS, applies=_yarn)
    """YaRN: how many times the context is extended beyond --yarn-original-max-position-embeddings (DeepSeek-V3: 40); long wavelengths are slowed by it, short ones kept, the band between interpolated."""
    mscale: float = arch_field(1.0, NUMERICS, applies=_yarn)
    """YaRN: the rotated channels are scaled by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1) (Megatron-Core's concentration factor)."""
    mscale_all_dim: float = arch_field(0.0, NUMERICS, applies=_yarn)
    """YaRN: with m = 0.1 mscale_all_dim ln(factor) + 1, the attention scale 1/sqrt(qk-head-dim + qk-pos-emb-head-dim) is multiplied by m^2 and the rotated channels divided by m (DeepSeek-V3: 1.0; 0: neither)."""
    yarn_original_max_position_embeddings: int = arch_field(4096, NUMERICS, applies=_yarn)
    """YaRN: the context length the model was first trained at, which sets the band of interpolated frequencies (Megatron-Core's multi-latent attention field original_max_position_embeddings, default 4096)."""
    yarn_beta_fast: float = arch_field(32.0, NUMERICS, applies=_yarn)
    """YaRN: frequencies that turn more than this many times over the original context are kept (Megatron-Core's field beta_fast, default 32)."""
    yarn_beta_slow: float = arch_field(1.0, NUMERICS, applies=_yarn)
    """YaRN: frequencies that turn fewer than this many times over the original context are slowed by the whole factor (Megatron-Core's field beta_slow, default 1)."""
    yarn_correction_range_round_to_int: bool = arch_field(True, NUMERICS, applies=_yarn, flag=Flag(
        "--no-yarn-correction-range-round-to-int", "store_false",
        "YaRN: keep the interpolation band's bounds fractional instead of rounding them outwards to whole channels."))
    """YaRN: round the interpolation band's bounds outwards to whole channels (off with --no-yarn-correction-range-round-to-int)."""
    # -- Multi-token prediction (DeepSeek-V3; transformer.multi_token_prediction) --------------------
    mtp_num_layers: Optional[int] = arch_field(None)
    """Multi-token prediction: this many modules after the last layer, the k-th predicting the token k + 1 ahead (an embedding of the tokens shifted by k joined with the previous depth's hidden state, one transformer layer, the shared output layer); their mean loss, times --mtp-loss-scaling-factor, is added to the training loss. Unset: none."""
    mtp_loss_scaling_factor: float = arch_field(0.1, RUN, applies=_mtp)
    """Weight of the multi-token prediction loss: this factor times the mean of the depths' losses is added to the language-model loss."""
    add_bias_linear: bool = arch_field(True, flag=Flag(
        "--disable-bias-linear", "store_false",
        "Disable the biases of the linear layers (as Llama); by default they have biases (as GPT)."))
    """Biases in linear layers (turned off with --disable-bias-linear)."""
    add_qkv_bias: bool = arch_field(False)
    """Bias on the query/key/value projection only."""
    make_vocab_size_divisible_by: int = arch_field(128, NUMERICS)
    """Pad the vocabulary to a multiple of this times --tensor-model-parallel-size."""
    hidden_dropout: float = arch_field(0.1, RUN)
    """Dropout on the residual branches and embeddings."""
    attention_dropout: float = arch_field(0.1, RUN)
    """Dropout on attention probabilities."""
    init_method_std: float = arch_field(0.02, RUN)
    """Standard deviation of the normal weight initialization."""
    padded_vocab_size: Optional[int] = arch_field(None, RUN, flag=None)
    """The vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP (derived: `derive`)."""
    # -- Mixture of experts (docs/moe.md; the fields apply only with --num-experts) -----------------
    num_experts: Optional[int] = arch_field(None)
    """Routed experts per mixture-of-experts layer; unset: a dense model."""
    moe_layer_freq: str = arch_field("1", applies=_moe, compared_as=_layer_pattern)
    """Which layers are mixtures of experts: an integer N (every N-th layer, from the first) or a pattern with one 0/1 per layer such as '[0]*1+[1]*27' (first layer dense)."""
    moe_ffn_hidden_size: Optional[int] = arch_field(
        None, applies=_moe)
    """Hidden size of each expert; default --ffn-hidden-size."""
    moe_shared_expert_intermediate_size: Optional[int] = arch_field(None, applies=_moe)
    """Total hidden size of the shared experts every token goes through (Qwen2-MoE, DeepSeek); unset: none."""
    moe_shared_expert_gate: bool = arch_field(False, applies=_shared_experts)
    """Scale the shared experts' output by a per-token sigmoid gate (Qwen2-MoE); Megatron-Core's config field, set by Hugging Face conversion."""
    moe_router_topk: int = arch_field(2, NUMERICS, applies=_moe)
    """Experts each token is routed to."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = arch_field("softmax", NUMERICS, applies=_moe)
    """Router score: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = arch_field(False, NUMERICS, applies=_moe)
    """Softmax over all experts before choosing the top k (their weights then need not sum to 1)."""
    moe_router_topk_scaling_factor: Optional[float] = arch_field(None, NUMERICS, applies=_moe)
    """Multiply the chosen experts' weights by this factor."""
    moe_router_num_groups: Optional[int] = arch_field(None, NUMERICS, applies=_moe)
    """Group-limited routing: experts are split into this many groups (e.g. the EP size or the number of nodes)."""
    moe_router_group_topk: Optional[int] = arch_field(None, NUMERICS, applies=_moe)
    """Group-limited routing: groups each token may use."""
    moe_router_enable_expert_bias: bool = arch_field(False, NUMERICS, applies=_moe)
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, updated after each step towards even load, shifts which experts are chosen."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = arch_field(None, RUN, applies=_moe)
    """Precision of the router's GEMM and scores; default the parameters' dtype."""
    moe_router_bias_update_rate: float = arch_field(1e-3, RUN, applies=_moe)
    """Step of the expert-bias update."""
    moe_router_load_balancing_type: list[str] = arch_field(role=RUN, applies=_moe, default_factory=lambda: ["aux_loss"])
    """Load-balancing losses: aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss (per global batch) or none; several may be given, with one --moe-aux-loss-coeff each."""
    moe_aux_loss_coeff: list[float] = arch_field(role=RUN, applies=_moe, default_factory=lambda: [0.0])
    """Coefficient of each load-balancing loss (0: off)."""
    moe_z_loss_coeff: Optional[float] = arch_field(None, RUN, applies=_moe)
    """Coefficient of the router z-loss (ST-MoE); unset: off."""
    moe_input_jitter_eps: Optional[float] = arch_field(None, RUN, applies=_moe)
    """Multiply the router's input by uniform noise in [1 - eps, 1 + eps] during training."""
    moe_router_force_load_balancing: bool = arch_field(False, RUN, applies=_moe)
    """Route on random logits, so experts get even loads (benchmarks only)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = arch_field("allgather", RUN, applies=_moe)
    """How tokens reach their experts' ranks: allgather or alltoall (flex needs DeepEP and is refused)."""
    moe_grouped_gemm: bool = arch_field(False, RUN, applies=_moe)
    """Accepted: the experts run as grouped GEMMs (torch._grouped_mm) wherever PyTorch has them for the device and dtype (GPUs of compute capability 9.0+ in bf16; the CPU build in fp32 and bf16), with or without this flag; a loop of GEMMs elsewhere, the same arithmetic."""
    moe_expert_capacity_factor: Optional[float] = arch_field(None, RUN, applies=_moe)
    """Each expert takes at most ceil(tokens x topk / experts x factor) of a rank's tokens; the rest are dropped. Unset: no dropping."""
    moe_pad_expert_input_to_capacity: bool = arch_field(False, RUN, applies=_moe)
    """With --moe-expert-capacity-factor: fill every expert to its capacity (weight-0 padding)."""
    moe_token_drop_policy: Literal["probs", "position"] = arch_field("probs", RUN, applies=_moe)
    """Which tokens an expert over capacity keeps: the highest probabilities, or by position."""
    moe_layers: Optional[tuple] = arch_field(None, RUN, flag=None, applies=_moe)
    """Which layers are mixtures of experts: one 0/1 per layer, from --moe-layer-freq (derived: `derive`)."""

    # -- read by the layers (of a derived config) ---------------------------------------------
    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups

    def local_heads(self, tp_size: int) -> int:
        """Query heads on one tensor-parallel rank (see `check_tensor_parallel`)."""
        return self.num_attention_heads // tp_size

    def local_query_groups(self, tp_size: int) -> int:
        """Key/value heads on one tensor-parallel rank: the groups split over the ranks, or one
        group per rank, replicated, when there are more ranks than groups."""
        return max(1, self.num_query_groups // tp_size)

    @property
    def activation(self) -> str:
        """The MLP's activation: silu (SwiGLU), gelu_tanh (--openai-gelu) or gelu."""
        return "silu" if self.swiglu else ("gelu_tanh" if self.openai_gelu else "gelu")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raises, naming the flags, when this (derived) shape cannot be split over `tp_size` ranks."""
        flag = "--tensor-model-parallel-size"
        divide(self.num_attention_heads, tp_size, f"--num-attention-heads by {flag}")
        divide(self.ffn_hidden_size, tp_size, f"--ffn-hidden-size by {flag}")
        divide(self.padded_vocab_size, tp_size, f"padded vocabulary size by {flag}")
        groups = self.num_query_groups
        if groups >= tp_size:
            divide(groups, tp_size, f"--num-query-groups by {flag}")
        else:
            divide(tp_size, groups, f"{flag} by --num-query-groups (key/value heads are replicated)")
