"""Elementwise chains that run as one kernel each when compiled: RMSNorm (alone, or with the
residual add before it), RoPE, SwiGLU.

Eagerly, each is several memory-bound kernels over a full activation (RMSNorm upcasts, squares,
reduces, scales, casts and multiplies). With `ExecutionConfig.fuse_elementwise` the modules call
the `torch.compile`d version instead (swapped in by `parallelize.py`), which inductor fuses into one kernel forward and one or two
backward. The eager functions are the reference; `tests/unit/test_fusions.py` checks the compiled
ones against them.
"""
import torch
import torch.nn.functional as F

from megatron.core.utils import compiled, pick

__all__ = ["compiled", "pick", "rms_norm", "rms_norm_1p", "swiglu", "rotary", "rotary_interleaved"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (1 + weight) (zero-centered weight), in fp32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (weight.float() + 1.0)).to(x.dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + delta, rms_norm(residual + delta)): a residual connection and the norm after it.
    Compiled, one kernel forward, and in backward the sum of the two gradients that reach the new
    residual (from the next residual add and through the norm) happens in the norm's kernel."""
    x = residual + delta
    return x, rms_norm(x, weight, eps)


def add_rms_norm_1p(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """As `add_rms_norm`, with the zero-centered weight of `rms_norm_1p`."""
    x = residual + delta
    return x, rms_norm_1p(x, weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fc1's fused output [..., 2f] -> [..., f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved convention's rotation."""
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    # Written contiguous in x's logical order whatever x's strides (a view of the fused QKV output),
    # so the attention kernels see q and k laid out as the caller ordered them (attention.py).
    x32 = rotated.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    out = (x32 * cos + rotate(x32) * sin).to(x.dtype)
    return torch.cat((out, passthrough), dim=-1) if passthrough.shape[-1] else out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d]; rotates the first rotary_dim = cos.shape[-1] channels, in fp32: channel
    i pairs with channel i + rotary_dim/2 (rotate-half, as Llama in Hugging Face format)."""
    return _rotate(x, cos, sin, _rotate_half)


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As `rotary`, with channel 2i paired with 2i+1 (Megatron's --rotary-interleaved, the original
    Llama and GPT-J layout); cos/sin then repeat each frequency twice in a row."""
    return _rotate(x, cos, sin, _rotate_pairs)
