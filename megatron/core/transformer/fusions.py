"""Elementwise chains that run as one kernel each when compiled: RMSNorm, RoPE, SwiGLU.

Eagerly, each is several memory-bound kernels over a full activation (RMSNorm upcasts, squares,
reduces, scales, casts and multiplies). With `TransformerConfig.fuse_elementwise` the modules call
the `torch.compile`d version instead, which inductor fuses into one kernel forward and one or two
backward. The eager functions are the reference; `tests/unit/test_fusions.py` checks the compiled
ones against them.
"""
import functools

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fc1's fused output [..., 2f] -> [..., f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d]; rotates the first rotary_dim = cos.shape[-1] channels, in fp32."""
    rotary_dim = cos.shape[-1]
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    x32 = rotated.float()
    out = (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)
    return torch.cat((out, passthrough), dim=-1) if passthrough.shape[-1] else out


@functools.lru_cache(maxsize=None)
def compiled(function):
    """The torch.compile'd `function` (compiled lazily on first call, once per process)."""
    return torch.compile(function, fullgraph=True, dynamic=False)


def pick(function, fuse: bool):
    return compiled(function) if fuse else function
