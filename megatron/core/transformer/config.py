"""TransformerConfig: the model's shape and numerics, independent of how it is launched."""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.utils import divide


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int                              # padded vocabulary size (divisible by TP)
    ffn_hidden_size: Optional[int] = None        # default 4 * hidden_size
    kv_channels: Optional[int] = None            # default hidden_size // num_attention_heads
    num_query_groups: Optional[int] = None       # default num_attention_heads (multi-head attention)
    max_position_embeddings: int = 4096
    normalization: str = "LayerNorm"             # or "RMSNorm"
    norm_epsilon: float = 1e-5
    gated_linear_unit: bool = False              # SwiGLU when True (with silu)
    activation: str = "gelu"                     # "gelu", "gelu_tanh" or "silu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False                   # bias on q/k/v alone (Qwen style); implied by add_bias_linear
    position_embedding_type: str = "learned_absolute"  # or "rope", "none"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False                   # Llama 3.1 frequency scaling
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    attention_backend: str = "auto"              # see attention.ATTENTION_BACKENDS
    fuse_elementwise: bool = False               # torch.compile RMSNorm, RoPE and SwiGLU (fusions.py)
    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    recompute_method: Optional[str] = None       # "uniform" or "block" (with full)
    recompute_num_layers: Optional[int] = None
    cp_comm_type: str = "p2p"                    # context parallelism: "p2p", "all_gather" or "a2a"
    gradient_accumulation_fusion: bool = True    # linears/embedding accumulate weight grads into main_grad
    cross_entropy_loss_fusion: bool = True       # chunked fused cross entropy (tensor_parallel.cross_entropy)
    fp8: Optional[str] = None                    # None, "e4m3" or "hybrid" (see transformer.fp8)
    fp8_recipe: str = "delayed"                  # "delayed", "tensorwise" or "rowwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"   # or "max"
    first_last_layers_bf16: bool = False         # keep the first/last layers below out of FP8
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    qk_layernorm: bool = False                   # normalize each query and key head (over kv_channels) before RoPE
    layernorm_zero_centered_gamma: bool = False  # norms multiply by (1 + weight), weight initialized to 0
    rotary_interleaved: bool = False             # RoPE rotates channel pairs (2i, 2i+1), not (i, i + d/2)
    # -- Mixture of experts (Megatron-LM's argument names; see megatron/core/transformer/moe/) --------
    num_experts: Optional[int] = None            # routed experts per MoE layer; None: a dense model
    moe_layer_freq: Union[int, list, str] = 1    # every N-th layer is MoE, or a 0/1 list (or its pattern string)
    moe_ffn_hidden_size: Optional[int] = None    # each expert's hidden size; default ffn_hidden_size
    moe_shared_expert_intermediate_size: Optional[int] = None  # shared experts' total hidden size
    moe_shared_expert_gate: bool = False         # sigmoid gate on the shared experts' output (Qwen2-MoE)
    moe_grouped_gemm: bool = False               # experts as grouped GEMMs (torch._grouped_mm) where supported
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"   # or "sigmoid"
    moe_router_pre_softmax: bool = False         # softmax over all experts before top-k
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_dtype: Optional[str] = None       # None (params dtype), "fp32" or "fp64" router GEMM/scores
    moe_router_num_groups: Optional[int] = None  # group-limited routing: expert groups
    moe_router_group_topk: Optional[int] = None  # group-limited routing: groups chosen per token
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: Union[str, list] = "aux_loss"  # aux_loss|seq_aux_loss|global_aux_loss|none
    moe_aux_loss_coeff: Union[float, list] = 0.0  # one per load-balancing type
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_router_force_load_balancing: bool = False  # random logits (benchmarks)
    moe_token_dispatcher_type: str = "allgather"  # or "alltoall"
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"         # or "position"
    moe_layer_recompute: bool = False            # re-run each MoE layer in backward

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            self.kv_channels = divide(self.hidden_size, self.num_attention_heads,
                                      "--hidden-size by --num-attention-heads")
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        divide(self.num_attention_heads, self.num_query_groups, "--num-attention-heads by --num-query-groups")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.position_embedding_type not in ("rope", "learned_absolute", "none"):
            raise ValueError("--position-embedding-type must be rope, learned_absolute or none, "
                             f"got {self.position_embedding_type!r}")

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raises, naming the flags, when this shape cannot be split over `tp_size` ranks."""
        flag = "--tensor-model-parallel-size"
        divide(self.num_attention_heads, tp_size, f"--num-attention-heads by {flag}")
        divide(self.ffn_hidden_size, tp_size, f"--ffn-hidden-size by {flag}")
        divide(self.vocab_size, tp_size, f"padded vocabulary size by {flag}")
        groups = self.num_query_groups
        if groups >= tp_size:
            divide(groups, tp_size, f"--num-query-groups by {flag}")
        else:
            divide(tp_size, groups, f"{flag} by --num-query-groups (key/value heads are replicated)")
