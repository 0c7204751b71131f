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
The functions at the end give the same figures from the flags alone, before anything is built
(--dry-run, and the check that the model fits before it is allocated).
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


# ---------------------------------------------------------------------------------------------
# Before anything is built: the same figures from the flags alone (--dry-run, and the check that
# the model fits before it is allocated).

def layer_parameters(model_config, tp_size: int) -> int:
    """Elements of one decoder layer's parameters on one tensor-parallel rank."""
    c, t = model_config, tp_size
    h, d, f = c.hidden_size, c.kv_channels, c.ffn_hidden_size
    norm = 2 if c.normalization == "LayerNorm" else 1  # weight (+ bias)
    q_local = c.num_attention_heads * d // t
    kv_local = d * c.num_query_groups // min(t, c.num_query_groups)
    qkv = h * (q_local + 2 * kv_local) + ((q_local + 2 * kv_local) if c.add_bias_linear or c.add_qkv_bias else 0)
    proj = q_local * h + (h if c.add_bias_linear else 0)
    fc1_out = (2 if c.swiglu else 1) * f // t  # gate and up projections with SwiGLU
    mlp = h * fc1_out + f // t * h + ((fc1_out + h) if c.add_bias_linear else 0)
    qk_norms = 2 * norm * d if c.qk_layernorm else 0
    return 2 * norm * h + qkv + proj + qk_norms + mlp


def stage_parameters(model_config, tp_size: int, num_layers: int, *, first: bool, last: bool, pp_size: int) -> int:
    """Elements of one pipeline stage's parameters on one tensor-parallel rank."""
    c = model_config
    total = num_layers * layer_parameters(c, tp_size)
    vocabulary = c.padded_vocab_size // tp_size * c.hidden_size
    if first:
        total += vocabulary
        if c.position_embedding_type == "learned_absolute":
            total += c.max_position_embeddings * c.hidden_size
    if last:
        total += c.hidden_size * (2 if c.normalization == "LayerNorm" else 1)
        if c.untie_embeddings_and_output_weights or pp_size > 1:
            total += vocabulary  # the output layer (or the last stage's copy of the tied embedding)
    return total


def estimate_bytes(config, model_config, layers_per_stage: list, tp_size: int, dp_cp_size: int) -> list:
    """Theoretical bytes per pipeline stage on one GPU: {"parameters", "gradients", "optimizer_state"}
    as `theoretical_bytes` counts them (without bucket padding)."""
    p, t, o = config.parallel, config.training, config.optimizer
    compute = 2 if (t.bf16 or t.fp16) else 4
    moments = {"adam": 2, "sgd": 1 if o.sgd_momentum else 0}[o.optimizer]
    figures = []
    for rank, layers in enumerate(layers_per_stage):
        n = stage_parameters(model_config, tp_size, layers, first=rank == 0, last=rank == len(layers_per_stage) - 1,
                             pp_size=len(layers_per_stage))
        if p.use_torch_fsdp2:
            shard = n / dp_cp_size
            figures.append({"parameters": 4 * shard, "gradients": 4 * shard, "optimizer_state": 4 * moments * shard})
            continue
        masters = 4 if compute != 4 else 0
        state = (masters + 4 * moments) * n
        figures.append({"parameters": compute * n, "gradients": (2 if p.grad_reduce_in_bf16 else 4) * n,
                        "optimizer_state": state / dp_cp_size if p.use_distributed_optimizer else state})
    return figures


def estimate_report(config, model_config, layers_per_stage: list, tp_size: int, dp_size: int, cp_size: int) -> tuple:
    """(largest total bytes on one GPU, the report line) for the layout."""
    figures = estimate_bytes(config, model_config, layers_per_stage, tp_size, dp_size * cp_size)
    totals = [sum(f.values()) for f in figures]
    worst = figures[totals.index(max(totals))]
    stage = f" (pipeline stage {totals.index(max(totals))} of {len(figures)}, the largest)" if len(figures) > 1 else ""
    text = (f"memory estimate per GPU{stage}: parameters {_gib(worst['parameters'])} | gradients "
            f"{_gib(worst['gradients'])} | optimizer state {_gib(worst['optimizer_state'])} | total {_gib(max(totals))} "
            "(activations not included)")
    return max(totals), text


def reducing_flags(config) -> list:
    """The flags that would shrink the estimate, given the ones already set."""
    p, t = config.parallel, config.training
    hints = ["--tensor-model-parallel-size or --pipeline-model-parallel-size (split the model over more GPUs)"]
    if not (p.use_distributed_optimizer or p.use_torch_fsdp2):
        hints.append("--use-distributed-optimizer or --use-torch-fsdp2 (shard the optimizer state over the "
                     "data-parallel ranks)")
    if not (t.bf16 or t.fp16):
        hints.append("--bf16 (halves the parameters)")
    return hints + ["a smaller model"]


def check_fits(estimate: float, available: float, where: str, hints: list, processes: int = 1) -> None:
    """Raises ValueError with the estimate and the flags that reduce it (`hints`) when `processes`
    processes of `estimate` bytes each do not fit in `available` bytes of `where`."""
    if estimate * processes <= available:
        return
    share = f"{processes} processes x {_gib(estimate)}" if processes > 1 else _gib(estimate)
    raise ValueError(f"the model does not fit: {share} of parameters, gradients and optimizer state (before "
                     f"activations), but {where} has {_gib(available)} free; reduce it with " + ", ".join(hints))
