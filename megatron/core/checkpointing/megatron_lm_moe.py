"""Megatron-Core's mixture-of-experts tensors, for megatron_lm.py's reader.

Megatron-Core writes a routed expert in one of these forms (layer i, local expert j of the file's
expert-parallel rank r, E_local experts per rank, global index g = r x E_local + j):
- SequentialMLP (the local spec): `decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight`
  [2F/tp (gate; up with SwiGLU), h] and `...linear_fc2.weight` [h, F/tp], each split over the
  expert-tensor-parallel ranks like a dense MLP.
- TEGroupedMLP (Transformer Engine's grouped GEMM, --moe-grouped-gemm): `...mlp.experts.linear_fc1.
  weight{j}` and `linear_fc2.weight{j}`, the same shapes.
- The legacy GroupedMLP (--moe-use-legacy-grouped-gemm): `...mlp.experts.weight1` [h, E_local x
  2F/tp], read as Megatron-Core's forward reads it, `view(E_local, h, 2F/tp)` (expert j's fc1 is
  `[j].t()`), and `weight2` [E_local x F/tp, h], `view(E_local, F/tp, h)`.
- torch_dist (every form): `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, h]
  under global expert indices (`decoder.layers.i.` with layers of more than one kind, e.g. a
  --moe-layer-freq pattern), fc1's gate and up halves each whole.
Legacy files of an expert-parallel run are `mp_rank_TT[_PPP]_EEE/` (EEE: the expert-parallel rank);
`global_experts` names each local expert by its global index before the tensor-parallel shards
are merged, so both formats reach one form: `decoder.layers.i.mlp.experts.g.linear_fcN.weight`,
full tensors. `moe_logical` stacks them into GroupedMLP's `experts.fc1_weight` (parts gate, up)
[E, F, h] and `experts.fc2_weight` [E, h, F].

The router (`mlp.router.weight` [E, h]; `mlp.router.expert_bias` [E], a buffer, with
--moe-router-enable-expert-bias) and the shared experts (`mlp.shared_experts.linear_fc1/2`, a
dense MLP, and `gate_weight` [1, h] with --moe-shared-expert-gate) keep their names; the shared
experts' MLP is `mlp.shared_experts.mlp.` here.
"""
import re

import torch

# A transformer layer's prefix: a decoder layer, or the layer of a multi-token prediction depth (built
# as the last decoder layer, so a mixture of experts when that is one).
LAYER_PREFIX = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"

# Legacy TP split of the mixture-of-experts tensors (dim the shards are concatenated along; None:
# whole on every rank), keyed by the name after `decoder.layers.i.` with the expert index as '*'.
LAYER_SPLIT = {
    "mlp.router.weight": None, "mlp.router.expert_bias": None,
    "mlp.shared_experts.linear_fc1.weight": 0, "mlp.shared_experts.linear_fc2.weight": 1,
    "mlp.shared_experts.gate_weight": None,
    "mlp.experts.*.linear_fc1.weight": 0, "mlp.experts.*.linear_fc2.weight": 1,
}
# Every linear_fc1 of a layer (dense MLP, shared experts, one expert): [gate; up] with SwiGLU.
GATED_FC1 = re.compile(LAYER_PREFIX + r"\.mlp\.(?:shared_experts\.|experts\.\d+\.)?linear_fc1\.(weight|bias)")

_SEQUENTIAL = re.compile(r"(" + LAYER_PREFIX + r"\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)")
_TE_GROUPED = re.compile(r"(" + LAYER_PREFIX + r"\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)")
_LEGACY_GROUPED = re.compile(r"(" + LAYER_PREFIX + r"\.mlp\.experts)\.weight([12])")
_TORCH_DIST = re.compile(r"(" + LAYER_PREFIX + r"\.mlp\.experts)\.experts\.(linear_fc[12]\.weight)")
_EXPERT = re.compile(r"(" + LAYER_PREFIX + r"\.mlp\.experts)\.(\d+)\.(linear_fc[12])\.weight")


def split_key(layer_suffix: str) -> str:
    """LAYER_SPLIT's key of a name after `decoder.layers.i.`."""
    return re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.*.", layer_suffix)


