"""Parameter and FLOP counts read off the model itself, built on the meta device.

The planner and the log line's TFLOP/s do not keep a copy of the architecture's formulas: they
build the pieces of `GPTModel` on torch.device("meta") (shapes, no storage) and count them.

- A decoder layer's parameters on one rank: one layer of each kind (`TransformerLayer.kind`: dense,
  or a mixture of experts) built at that tensor-, expert- and expert-tensor-parallel size; a
  stage's layers are that many of each kind. The routed experts (parameters that carry
  `expert_offset`) are counted apart, since the expert-data-parallel group replicates them.
- A stage's ends: the model built with no decoder layers for a first and/or last stage (the word
  and position embeddings, the final norm, the output layer or the last stage's copy of a tied
  embedding, and the multi-token prediction modules).
- FLOPs: each layer kind built whole (TP 1) says its forward FLOPs per token
  (transformer.flops: 2 x in x out per matrix, the attention's products, a token's top-k experts);
  the logits add 2 h V per token, once for the model and once per prediction depth.

Each distinct (model, layer kind, TP, EP, ETP) is built once per process (a few milliseconds), so
a layout search that tries thousands of layouts builds a handful of modules.
"""
import dataclasses
from dataclasses import dataclass

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.flops import flops_per_token
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

META = torch.device("meta")


@dataclass(frozen=True)
class Counts:
    """Elements of a built piece on one rank."""
    dense: int            # every parameter but the routed experts'
    experts: int = 0      # the routed experts' (weights and biases)
    expert_weights: int = 0  # the routed experts' GEMM weights only

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(self.dense + other.dense, self.experts + other.experts,
                      self.expert_weights + other.expert_weights)

    def __mul__(self, times: int) -> "Counts":
        return Counts(self.dense * times, self.experts * times, self.expert_weights * times)


_BUILT: dict = {}


def _cached(key: tuple, make):
    if key not in _BUILT:
        _BUILT[key] = make()
    return _BUILT[key]


def model_key(model_config) -> str:
    """What identifies a model description in the caches (every field, derived ones included)."""
    return repr(model_config)


def _groups(tp: int, ep: int, etp: int) -> ParallelGroups:
    """Sizes only: nothing is communicated while a module is built."""
    return ParallelGroups(tp_size=tp, ep_size=ep, etp_size=etp)


def _count(module: torch.nn.Module) -> Counts:
    dense = experts = weights = 0
    for param in module.parameters():
        if hasattr(param, "expert_offset"):
            experts += param.numel()
            weights += param.numel() if param.dim() == 3 else 0  # [local experts, out, in]; biases are 2-D
        else:
            dense += param.numel()
    return Counts(dense, experts, weights)


def _representative(model_config, kind: str) -> int:
    """The number of the first decoder layer of this kind."""
    return next(n for n in range(model_config.num_layers) if TransformerLayer.kind(model_config, n) == kind)


def _layer(model_config, kind: str, tp: int, ep: int, etp: int) -> TransformerLayer:
    if kind == "dense" and "dense" not in layer_kinds(model_config, 0, model_config.num_layers):
        # asked of a model whose every layer has experts: its dense layer, as the model without experts builds it
        model_config = dataclasses.replace(model_config, num_experts=None)
    return TransformerLayer(model_config, groups=_groups(tp, ep, etp), rng_tracker=None, device=META,
                            layer_number=_representative(model_config, kind))


def layer_counts(model_config, key: str, kind: str, tp: int, ep: int = 1, etp: int = 1) -> Counts:
    """One decoder layer of this kind on one rank."""
    return _cached(("layer", key, kind, tp, ep, etp), lambda: _count(_layer(model_config, kind, tp, ep, etp)))


def layer_matrices(model_config, key: str, kind: str, tp: int) -> tuple:
    """Elements of each matrix of one decoder layer of this kind on one tensor-parallel rank, in
    the order they run (a mixture-of-experts block left out: its router and experts are timed by
    their rows, planning/moe.py)."""
    def matrices() -> tuple:
        layer = _layer(model_config, kind, tp, 1, 1)
        skipped = {id(p) for p in layer.mlp.parameters()} if layer.is_moe else set()
        return tuple(p.numel() for p in layer.parameters() if p.dim() == 2 and id(p) not in skipped)

    return _cached(("matrices", key, kind, tp), matrices)


