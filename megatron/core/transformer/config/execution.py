"""ExecutionConfig: how the layers compute the model, apart from what the model is. A resume at
another layout, dtype or kernel changes only this object; the architecture (TransformerConfig)
stays what the checkpoint says."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ExecutionConfig:
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False              # norms and dropout on sequence shards over the TP ranks
    attention_backend: str = "auto"              # see attention.ATTENTION_BACKENDS
    fuse_elementwise: bool = False               # torch.compile RMSNorm, RoPE and SwiGLU (fusions.py)
    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    recompute_method: Optional[str] = None       # "uniform" or "block" (with full)
    recompute_num_layers: Optional[int] = None
    moe_layer_recompute: bool = False            # re-run each mixture-of-experts block in backward
    moe_permute_fusion: bool = False             # torch.compile the MoE permute and unpermute (token_dispatcher)
    moe_router_fusion: bool = False              # torch.compile the router's arithmetic (moe_utils.route)
    moe_router_padding_for_fp8: bool = False     # pad the routing, not the FP8 experts' rows (token_dispatcher)
    moe_grouped_wgrad: str = "grouped-mm"        # "triton", "per-expert", "auto": the experts' weight gradients into main_grad
    cp_comm_type: str = "p2p"                    # context parallelism: "p2p", "all_gather" or "a2a"
    gradient_accumulation_fusion: bool = True    # linears/embedding accumulate weight grads into main_grad
    cross_entropy_loss_fusion: bool = True       # chunked fused cross entropy (tensor_parallel.cross_entropy)
    fp8: Optional[str] = None                    # None, "e4m3" or "hybrid" (see transformer.fp8)
    fp8_recipe: str = "delayed"                  # "delayed", "tensorwise", "rowwise" or "blockwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"   # or "max"
    first_last_layers_bf16: bool = False         # keep the first/last layers below out of FP8
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1


DEFAULT_EXECUTION = ExecutionConfig()
