"""Model shape flags (Megatron-LM names)."""
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class ModelConfig:
    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Transformer hidden size."""
    num_attention_heads: int
    """Number of attention (query) heads."""
    ffn_hidden_size: Optional[int] = None
    """Hidden size of the MLP; default 4 x --hidden-size, or with --swiglu int(8 x --hidden-size / 3 / 64) x 64 (as Megatron-LM)."""
    kv_channels: Optional[int] = None
    """Channels per attention head; default --hidden-size / --num-attention-heads."""
    group_query_attention: bool = False
    """Use grouped-query attention (see --num-query-groups)."""
    num_query_groups: int = 1
    """Number of key/value groups with --group-query-attention."""
    max_position_embeddings: Optional[int] = None
    """Maximum sequence length the position embeddings cover; default --seq-length."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """Position embedding: learned absolute (GPT) or rotary (Llama)."""
    rotary_base: int = 10000
    """Base of the rotary embedding frequencies (Llama 2: 10000, Llama 3: 500000)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that is rotated."""
    use_rope_scaling: bool = False
    """Apply Llama 3.1 rotary frequency scaling (factor 8, low 1, high 4, original 8192)."""
    rope_scaling_factor: float = 8.0
    """Scaling factor for --use-rope-scaling."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization layer."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    swiglu: bool = False
    """Use a SwiGLU MLP (Llama) instead of GeLU."""
    openai_gelu: bool = False
    """Use the tanh approximation of GeLU (GPT-2)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""
    add_bias_linear: bool = True
    """Biases in linear layers (turned off with --disable-bias-linear)."""
    add_qkv_bias: bool = False
    """Bias on the query/key/value projection only."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches and embeddings."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times --tensor-model-parallel-size."""
    use_flash_attn: bool = False
    """Use the flash-attn package if installed (otherwise SDPA's flash kernel)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer implementation: local (plain PyTorch) or transformer_engine."""
    no_torch_compile: bool = False
    """Run RMSNorm, RoPE and SwiGLU eagerly. By default they are torch.compile'd into fused kernels on GPU (never on CPU)."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weights: every LayerNorm/RMSNorm scales by (1 + weight), with weight starting at 0."""
    qk_layernorm: bool = False
    """Normalize each query and key head (over its channels, with --normalization) before the rotary embedding."""
    rotary_interleaved: bool = False
    """Rotary embedding on interleaved channel pairs (2i, 2i+1) instead of halves (i, i + d/2)."""