def fp8_weight_shapes(model_config, key: str, kind: str, tp: int, ep: int = 1, etp: int = 1) -> tuple:
    """(name, shape on one rank) of each weight a decoder layer of this kind multiplies in FP8 under
    --fp8-format (`fp8.attach_fp8`'s): its column- and row-parallel linears' [out, in] and its routed
    experts' stacked weights [local experts, out, in]."""
    def shapes() -> tuple:
        found = []
        for name, module in _layer(model_config, kind, tp, ep, etp).named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                found.append((f"{name}.weight", tuple(module.weight.shape)))
            elif hasattr(module, "attach_fp8"):
                found += [(f"{name}.{weight}", tuple(param.shape))
                          for weight, param in module.named_parameters(recurse=False) if param.dim() == 3]
        return tuple(found)

    return _cached(("fp8 weights", key, kind, tp, ep, etp), shapes)


def layer_kinds(model_config, first_layer: int, num_layers: int) -> dict:
    """{kind: how many} of decoder layers first_layer .. first_layer + num_layers - 1."""
    kinds = {}
    for number in range(first_layer, first_layer + num_layers):
        kind = TransformerLayer.kind(model_config, number)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _prediction_layer(model_config) -> MultiTokenPredictionLayer:
    return MultiTokenPredictionLayer(model_config, DEFAULT_EXECUTION, groups=_groups(1, 1, 1), rng_tracker=None,
                                     device=META, layer_number=model_config.num_layers)


def _ends(model_config, tp: int, ep: int, etp: int, first: bool, last: bool) -> GPTModel:
    return GPTModel(model_config, _groups(tp, ep, etp), pre_process=first, post_process=last, layer_numbers=[],
                    device=META)


def ends_counts(model_config, key: str, tp: int, ep: int = 1, etp: int = 1, *, first: bool, last: bool) -> Counts:
    """A stage's parameters outside its decoder layers on one rank (the embeddings on the first, the
    final norm, the output layer and the prediction modules on the last)."""
    if not (first or last):
        return Counts(0)
    return _cached(("ends", key, tp, ep, etp, first, last),
                   lambda: _count(_ends(model_config, tp, ep, etp, first, last)))


def stage_counts(model_config, key: str, tp: int, ep: int, etp: int, num_layers: int, first_layer: int, *,
                 first: bool, last: bool) -> Counts:
    """One pipeline stage's parameters on one rank: its decoder layers and its ends."""
    def count() -> Counts:
        total = ends_counts(model_config, key, tp, ep, etp, first=first, last=last)
        for kind, n in layer_kinds(model_config, first_layer, num_layers).items():
            total = total + layer_counts(model_config, key, kind, tp, ep, etp) * n
        return total

    return _cached(("stage", key, tp, ep, etp, num_layers, first_layer, first, last), count)


def forward_flops_per_token(model_config, key: str, seq_length: int) -> int:
    """The whole model's forward FLOPs per token: every decoder layer by its kind, the prediction
    modules (each a layer of the last decoder layer's kind, its eh_proj) and the logits of the model
    and of each prediction depth."""
    def count() -> int:
        kinds = layer_kinds(model_config, 0, model_config.num_layers)
        total = sum(flops_per_token(_layer(model_config, kind, 1, 1, 1), seq_length) * n for kind, n in kinds.items())
        depths = model_config.mtp_num_layers or 0
        if depths:  # every depth is built alike (a layer of the last decoder layer's kind)
            total += depths * flops_per_token(_prediction_layer(model_config), seq_length)
        return total + (1 + depths) * 2 * model_config.hidden_size * model_config.padded_vocab_size

    return _cached(("flops", key, seq_length), count)


def flops_per_iteration(model_config, global_batch_size: int, seq_length: int, key: str = None) -> float:
    """Model FLOPs of one iteration: forward and backward (3x the forward: the input and the weight
    gradients), recomputation not counted. The one definition: the log line's TFLOP/s/GPU and the
    plan's MFU both count this (docs/performance.md)."""
    key = model_key(model_config) if key is None else key
    return float(3 * global_batch_size * seq_length * forward_flops_per_token(model_config, key, seq_length))
