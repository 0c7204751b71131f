"""Memory per rank: the theoretical bytes of parameters, gradients and optimizer state for the
chosen layout (printed at start-up), and the measured peak of an iteration (for the log line).

Theoretical figures count the persistent tensors only (no activations, no temporary buffers):
- parameters: this rank's parameters in their dtype (FSDP2: the fp32 shard, plus one layer gathered
  in the compute dtype while it runs, which is reported separately);
- gradients: the DDP gradient buffers (fp32, or bf16 with --grad-reduce-in-bf16, including bucket
  padding), or FSDP2's fp32 gradient shards;
- optimizer state: fp32 master copies that are not the model's own parameters, plus the moments
  (Adam: 2, SGD with momentum: 1) for every element the optimizer steps; 1/DP of it with the
  distributed optimizer or FSDP2.

With context parallelism (CP ranks hold the same parameters and average their gradients, like data
ranks) the distributed optimizer and FSDP2 shard over DP x CP ranks, so those shares are 1/(DP x CP);
the figures are read from this rank's tensors, so they show it. Activations, not counted here, are
about 1/CP of the CP=1 figure per rank (docs/parallelism.md).

`LiveTensorBytes` measures what a piece of code really holds (tests and benchmarks use it on CPU).
The same figures from the flags alone, before anything is built, and the activations, come from the
planner (`megatron/training/planning`: --dry-run, tools/plan.py, and the check that the model fits
before it is allocated).
"""
import weakref
from typing import Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_MOMENTS = {"adam": 2, "sgd": 1}
_GIB = 1024 ** 3


def _gib(value: int) -> str:
    return f"{value / _GIB:.3f} GiB"


def _is_fsdp(chunk) -> bool:
    return hasattr(chunk, "params") and any(hasattr(p, "to_local") for p in chunk.params)


def theoretical_bytes(chunks: list, optimizer) -> dict:
    """{"parameters", "gradients", "optimizer_state", "fsdp_gathered_layer"} in bytes on this rank."""
    params = grads = gathered = 0
    for chunk in chunks:
        if _is_fsdp(chunk):
            local = [p.to_local() for p in chunk.params]
            params += sum(t.numel() * t.element_size() for t in local)
            grads += sum(t.numel() * 4 for t in local)
            layers = getattr(chunk.module.decoder, "layers", [])
            if len(layers):
                compute_bytes = torch.finfo(chunk.compute_dtype).bits // 8
                gathered = max(gathered, max(sum(p.numel() for p in layer.parameters()) for layer in layers)
                               * compute_bytes)
        else:
            params += sum(p.numel() * p.element_size() for p in chunk.module.parameters())
            grads += sum(b.grad_data.numel() * b.grad_data.element_size() for b in getattr(chunk, "buffers", []))
    moments = _MOMENTS.get(optimizer.config.optimizer, 2)
    if optimizer.config.optimizer == "sgd" and optimizer.config.sgd_momentum == 0.0:
        moments = 0
    stepped, master_copies = optimizer.stepped_elements()
    state = 4 * (stepped * moments + master_copies)
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "fsdp_gathered_layer": gathered}


def layout_name(config) -> str:
    p = config.parallel
    if p.use_torch_fsdp2:
        return "FSDP2"
    return "distributed optimizer (ZeRO-1)" if p.use_distributed_optimizer else "DDP (replicated optimizer)"


def memory_report(config, chunks: list, optimizer, groups, figures: Optional[dict] = None) -> str:
    """One start-up line: theoretical parameter, gradient and optimizer-state bytes on this rank
    (or the given `figures`)."""
    figures = figures or theoretical_bytes(chunks, optimizer)
    total = figures["parameters"] + figures["gradients"] + figures["optimizer_state"]
    text = (f"theoretical memory per rank ({layout_name(config)}, DP={groups.dp_size}, CP={groups.cp_size}, "
            f"TP={groups.tp_size}, PP={groups.pp_size}): parameters {_gib(figures['parameters'])} | gradients "
            f"{_gib(figures['gradients'])} | optimizer state {_gib(figures['optimizer_state'])} | "
            f"total {_gib(total)} (activations not included)")
    if figures["fsdp_gathered_layer"]:
        text += f" | + one gathered layer {_gib(figures['fsdp_gathered_layer'])} while it runs"
    return text



class LiveTensorBytes(TorchDispatchMode):
    """While active, counts the bytes of the tensor storages created since it began that are still
    alive, and the peak of that count: the memory a piece of code holds, on any device (the CPU's
    allocator keeps no statistics). Views, in-place results and meta tensors add nothing; a DTensor
    counts as its local shard.

        with LiveTensorBytes() as counter:
            ...
        counter.peak, counter.live
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        existing = {id(storage) for storage in _storages(pytree.tree_leaves((args, kwargs)))}
        for storage in _storages(pytree.tree_leaves(out)):
            if id(storage) not in existing and id(storage) not in self._tracked:
                self._track(storage)
        return out

    def _track(self, storage) -> None:
        size = storage.nbytes()
        key = id(storage)
        self._tracked.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._tracked.discard(key)
        self.live -= size


def _storages(leaves: list) -> list:
    found = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        local = getattr(leaf, "_local_tensor", leaf)  # a DTensor's shard
        if not local.is_meta:
            found.append(local.untyped_storage())
    return found
