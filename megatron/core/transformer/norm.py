"""LayerNorm and RMSNorm, with their TP layout (replicated; summed grads under sequence parallelism)."""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import replicated_layout, set_layout
from megatron.core.transformer.fusions import pick, rms_norm


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float, dtype, device, fuse: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self._norm = pick(rms_norm, fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def build_norm(config, hidden_size: int, *, tp_size: int, tp_rank: int, device) -> torch.nn.Module:
    if config.normalization == "RMSNorm":
        norm = RMSNorm(hidden_size, config.norm_epsilon, config.params_dtype, device, fuse=config.fuse_elementwise)
    else:
        norm = LayerNorm(hidden_size, config.norm_epsilon, config.params_dtype, device)
    sequence_parallel = config.sequence_parallel and tp_size > 1
    for name, param in norm.named_parameters():
        layout = replicated_layout(param.shape, tp_size, tp_rank, sum_replica_grads=sequence_parallel)
        set_layout(param, layout, "ones" if name == "weight" else "zeros")
    return norm
