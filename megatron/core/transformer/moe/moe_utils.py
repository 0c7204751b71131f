"""The arithmetic of top-k routing, the load-balancing losses and expert capacity, as plain functions
of tensors (Megatron-Core's definitions; tests/unit/test_moe_router.py checks each against
Megatron-Core's own function on random inputs).

Shapes: `logits`, `scores`, `probs` and `routing_map` are [tokens, experts]; `routing_map` is a
boolean mask of the experts each token is sent to, `probs` the weight of each chosen expert's output
(zero elsewhere).
"""
import ast
import math
from typing import Optional

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k among the experts of the `group_topk` best groups of each token (DeepSeek's device- or
    node-limited routing). A group's score is the sum of its best topk/group_topk expert scores."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, groups]
    chosen_groups = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None, expert_bias: Optional[torch.Tensor] = None):
    """(probs, routing_map) [T, E] from the router's logits [T, E].

    softmax: the softmax over the chosen experts' logits (Mixtral, Qwen3-MoE: the chosen weights sum
    to 1), or with `pre_softmax` the chosen entries of the softmax over all experts. sigmoid: the
    chosen sigmoid scores, normalized to sum to 1 when topk > 1 (DeepSeek-V3); `expert_bias` shifts
    only which experts are chosen, never their weights. `scaling_factor` multiplies the weights."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, chosen = _topk(scores, topk, num_groups, group_topk)
        else:
            top_logits, chosen = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, chosen = _topk(scores + expert_bias, topk, num_groups, group_topk)
            probs = scores.gather(1, chosen)
        else:
            probs, chosen = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"`moe_router_score_function` must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, chosen, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return routing_probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map, scores) the load-balancing losses use: the plain top-k of the normalized scores
    over all experts (no groups, no bias, no capacity)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = scores.topk(topk, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True), scores


def route(logits: torch.Tensor, topk: int, *, score_function: str, pre_softmax: bool,
          num_groups: Optional[int], group_topk: Optional[int], scaling_factor: Optional[float],
          expert_bias: Optional[torch.Tensor], aux_scores: bool):
    """The router's arithmetic on logits [T, E] in one function, which --moe-router-fusion compiles
    (score function, top-k, normalization, and the scores of the load-balancing losses):
    (probs, routing_map) of `topk_routing`, then with `aux_scores` the (routing_map, scores) of
    `scores_for_aux_loss`, else (None, None)."""
    probs, routing_map = topk_routing(logits, topk, score_function=score_function, pre_softmax=pre_softmax,
                                      num_groups=num_groups, group_topk=group_topk,
                                      scaling_factor=scaling_factor, expert_bias=expert_bias)
    if not aux_scores:
        return probs, routing_map, None, None
    return (probs, routing_map) + scores_for_aux_loss(logits, topk, score_function)


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """Switch Transformer's loss E * sum_i f_i * P_i, with f_i the fraction of the `total_num_tokens`
    x topk assignments that went to expert i (`tokens_per_expert`, counted over the tokens the loss
    spans) and P_i the mean score of expert i; `probs` may hold only this rank's tokens, so the sum
    over ranks is the loss of all tokens."""
    per_expert = probs.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff * mean(logsumexp(logits)^2), keeping the logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ceil(num_tokens / num_experts * capacity_factor)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_tokens_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                              drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Megatron-Core's per-rank capacity rule: each expert keeps at most
    ceil(T * topk / E * capacity_factor) of this rank's T tokens, those with the highest
    probability (`probs`) or routed ones by position (`position`: the routed entries in the order
    torch.topk returns equal values, as Megatron-Core); with `pad_to_capacity` every expert gets
    exactly that many slots (unrouted slots carry weight 0)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            kept = probs.topk(capacity, dim=0, sorted=False).indices
        elif drop_policy == "position":
            kept = routing_map.int().topk(capacity, dim=0, sorted=False).indices
        else:
            raise ValueError(f"`moe_token_drop_policy` must be one of {DROP_POLICIES}, got {drop_policy!r}")
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: each expert's bias moves by `rate` towards the mean load
    (up when it got fewer tokens than the mean, down when more). `tokens_per_expert` is the count
    over all ranks since the last update."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(mean - tokens_per_expert) * rate


class AuxLossScale:
    """The factor the load-balancing and z-loss gradients are multiplied by in backward: the loss
    scale (fp16) x context-parallel size / micro-batches, set by the schedule before each
    micro-batch's forward, so the auxiliary losses are averaged like the language-model loss."""

    def __init__(self):
        self.value = 1.0


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output`; in backward, also sends `scale.value` as the gradient of `aux_loss`, so
    the loss is optimized without being added to the model's output."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss) * ctx.scale.value, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    return _AttachAuxLoss.apply(output, aux_loss, scale)


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> list:
    """[1 if layer i is a mixture of experts else 0 for each layer] from --moe-layer-freq: an integer
    N (every N-th layer from the first, Megatron-LM's rule i % N == 0), or a list, or Megatron-LM's
    pattern string such as "[0]*1+[1]*27" or "([1]*3+[0])*2" (integers, lists, + and *)."""
    if isinstance(moe_layer_freq, str):
        moe_layer_freq = _parse_pattern(moe_layer_freq)
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1 or a pattern list, got {moe_layer_freq}")
        return [1 if index % moe_layer_freq == 0 else 0 for index in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or any(value not in (0, 1) for value in pattern):
        raise ValueError(f"--moe-layer-freq pattern {pattern} must have one 0 or 1 per layer "
                         f"(--num-layers {num_layers})")
    return pattern


def _parse_pattern(text: str):
    """An int or list from a --moe-layer-freq string, evaluated without eval()."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(element) for element in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"--moe-layer-freq {text!r} is neither an integer nor a pattern such as "
                         "'[0]*1+[1]*27' (lists of 0/1 joined with + and *)") from None
