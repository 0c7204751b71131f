"""Model shape flags (Megatron-LM names)."""
from dataclasses import dataclass, field
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
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local", "cudnn", "efficient", "math",
                               "flash_attn"] = "auto"
    """Attention kernel. auto: probed once at start-up on GPU (the fastest that runs; the log names it). Megatron's flash / fused / unfused|local map to SDPA's flash / cuDNN (then memory-efficient) / math kernels; cudnn, efficient, math pick one SDPA kernel; flash_attn the flash-attn package (FA3 on Hopper when installed)."""
    gradient_accumulation_fusion: bool = True
    """Accumulate linear and embedding weight gradients straight into the fp32 main_grad buffers (no param.grad); off with --no-gradient-accumulation-fusion. Not with --use-torch-fsdp2 (no main_grad there)."""
    cross_entropy_loss_fusion: bool = True
    """Chunked fused cross entropy: no fp32 copy of the logits, gradient written in place; off with --no-cross-entropy-loss-fusion."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Fused cross entropy implementation: native; te runs the native one too (with a note)."""
    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    """Train the transformer layers' linears in FP8 (torch._scaled_mm): e4m3 everywhere, or hybrid (E5M2 gradients)."""
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "custom"] = "delayed"
    """FP8 scaling: delayed (amax history), tensorwise (current amax), rowwise (per-row scales, e4m3). blockwise, mxfp8 and custom need Transformer Engine and are errors here."""
    fp8_margin: int = 0
    """FP8 scales are divided by 2^margin."""
    fp8_amax_history_len: int = 1
    """Micro-batches of amax history kept by the delayed recipe."""
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """How the delayed recipe reduces the amax history: most_recent or max."""
    first_last_layers_bf16: bool = False
    """With FP8: keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in bf16."""
    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept in bf16 with --first-last-layers-bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept in bf16 with --first-last-layers-bf16."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weights: every LayerNorm/RMSNorm scales by (1 + weight), with weight starting at 0."""
    qk_layernorm: bool = False
    """Normalize each query and key head (over its channels, with --normalization) before the rotary embedding."""
    rotary_interleaved: bool = False
    """Rotary embedding on interleaved channel pairs (2i, 2i+1) instead of halves (i, i + d/2)."""
    # -- Mixture of experts (Megatron-LM's flags; docs/moe.md) -----------------------------------------
    num_experts: Optional[int] = None
    """Routed experts per mixture-of-experts layer; unset: a dense model."""
    moe_layer_freq: str = "1"
    """Which layers are mixtures of experts: an integer N (every N-th layer, from the first) or a pattern with one 0/1 per layer such as '[0]*1+[1]*27' (first layer dense)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each expert; default --ffn-hidden-size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total hidden size of the shared experts every token goes through (Qwen2-MoE, DeepSeek); unset: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by a per-token sigmoid gate (Qwen2-MoE); Megatron-Core's config field, set by Hugging Face conversion."""
    moe_grouped_gemm: bool = False
    """Run the experts as grouped GEMMs (torch._grouped_mm on GPUs with bf16 and compute capability 9.0+; a loop of GEMMs elsewhere, the same arithmetic)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before choosing the top k (their weights then need not sum to 1)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiply the chosen experts' weights by this factor."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    """Precision of the router's GEMM and scores; default the parameters' dtype."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts are split into this many groups (e.g. the EP size or the number of nodes)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: groups each token may use."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, updated after each step towards even load, shifts which experts are chosen."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    moe_router_load_balancing_type: list[str] = field(default_factory=lambda: ["aux_loss"])
    """Load-balancing losses: aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss (per global batch) or none; several may be given, with one --moe-aux-loss-coeff each."""
    moe_aux_loss_coeff: list[float] = field(default_factory=lambda: [0.0])
    """Coefficient of each load-balancing loss (0: off)."""
    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss (ST-MoE); unset: off."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiply the router's input by uniform noise in [1 - eps, 1 + eps] during training."""
    moe_router_force_load_balancing: bool = False
    """Route on random logits, so experts get even loads (benchmarks only)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach their experts' ranks: allgather or alltoall (flex needs DeepEP and is refused)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Each expert takes at most ceil(tokens x topk / experts x factor) of a rank's tokens; the rest are dropped. Unset: no dropping."""
    moe_pad_expert_input_to_capacity: bool = False
    """With --moe-expert-capacity-factor: fill every expert to its capacity (weight-0 padding)."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an expert over capacity keeps: the highest probabilities, or by position."""
    moe_layer_recompute: bool = False
    """Recompute each mixture-of-experts block in backward instead of keeping its activations (how the model runs, not its architecture)."""
