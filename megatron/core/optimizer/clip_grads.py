"""This rank's share of the global gradient norm, and clipping by the global norm.

The optimizer sums the shares over its norm groups (tensor/pipeline, and data ranks when the state
is sharded). Each rank sums the squares of the gradients it owns, weighting replicated slices by 1/replicas
(`TPLayout.unique_square_norm`) and skipping the last stage's copy of tied embeddings, so that the
sum over the model-parallel group counts every logical parameter exactly once.
"""
import torch


def local_square_norm(params: list, grads: list) -> torch.Tensor:
    """This rank's share of the squared global norm (fp32 scalar tensor on the gradients' device).

    Gradients whose parts are all replicated alike (every parameter at TP=1, and all but fused
    QKV with replicated key/value heads otherwise) are grouped by weight and normed with one
    multi-tensor kernel per group; the rest go part by part."""
    by_weight, total = {}, None
    for param, grad in zip(params, grads):
        if getattr(param, "shared_embedding", False):
            continue
        layout = param.tp_layout
        replicas = {layout.replicas(part) for part in layout.parts}
        if len(replicas) == 1:
            by_weight.setdefault(1.0 / replicas.pop(), []).append(grad)
        else:
            square = layout.unique_square_norm(grad)
            total = square if total is None else total + square
    for weight, tensors in by_weight.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        square = torch.stack(norms).pow(2).sum() * weight
        total = square if total is None else total + square
    if total is None:
        device = grads[0].device if grads else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    return total


def clip_grads(grads: list, grad_norm: float, max_norm: float) -> None:
    if max_norm <= 0.0 or not grads:
        return
    coefficient = max_norm / (grad_norm + 1.0e-6)
    if coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)
