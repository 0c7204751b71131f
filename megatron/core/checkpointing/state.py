"""What a rank contributes to a checkpoint: model weights, optimizer state and RNG streams, all as
boxes of logical tensors keyed by global parameter name (layout-independent), plus per-rank RNG.

Keys (see `sharded.tensor_key`):
- `model/<name>[/<part>]`: the model's weights in their training dtype;
- `optimizer/master/<name>[/<part>]`: fp32 master weights, only when they are copies apart from the
  model's weights (bf16/fp16 training); otherwise the model's weights are the masters;
- `optimizer/<moment>/<name>[/<part>]`: the optimizer's per-element state (Adam: exp_avg,
  exp_avg_sq; SGD: momentum_buffer);
- `rng/<global rank>/<stream>`: this rank's generator states, and `fp8/<global rank>/...` its FP8
  delayed-scaling amax history (both only meaningful at the same layout).

Which elements a rank holds comes from the optimizer's `state_regions()` (full tensor-parallel
slices, distributed-optimizer shards or FSDP2 row shards) and from the model chunks.
"""
import random

import numpy as np
import torch

from megatron.core import utils
from megatron.core.checkpointing.sharded import ShardedState

MODEL = "model"
MASTER = "optimizer/master"


def moment_prefix(moment: str) -> str:
    return f"optimizer/{moment}"


def unwrap(chunk) -> torch.nn.Module:
    """The GPTModel inside a data-parallel wrapper (or the model itself)."""
    return getattr(chunk, "module", chunk)


def global_names(chunks: list) -> dict:
    """{parameter: layout-independent global name} over this rank's model chunks."""
    names = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            names[param] = model.global_param_name(name)
    return names


def model_regions(chunks: list, groups) -> list:
    """(param, flat start, flat end, flat local data) for every parameter this rank holds: the
    whole tensor-parallel slice, or the FSDP2 row shard of it."""
    from megatron.core.distributed.fsdp import shard_row_start

    regions = []
    for chunk in chunks:
        for _, param in unwrap(chunk).named_parameters():
            if hasattr(param, "to_local"):  # FSDP2: a DTensor sharded by rows over data ranks
                local = param.to_local().detach()
                if local.numel() == 0:
                    continue
                start = shard_row_start(param, groups) * (param.numel() // param.shape[0])
                regions.append((param, start, start + local.numel(), local.reshape(-1)))
            else:
                regions.append((param, 0, param.numel(), param.detach().view(-1)))
    return regions


def add_model(state: ShardedState, chunks: list, groups) -> None:
    names = global_names(chunks)
    for param, start, end, flat in model_regions(chunks, groups):
        state.add_range(MODEL, names[param], param, start, end, flat)


def router_biases(chunks: list) -> dict:
    """{checkpoint key: buffer} of the MoE routers' expert biases (aux-loss-free balancing): state
    that trains without gradients, the same on every rank of a pipeline stage."""
    biases = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for name, buffer in model.named_buffers():
            if name.endswith(".router.expert_bias"):
                biases[f"{MODEL}/{model.global_param_name(name)}"] = buffer
    return biases


def add_optimizer(state: ShardedState, optimizer, chunks: list, *, masters: bool, moments: bool) -> None:
    """The optimizer's fp32 masters (when `masters`) and moments (when `moments`) over this rank's
    regions. Moments exist only once the optimizer has stepped."""
    names = global_names(chunks)
    keys = optimizer.moment_keys() if moments else ()
    for param, start, end, master in optimizer.state_regions():
        name = names[param]
        if masters:
            state.add_range(MASTER, name, param, start, end, master.detach().view(-1))
        for key in keys:
            state.add_range(moment_prefix(key), name, param, start, end, optimizer.optimizer.state[master][key].view(-1))


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------
def rng_tensors(tracker, device: torch.device) -> dict:
    """This rank's generator states as tensors: Python, numpy, torch CPU, the device, and every
    stream of the tensor-parallel tracker."""
    version, words, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    out = {
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(np.concatenate([keys.astype(np.int64), [position, has_gauss]])),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    if device.type != "cpu":
        out["device"] = utils.rng_state(device)
    if tracker is not None:
        for name, value in tracker.get_states().items():
            out[f"tracker/{name}"] = value
    return out


def restore_rng(tensors: dict, tracker, device: torch.device) -> None:
    python = tensors["python"].tolist()
    has_gauss, gauss = tensors["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    numpy = tensors["numpy"].numpy()
    np.random.set_state(("MT19937", numpy[:-2].astype(np.uint32), int(numpy[-2]), int(numpy[-1]),
                         float(tensors["numpy_gauss"][0])))
    torch.set_rng_state(tensors["torch_cpu"])
    if "device" in tensors and device.type != "cpu":
        utils.set_rng_state(device, tensors["device"])
    if tracker is not None:
        states = {key.split("/", 1)[1]: value for key, value in tensors.items() if key.startswith("tracker/")}
        if states:
            tracker.set_states(states)


# ---------------------------------------------------------------------------------------------
# FP8 delayed scaling (per rank: each rank's amax history covers its own shards)
# ---------------------------------------------------------------------------------------------
def fp8_tensors(chunks: list) -> dict:
    """{"<chunk>/<name>": tensor} of every chunk with FP8 delayed scaling (its amax history)."""
    out = {}
    for index, chunk in enumerate(chunks):
        scaling = getattr(unwrap(chunk), "fp8_scaling", None)
        if scaling is not None and scaling.history is not None:
            out.update({f"{index}/{name}": tensor for name, tensor in scaling.state_tensors().items()})
    return out


def restore_fp8(chunks: list, tensors: dict) -> None:
    for index, chunk in enumerate(chunks):
        scaling = getattr(unwrap(chunk), "fp8_scaling", None)
        prefix = f"{index}/"
        mine = {key[len(prefix):]: tensor for key, tensor in tensors.items() if key.startswith(prefix)}
        if scaling is not None and mine:
            scaling.load_state_tensors(mine)


def add_per_rank(state: ShardedState, kind: str, global_rank: int, tensors: dict) -> None:
    """Tensors only this rank holds (and only the same layout can use): `<kind>/<rank>/<name>`."""
    for name, tensor in tensors.items():
        state.add_whole(f"{kind}/{global_rank}/{name}", tensor)