def global_experts(chunk: dict, ep_rank: int, num_local: int, hidden_size: int) -> dict:
    """One legacy file's model chunk with its experts under global indices (one tensor per expert,
    still this file's TP shard); other tensors unchanged, `_extra_state` entries dropped."""
    out, offset = {}, ep_rank * num_local
    for name, tensor in chunk.items():
        if name.endswith("_extra_state"):
            continue
        sequential, te, legacy = (pattern.fullmatch(name) for pattern in (_SEQUENTIAL, _TE_GROUPED, _LEGACY_GROUPED))
        if sequential:
            prefix, index, linear, kind = sequential.groups()
            out[f"{prefix}.{offset + int(index)}.{linear}.{kind}"] = tensor
        elif te:
            prefix, linear, kind, index = te.groups()
            out[f"{prefix}.{offset + int(index)}.{linear}.{kind}"] = tensor
        elif legacy:
            prefix, which = legacy.groups()
            # Megatron-Core's GroupedMLP.forward: weight1.view(E_local, h, -1), weight2.view(E_local, -1, h),
            # each expert then multiplied as x @ w.
            shape = (num_local, hidden_size, -1) if which == "1" else (num_local, -1, hidden_size)
            per_expert = tensor.reshape(shape).transpose(1, 2)
            for index in range(num_local):
                out[f"{prefix}.{offset + index}.linear_fc{which}.weight"] = per_expert[index]
        else:
            out[name] = tensor
    return out


def split_torch_dist_experts(tensors: dict) -> dict:
    """torch_dist's `mlp.experts.experts.linear_fcN.weight` [E, ...] -> one tensor per global expert."""
    out = {}
    for name, tensor in tensors.items():
        match = _TORCH_DIST.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, rest = match.groups()
        for index in range(tensor.shape[0]):
            out[f"{prefix}.{index}.{rest}"] = tensor[index]
    return out


def moe_logical(tensors: dict, config, source: str) -> dict:
    """The logical entries of the routed experts (stacked in global expert order), removed from
    `tensors`; shared experts renamed in place to this framework's names."""
    experts = {}
    for name in list(tensors):
        match = _EXPERT.fullmatch(name)
        if match:
            prefix, index, linear = match.groups()
            experts.setdefault((prefix, linear), {})[int(index)] = tensors.pop(name)
        elif ".mlp.shared_experts.linear_fc" in name:
            tensors[name.replace(".mlp.shared_experts.", ".mlp.shared_experts.mlp.")] = tensors.pop(name)
    logical = {}
    for (prefix, linear), by_index in sorted(experts.items()):
        if sorted(by_index) != list(range(config.num_experts)):
            raise ValueError(f"{source}: {prefix}.{linear} holds experts {sorted(by_index)}; the arguments "
                             f"(num_experts={config.num_experts}) give 0..{config.num_experts - 1}")
        stacked = torch.stack([by_index[index] for index in range(config.num_experts)])
        if linear == "linear_fc2":
            parts = {"": stacked}
        elif config.swiglu:
            gate, up = stacked.chunk(2, dim=1)
            parts = {"gate": gate, "up": up}
        else:
            parts = {"": stacked}
        name = f"{prefix}.{'fc1_weight' if linear == 'linear_fc1' else 'fc2_weight'}"
        logical[name] = {part: piece.to(torch.float32, copy=True).contiguous() for part, piece in parts.items()}
    return logical


def check_supported(args: dict, source: str) -> None:
    """Raises ValueError for a mixture-of-experts option GPTModel does not implement."""
    if not args.get("num_experts"):
        return
    if args.get("add_bias_linear", True):
        raise ValueError(f"{source}: --num-experts with linear biases (no --disable-bias-linear: a router bias) "
                         "cannot be imported: GPTModel's router has no bias")
    etp = args.get("expert_tensor_parallel_size")
    tp = args.get("tensor_model_parallel_size") or 1
    if args.get("ckpt_format") == "torch" and etp is not None and tp > 1 and etp != tp:
        raise ValueError(f"{source}: a legacy (--ckpt-format torch) checkpoint with --expert-tensor-parallel-size "
                         f"{etp} != --tensor-model-parallel-size {tp} cannot be imported; save it with "
                         "--ckpt-format torch_dist")
