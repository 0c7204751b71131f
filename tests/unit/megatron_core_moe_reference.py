"""Runs Megatron-Core's own MoE routing functions on the inputs test_moe_router.py wrote: the
independent reference for our router.

Run with only Megatron-Core on PYTHONPATH (never our `megatron` package):

    python megatron_core_moe_reference.py IN.pt OUT.pt

IN.pt (weights_only) holds {"cases": [{"kind": ..., tensors and options}]}; OUT.pt gets one dict of
result tensors per case. The router case composes Megatron-Core's functions in the order of its
TopKRouter.routing (z-loss, top-k, capacity, load-balancing losses), with the losses attached by its
MoEAuxLossAutoScaler (scale 1), and returns the gradients of sum(probs * probe) with respect to the
router weight and input. The expert-bias case runs `get_updated_expert_bias` in a one-process gloo
group (the all-reduce over tp x dp x cp is the identity there).
"""
import os
import sys
import tempfile

import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils as mu


def topk(case):
    probs, routing_map = mu.topk_routing_with_score_function(
        case["logits"], case["topk"], use_pre_softmax=case["pre_softmax"], num_groups=case["num_groups"],
        group_topk=case["group_topk"], scaling_factor=case["scaling_factor"],
        score_function=case["score_function"], expert_bias=case.get("expert_bias"))
    return {"probs": probs, "routing_map": routing_map}


def dropping(case):
    probs, routing_map = mu.apply_router_token_dropping(
        case["probs"], case["routing_map"], case["topk"], case["capacity_factor"], case["drop_policy"],
        case["pad_to_capacity"])
    return {"probs": probs, "routing_map": routing_map}


def router(case):
    """Megatron-Core's TopKRouter.routing for one rank (tp x cp = 1), composed from its functions."""
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    weight = case["weight"].clone().requires_grad_(True)
    x = case["x"].clone().requires_grad_(True)
    seq, batch = x.shape[:2]
    topk_, experts, function = case["topk"], weight.shape[0], case["score_function"]
    logits = torch.nn.functional.linear(x, weight).view(-1, experts)
    if case["z_loss_coeff"] is not None:
        logits = mu.MoEAuxLossAutoScaler.apply(logits, mu.z_loss_func(logits, case["z_loss_coeff"]))
    probs, routing_map = mu.topk_routing_with_score_function(
        logits, topk_, use_pre_softmax=case["pre_softmax"], num_groups=case["num_groups"],
        group_topk=case["group_topk"], scaling_factor=case["scaling_factor"], score_function=function)
    aux_map, scores = mu.compute_routing_scores_for_aux_loss(logits, topk_, function)
    losses = {}
    for kind, coeff in case["coeffs"].items():
        kind_scores, kind_map = scores, aux_map
        if kind == "seq_aux_loss":
            kind_scores, kind_map = scores.reshape(seq, -1), aux_map.reshape(seq, -1)
        tokens = kind_map.sum(dim=0)
        loss = mu.switch_load_balancing_loss_func(kind_scores, tokens, kind_map.shape[0], topk_, experts, coeff)
        if kind == "seq_aux_loss":
            loss = loss / batch
        losses[kind] = loss.detach()
        probs = mu.MoEAuxLossAutoScaler.apply(probs, loss)
    (probs * case["probe"]).sum().backward()
    return {"probs": probs.detach(), "routing_map": routing_map, "weight_grad": weight.grad, "x_grad": x.grad,
            **{f"loss_{kind}": loss for kind, loss in losses.items()}}


def expert_bias(case):
    parallel_state.get_tensor_and_data_parallel_group = lambda with_context_parallel=False: None
    return {"bias": mu.get_updated_expert_bias(case["tokens_per_expert"].clone(), case["expert_bias"],
                                               case["rate"])}


def z_loss(case):
    return {"loss": mu.z_loss_func(case["logits"], case["coeff"])}


KINDS = {"topk": topk, "dropping": dropping, "router": router, "expert_bias": expert_bias, "z_loss": z_loss}


def main():
    source, target = sys.argv[1:3]
    cases = torch.load(source, weights_only=True)["cases"]
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            torch.save({"results": [KINDS[case["kind"]](case) for case in cases]}, target)
        finally:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
