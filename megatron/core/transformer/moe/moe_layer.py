"""MoELayer: the feed-forward block of a mixture-of-experts layer.

    x [s, b, h] -> router -> probs, routing_map [s*b, E]
                -> dispatch (tokens to their experts' ranks, sorted by expert)
                -> experts (each row through its expert: grouped GEMMs)
                -> combine (back to the tokens' ranks, weighted by probs, summed over experts)  [s, b, h]
                (+ shared experts, every token)

With sequence parallelism x is this rank's sequence shard [s/tp, b, h] and so is the output; the
router and dispatcher see only this rank's tokens.
"""
import torch

from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.flops import flops_per_token
from megatron.core.transformer.moe.experts import GroupedMLP, SharedExpertMLP
from megatron.core.transformer.moe.fp8_experts import FP8_ALIGNMENT
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import DISPATCHER_TYPES, AllGatherDispatcher, AllToAllDispatcher
from megatron.core.utils import divide


class MoELayer(torch.nn.Module):
    compilable = {"dispatcher.local.permute_rows": "moe_permute_fusion",  # parallelize.py
                  "dispatcher.local.unpermute": "moe_permute_fusion"}

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, layer_number: int, groups, device):
        super().__init__()
        ep = groups.ep_size
        self.num_local_experts = divide(config.num_experts, ep, "--num-experts by --expert-model-parallel-size")
        expert_offset = groups.ep_rank * self.num_local_experts
        tp = groups.tensor_parallel
        self.router = TopKRouter(config, execution=execution, layer_number=layer_number, tp_cp_group=groups.tp_cp,
                                 tp_dp_cp_group=groups.tp_dp_cp, device=device, tp=tp)
        self.experts = GroupedMLP(config, execution=execution, num_local_experts=self.num_local_experts, expert_offset=expert_offset,
                                  etp=groups.expert_tensor_parallel, device=device, tp=tp)
        if config.moe_token_dispatcher_type not in DISPATCHER_TYPES:
            raise ValueError(f"--moe-token-dispatcher-type must be one of {DISPATCHER_TYPES}, "
                             f"got {config.moe_token_dispatcher_type!r}")
        _check_router_padding(config, execution)
        routing = dict(topk=config.moe_router_topk, num_experts=config.num_experts,
                       capacity=config.moe_expert_capacity_factor is not None,
                       pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity))
        if config.moe_token_dispatcher_type == "alltoall":
            pad_multiple = FP8_ALIGNMENT if execution.moe_router_padding_for_fp8 else None
            self.dispatcher = AllToAllDispatcher(num_local_experts=self.num_local_experts, ep_group=groups.ep,
                                                 etp_group=groups.etp, pad_multiple=pad_multiple, **routing)
        else:
            self.dispatcher = AllGatherDispatcher(num_local_experts=self.num_local_experts,
                                                  expert_offset=expert_offset, group=groups.etp_ep, **routing)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, execution=execution, device=device, tp=tp)

    def forward(self, x):
        shape = x.shape                                                   # [s, b, h]
        probs, routing_map = self.router(x)                               # [s*b, E] each
        tokens, tokens_per_expert = self.dispatcher.dispatch(x.reshape(-1, shape[-1]), probs, routing_map)
        expert_output = self.experts(tokens, tokens_per_expert)          # [N, h], not yet weighted
        out = self.dispatcher.combine(expert_output).view(shape)          # weighted by probs, summed
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def flops_per_token(self, seq_length: int) -> int:
        """Forward FLOPs per token (transformer.flops), Megatron-LM's count: the top-k experts a token
        is routed to and the shared experts' MLP; the router's GEMM, the shared experts' gate,
        capacity padding and dropped tokens are not counted."""
        weights = self.experts.fc1_weight[0].numel() + self.experts.fc2_weight[0].numel()  # one local expert
        routed = 2 * self.router.topk * weights
        return routed + (flops_per_token(self.shared_experts.mlp, seq_length) if self.shared_experts is not None else 0)


def _check_router_padding(config, execution) -> None:
    """--moe-router-padding-for-fp8 as Megatron-Core accepts it: FP8 experts, the alltoall dispatcher."""
    if not execution.moe_router_padding_for_fp8:
        return
    if execution.fp8 is None:
        raise ValueError("--moe-router-padding-for-fp8 needs --fp8-format (it pads the routing for the FP8 experts)")
    if config.moe_token_dispatcher_type != "alltoall":
        raise ValueError("--moe-router-padding-for-fp8 needs --moe-token-dispatcher-type alltoall "
                         "(as in Megatron-Core)")
    if config.moe_pad_expert_input_to_capacity:
        raise ValueError("--moe-router-padding-for-fp8 and --moe-pad-expert-input-to-capacity both pad the experts' "
                         "input: use one of them")
