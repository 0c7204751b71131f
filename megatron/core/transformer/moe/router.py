"""TopKRouter: chooses each token's experts and their weights, and attaches the balancing losses.

    hidden [T, h] -> logits = hidden W_r^T [T, E] -> z-loss -> top-k (moe_utils.topk_routing)
                  -> capacity (optional) -> load-balancing losses -> probs, routing_map [T, E]

A router sees this rank's tokens: its sequence shard under sequence parallelism (the TP ranks hold
different tokens; MoE with TP > 1 needs --sequence-parallel, as in Megatron-LM) and context
parallelism. The losses that count tokens (aux_loss, seq_aux_loss) sum the expert counts over the
`tp_cp` group, so every rank's loss is its share of the loss of the whole sequences; global_aux_loss
counts over `tp_dp_cp` and over the step's micro-batches. The losses are not added to the model's
output: their gradient enters in backward (`moe_utils.attach_aux_loss`).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.distributed import comm
from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import replicated_layout, set_layout
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.moe import moe_utils

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def aux_loss_coeffs(config) -> dict:
    """{load-balancing type: coefficient} for the types with a coefficient > 0
    (--moe-router-load-balancing-type and --moe-aux-loss-coeff, each one value or a list)."""
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    if len(coeffs) != len(types):
        raise ValueError(f"--moe-aux-loss-coeff has {len(coeffs)} values for {len(types)} "
                         f"--moe-router-load-balancing-type values {types}; give one per type")
    return {kind: float(coeff) for kind, coeff in zip(types, coeffs) if kind in LOSS_NAMES and coeff > 0}


class AuxLossTracker:
    """Per-layer sums of each auxiliary loss (divided by its coefficient, as Megatron-LM logs them)
    over the micro-batches of one step; read and cleared by the training loop."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.values = {}  # name -> [num_layers] tensor

    def add(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        if name not in self.values:
            self.values[name] = torch.zeros(self.num_layers, device=value.device)
        self.values[name][layer_number] += value.detach().float()


class TopKRouter(torch.nn.Module):
    compilable = {"route": "moe_router_fusion"}  # parallelize.py

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, layer_number: int, tp: TensorParallel = TensorParallel(),
                 tp_cp_group=None, tp_dp_cp_group=None, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number  # global index, for per-layer logging
        self.topk = config.moe_router_topk
        self.tp_cp_group, self.tp_dp_cp_group = tp_cp_group, tp_dp_cp_group
        self.coeffs = aux_loss_coeffs(config)
        self.router_dtype = _ROUTER_DTYPES[config.moe_router_dtype]
        self.route = moe_utils.route  # compiled under --moe-router-fusion (parallelize.py)
        self.weight = torch.nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                                     dtype=execution.params_dtype, device=device))
        # Sequence-parallel ranks route different tokens: their gradients are partial sums.
        partial = execution.sequence_parallel and tp.size > 1
        set_layout(self.weight, replicated_layout(self.weight.shape, tp.size, tp.rank, partial), "normal")
        self.aux_loss_scale = moe_utils.AuxLossScale()  # shared with the model (GPTModel sets it)
        self.tracker: Optional[AuxLossTracker] = None   # shared with the model, when it logs
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None
        if "global_aux_loss" in self.coeffs:
            self.register_buffer("global_tokens_per_expert", torch.zeros(config.num_experts, device=device),
                                 persistent=False)
            self.global_micro_batches = 0

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_dtype is None:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))

    def forward(self, x: torch.Tensor):
        """x: [s, b, h] -> probs [s*b, E] (the weight of each chosen expert), routing_map [s*b, E]."""
        seq_length, batch = x.shape[:2]
        if self.config.moe_input_jitter_eps is not None and self.training:
            eps = self.config.moe_input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(x).view(-1, self.config.num_experts)  # [T, E]
        if self.config.moe_router_force_load_balancing:
            logits = _RandomLogits.apply(logits)
        training = self.training and torch.is_grad_enabled()
        if training and self.config.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        c = self.config
        losses = training and bool(self.coeffs)
        probs, routing_map, aux_map, aux_scores = self.route(
            logits, self.topk, score_function=c.moe_router_score_function, pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor, expert_bias=self.expert_bias, aux_scores=losses)
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = moe_utils.drop_tokens_over_capacity(
                probs, routing_map, self.topk, c.moe_expert_capacity_factor, c.moe_token_drop_policy,
                c.moe_pad_expert_input_to_capacity)
        if losses:
            probs = self._attach_load_balancing_losses(probs, aux_map, aux_scores, seq_length, batch)
        if training and self.expert_bias is not None:
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _attach_z_loss(self, logits):
        coeff = self.config.moe_z_loss_coeff / comm.size(self.tp_cp_group)
        loss = moe_utils.z_loss(logits, coeff)
        self._track("z_loss", loss / coeff)
        return moe_utils.attach_aux_loss(logits, loss, self.aux_loss_scale)

    def _attach_load_balancing_losses(self, probs, routing_map, scores, seq_length: int, batch: int):
        """routing_map, scores [T, E]: the plain top-k and normalized scores the losses count."""
        num_experts, topk = self.config.num_experts, self.topk
        for kind, coeff in self.coeffs.items():
            group = self.tp_dp_cp_group if kind == "global_aux_loss" else self.tp_cp_group
            if kind == "seq_aux_loss":
                # One loss per sequence: the batch folds into the expert dimension, then averages.
                kind_scores, kind_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
            else:
                kind_scores, kind_map = scores, routing_map
            tokens_per_expert = kind_map.sum(dim=0).float()
            comm.all_reduce(tokens_per_expert, group)
            total_tokens = kind_map.shape[0] * comm.size(group)
            if kind == "global_aux_loss":
                self.global_tokens_per_expert += tokens_per_expert
                self.global_micro_batches += 1
                tokens_per_expert = self.global_tokens_per_expert / self.global_micro_batches
            loss = moe_utils.switch_load_balancing_loss(kind_scores, tokens_per_expert, total_tokens, topk,
                                                        num_experts, coeff)
            if kind == "seq_aux_loss":
                loss = loss / batch
            self._track(LOSS_NAMES[kind], loss / coeff)
            probs = moe_utils.attach_aux_loss(probs, loss, self.aux_loss_scale)
        return probs

    def _track(self, name: str, value: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.add(name, self.layer_number, value)

    def reset_global_aux_loss(self) -> None:
        """Starts a new step's count for global_aux_loss."""
        if hasattr(self, "global_tokens_per_expert"):
            self.global_tokens_per_expert.zero_()
            self.global_micro_batches = 0

    @torch.no_grad()
    def update_expert_bias(self, group) -> None:
        """After a step's backward: the bias update from the step's expert loads over `group`
        (all ranks that route tokens: tp x dp x cp), then a new count."""
        counts = self.local_tokens_per_expert.clone()
        comm.all_reduce(counts, group)
        self.expert_bias.copy_(moe_utils.updated_expert_bias(counts, self.expert_bias,
                                                             self.config.moe_router_bias_update_rate))
        self.local_tokens_per_expert.zero_()


class _RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing (benchmarks): random logits, so tokens spread evenly over the
    experts; the gradient passes straight through to the real logits."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _tracked_layers(config) -> int:
    """The decoder's layers, then the multi-token prediction layers (numbered after them)."""
    return config.num_layers + (config.mtp_num_layers or 0)


def share_moe_state(module: torch.nn.Module, config):
    """One AuxLossScale and one AuxLossTracker for all routers of a model chunk (None, None for a
    dense model): the schedule sets the one, the training loop reads the other."""
    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    if not routers:
        return None, None
    scale, tracker = moe_utils.AuxLossScale(), AuxLossTracker(_tracked_layers(config))
    for router in routers:
        router.aux_loss_scale, router.tracker = scale, tracker
    return scale, tracker


def _moe_models(model_chunks: list) -> list:
    models = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    return [model for model in models if getattr(model, "moe_aux_losses", None) is not None]


def finish_moe_step(model_chunks: list, groups) -> None:
    """After a step's backward, before the optimizer: the expert-bias update from the step's loads
    over every rank of the pipeline stage (tp x dp x cp), and a new count for global_aux_loss."""
    for model in _moe_models(model_chunks):
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            if router.expert_bias is not None:
                router.update_expert_bias(groups.tp_dp_cp)
            router.reset_global_aux_loss()


def aux_loss_names(config) -> list:
    """The auxiliary losses this config logs, with Megatron-LM's names."""
    names = [LOSS_NAMES[kind] for kind in aux_loss_coeffs(config)]
    return sorted(names + (["z_loss"] if config.moe_z_loss_coeff is not None else []))


def aux_loss_log_values(model_chunks: list, config, groups, num_microbatches: int, per_layer: bool = False) -> dict:
    """{name: tensor [value, 1]} of the step's auxiliary losses as Megatron-LM logs them: each loss
    divided by its coefficient, summed over the pipeline stages and over the ranks that hold shares
    of it (z_loss: averaged over the sequence shards), per MoE layer and micro-batch; in the
    [sum, count] form the training loop averages over data-parallel ranks. With `per_layer` also
    "moe/<name>_layer_<i>". Clears the trackers. Every rank calls it (it all-reduces)."""
    trackers = [model.moe_aux_losses for model in _moe_models(model_chunks)]
    # Megatron-LM counts the multi-token prediction layers among the MoE layers it averages over.
    num_moe_layers = max(1, sum(config.moe_layers) + (config.mtp_num_layers or 0))
    result = {}
    for name in aux_loss_names(config):
        values = torch.zeros(_tracked_layers(config), device=groups.device)
        for tracker in trackers:
            if name in tracker.values:
                values += tracker.values[name]
                tracker.values[name].zero_()
        comm.all_reduce(values, groups.pp)
        if name == "global_load_balancing_loss":
            comm.all_reduce(values, groups.tp_dp_cp)
        else:
            comm.all_reduce(values, groups.tp_cp)
        if name == "z_loss":
            values = values / comm.size(groups.tp_cp)
        values = values / num_microbatches
        one = torch.ones((), device=values.device)
        result[name] = torch.stack([values.sum() / num_moe_layers, one])
        if per_layer:
            for index, value in enumerate(values):
                result[f"moe/{name}_layer_{index}"] = torch.stack([value, one])
    return result
