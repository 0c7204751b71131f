"""The model's shape as the planner reads it, and its parameter counts.

`architecture()` is the one place that reads the model description (the core `TransformerConfig`
with its derived values: padded vocabulary, FFN size default, kv channels, query groups). Every
other planning module takes the `Architecture` it returns, so a change to the model description
changes this function alone. Mixture-of-experts layers are not planned yet: the dense model only.
"""
from dataclasses import dataclass


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

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.kv_channels


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
        attention_dropout=c.attention_dropout)


def _norm_parameters(arch: Architecture, width: int) -> int:
    return (2 if arch.layernorm else 1) * width  # weight (+ bias)


def layer_parameters(arch: Architecture, tp: int) -> int:
    """Elements of one decoder layer's parameters on one tensor-parallel rank (key/value heads are
    replicated when TP exceeds the query groups)."""
    a, h, f = arch, arch.hidden_size, arch.ffn_hidden_size
    q_local = a.query_size // tp
    kv_local = a.kv_channels * a.num_query_groups // min(tp, a.num_query_groups)
    qkv_out = q_local + 2 * kv_local
    qkv = h * qkv_out + (qkv_out if a.add_bias_linear or a.add_qkv_bias else 0)
    proj = q_local * h + (h if a.add_bias_linear else 0)
    fc1_out = (2 if a.gated_linear_unit else 1) * f // tp
    mlp = h * fc1_out + f // tp * h + ((fc1_out + h) if a.add_bias_linear else 0)
    qk_norms = 2 * _norm_parameters(a, a.kv_channels) if a.qk_layernorm else 0
    return 2 * _norm_parameters(a, h) + qkv + proj + qk_norms + mlp


def stage_parameters(arch: Architecture, tp: int, num_layers: int, *, first: bool, last: bool, pp: int) -> int:
    """Elements of one pipeline stage's parameters on one tensor-parallel rank (the last stage of a
    pipeline with tied embeddings holds its own copy of the embedding as the output layer)."""
    total = num_layers * layer_parameters(arch, tp)
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


def total_parameters(arch: Architecture) -> int:
    """Elements of the whole model (tied embeddings counted once)."""
    return stage_parameters(arch, 1, arch.num_layers, first=True, last=True, pp=1)


def flops_per_iteration(arch: Architecture, global_batch_size: int, seq_length: int) -> float:
    """Megatron's model FLOPs per iteration, as the log line counts them (megatron/training/logging.py;
    causal attention counted as half, recomputation not counted): 6 B s [L (m h f + 2 h q + 2 h k g + s q) + h V]."""
    a, h = arch, arch.hidden_size
    m = 3 if a.gated_linear_unit else 2
    per_layer = m * h * a.ffn_hidden_size + 2 * h * a.query_size + 2 * h * a.kv_size + seq_length * a.query_size
    return 6.0 * global_batch_size * seq_length * (a.num_layers * per_layer + h * a.vocab_size)
