"""Forward FLOPs per token, read off a built module (on the meta device, whole: tensor parallel size 1).

A module that declares `flops_per_token(seq_length)` gives its own count (attention adds its score
and value products; a mixture of experts counts the experts a token is routed to); any other module
counts 2 x in x out per token for each matrix it holds, plus its children's. The embedding lookup,
norms, biases and elementwise work are not counted (Megatron's model-FLOPs convention).
"""
import torch


def flops_per_token(module: torch.nn.Module, seq_length: int) -> int:
    """Forward FLOPs of one token through `module` in a sequence of `seq_length` tokens."""
    declared = getattr(module, "flops_per_token", None)
    if declared is not None:
        return declared(seq_length)
    return matmul_flops_per_token(module, seq_length)


def matmul_flops_per_token(module: torch.nn.Module, seq_length: int) -> int:
    """2 x in x out per token for each matrix `module` holds itself, plus its children's `flops_per_token`
    (for a module's own `flops_per_token` to start from)."""
    own = sum(2 * p.numel() for p in module.parameters(recurse=False) if p.dim() == 2)
    return own + sum(flops_per_token(child, seq_length) for child in module.children())


def causal_attention_flops_per_token(seq_length: int, heads: int, qk_dim: int, v_dim: int) -> int:
    """QK^T (2 s qk_dim per head) and the probabilities times V (2 s v_dim per head) for one query,
    causal: half the keys on average (Megatron's count)."""
    return seq_length * heads * (qk_dim + v_dim)
