"""LayerNorm and RMSNorm, with their TP layout (replicated; summed grads under sequence parallelism).

With `apply_layernorm_1p` (Megatron's --apply-layernorm-1p) a norm multiplies by
(1 + weight) and its weight starts at zero; the scale is formed in fp32, so a small weight is not
lost to rounding in bf16."""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import replicated_layout, set_layout
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.fusions import add_rms_norm, add_rms_norm_1p, rms_norm, rms_norm_1p


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (or * (1 + weight)), computed in fp32."""

    compilable = {"_norm": "fuse_elementwise", "_add_norm": "fuse_elementwise"}  # parallelize.py

    def __init__(self, hidden_size: int, eps: float, dtype, device, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self._norm = rms_norm_1p if zero_centered else rms_norm
        self._add_norm = add_rms_norm_1p if zero_centered else add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple:
        """(residual + delta, its norm): one kernel when compiled (fusions.add_rms_norm)."""
        return self._add_norm(residual, delta, self.weight, self.eps)


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype, device, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        normed = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps)
        return (normed * (self.weight.float() + 1.0) + self.bias.float()).to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple:
        x = residual + delta
        return x, self(x)


def build_norm(config, hidden_size: int, *, execution=DEFAULT_EXECUTION, tp: TensorParallel = TensorParallel(),
               device, partial_grads: Optional[bool] = None) -> torch.nn.Module:
    """A norm over `hidden_size` channels, replicated on every TP rank. Its gradients are partial
    sums to be added over the TP group when the ranks normalize different activations: the
    sequence shards under sequence parallelism (the default of `partial_grads`), or their own
    attention heads (query/key norms)."""
    zero_centered = config.apply_layernorm_1p
    dtype = execution.params_dtype
    if config.normalization == "RMSNorm":
        norm = RMSNorm(hidden_size, config.norm_epsilon, dtype, device, zero_centered=zero_centered)
    else:
        norm = LayerNorm(hidden_size, config.norm_epsilon, dtype, device, zero_centered=zero_centered)
    if partial_grads is None:
        partial_grads = execution.sequence_parallel
    partial_grads = partial_grads and tp.size > 1
    for name, param in norm.named_parameters():
        layout = replicated_layout(param.shape, tp.size, tp.rank, sum_replica_grads=partial_grads)
        set_layout(param, layout, "ones" if name == "weight" and not zero_centered else "zeros")
    return norm
