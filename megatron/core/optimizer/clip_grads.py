"""This rank's share of the global gradient norm, and clipping by the global norm.

The optimizer sums the shares over its norm groups (tensor/pipeline, and data ranks when the state
is sharded). Each rank sums the squares of the gradients it owns, weighting replicated slices by 1/replicas
(see `TPLayout`) and skipping the last stage's copy of tied embeddings, so that the sum over the
model-parallel group counts every logical parameter exactly once. The gradients are cut into runs
of one weight (views, no copies: a whole gradient unless a fused parameter mixes parts replicated
differently, such as QKV with replicated key/value heads) and normed with one multi-tensor kernel
per weight.
"""
import math

import torch


def weighted_runs(param, start: int, numel: int) -> list:
    """[(lo, hi, weight)]: elements [start, start + numel) of `param`'s flattened (tensor-parallel
    local) tensor cut into runs of one replication weight 1/replicas; lo and hi count from start."""
    layout = param.tp_layout
    parts = [(offset, length, 1.0 / layout.replicas(part)) for part, offset, length in layout.local_offsets()]
    if len({weight for _, _, weight in parts}) == 1:
        return [(0, numel, parts[0][2])]
    stride = math.prod(param.shape[layout.dim + 1:])
    block = param.shape[layout.dim] * stride  # the parts repeat every block elements
    end = start + numel
    runs = []
    for base in range(start // block * block, end, block):
        for offset, length, weight in parts:
            lo, hi = max(base + offset * stride, start), min(base + (offset + length) * stride, end)
            if lo < hi:
                runs.append((lo - start, hi - start, weight))
    return runs


def weighted_grads(params: list, grads: list, starts: list = None) -> list:
    """[(gradient view, weight)] to count in the global norm. `grads[i]` is `params[i]`'s gradient,
    or with `starts` the flat piece of it beginning at element `starts[i]`. The last stage's
    tied-embedding copy is left out (the first stage counts it)."""
    entries = []
    for index, (param, grad) in enumerate(zip(params, grads)):
        if getattr(param, "shared_embedding", False):
            continue
        flat = grad.view(-1)
        start = 0 if starts is None else starts[index]
        entries.extend((flat[lo:hi], weight) for lo, hi, weight in weighted_runs(param, start, flat.numel()))
    return entries


def square_norm(entries: list, device: torch.device) -> torch.Tensor:
    """sum of weight x squared norm over [(tensor, weight)]: an fp32 scalar on `device` (zero when
    this rank holds no gradients, still on the device the collectives need)."""
    by_weight = {}
    for tensor, weight in entries:
        by_weight.setdefault(weight, []).append(tensor)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for weight, tensors in by_weight.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        total = total + torch.stack(norms).pow(2).sum().to(device) * weight
    return total


def local_square_norm(params: list, grads: list, device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global norm (fp32 scalar tensor on `device`)."""
    return square_norm(weighted_grads(params, grads), device)


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor clipping multiplies the gradients by (1.0: no clipping)."""
    if max_norm <= 0.0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1.0e-6))


def clip_grads(grads: list, grad_norm: float, max_norm: float) -> None:
    coefficient = clip_coefficient(grad_norm, max_norm)
    if grads and coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)
