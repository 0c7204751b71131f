"""The distributed optimizer (ZeRO-1): master weights and optimizer state sharded over data ranks.

Each bucket of the data-parallel gradient buffer (see `distributed.param_and_grad_buffer`) is cut
into equal contiguous shards, one per data-parallel (x context-parallel) rank. A rank owns the
parameter elements that fall in its shards: `ShardPiece`s, each a flat range of one parameter.
For every piece it keeps an fp32 master (a view of the parameter buffer when the model is fp32)
and the inner optimizer's state, so per-rank optimizer memory is 1/DP of the unsharded case.

A step: the gradients were reduce-scattered into this rank's shards -> unscale (fp16) and detect
inf/NaN, agreed over the model-parallel and data-parallel groups -> global norm from the shards
(each element counted once: shards are disjoint over DP, replicated TP slices weighted by
1/replicas) -> clip -> inner step on the pieces -> copy masters into the parameter buffer shard ->
all-gather the parameter buffer (left in flight with --overlap-param-gather).

`full_state()` / `load_full_state()` convert the sharded state to and from a form keyed by global
parameter name with full (TP-gathered, DP-gathered) tensors, independent of the layout.
"""
import math
from dataclasses import dataclass

import torch

from megatron.core.distributed import comm
from megatron.core.distributed.ddp import chain_param_gathers
from megatron.core.optimizer.clip_grads import square_norm, weighted_grads
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    OptimizerConfig,
    _optimizer_state_bytes,
    build_grad_scaler,
    build_inner_optimizer,
    param_groups,
)
from megatron.core.parallel_state import ParallelGroups

_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass
class ShardPiece:
    """Elements [start, end) of `param` (flattened) that this rank owns, in bucket `bucket`."""

    param: torch.nn.Parameter
    start: int
    end: int
    buffer: object
    bucket: object
    grad: torch.Tensor          # view of the gradient buffer, 1-D
    model_shard: torch.Tensor   # view of the parameter buffer, 1-D, model dtype
    master: torch.Tensor        # fp32, 1-D (the model shard itself when the model is fp32)


def shard_pieces(buffer) -> list:
    """This rank's pieces of every bucket of `buffer`."""
    pieces = []
    for bucket in buffer.buckets:
        shard_start, shard_end = bucket.shard_range(buffer.dp_rank, buffer.dp_size)
        for param in bucket.params:
            start, end = bucket.param_ranges[param]
            lo, hi = max(start, shard_start), min(end, shard_end)
            if lo >= hi:
                continue
            model_shard = buffer.param_data[lo:hi]
            master = model_shard if model_shard.dtype == torch.float32 else model_shard.detach().float()
            pieces.append(ShardPiece(param, lo - start, hi - start, buffer, bucket,
                                     buffer.grad_data[lo:hi], model_shard, master))
    return pieces


class ShardedOptimizer(MixedPrecisionOptimizer):
    """Shared step logic for optimizers whose state covers a shard of every parameter: the subclass
    provides `self.pieces` (with `.param`, `.start`, `.master`, `.grad`) and the groups to agree over."""

    def _build(self, config: OptimizerConfig, groups: ParallelGroups, pieces: list, model_params: list) -> None:
        self.config = config
        self.groups = groups
        self.pieces = pieces
        self.model_params = model_params
        self.master_params = [piece.master for piece in pieces]
        pairs = [(p.param, p.master) for p in pieces]
        self.optimizer = build_inner_optimizer(config, param_groups(config, pairs, keep_empty=True))
        self.grad_scaler = build_grad_scaler(config)
        self.num_applied_steps = 0

    def state_regions(self) -> list:
        return [(p.param, p.start, p.start + p.master.numel(), p.master) for p in self.pieces]

    def separate_masters(self) -> bool:
        return bool(self._master_copies())

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for piece in self.pieces:
            model_shard = getattr(piece, "model_shard", None)
            if model_shard is not None and piece.master.data_ptr() != model_shard.data_ptr():
                piece.master.copy_(model_shard)

    def grads(self) -> list:
        return [piece.grad for piece in self.pieces]

    # The norm sums over every rank (mp x dp_cp), each shard once: routed experts, sharded over their
    # expert-data-parallel ranks, need no separate sum.
    split_expert_norm = False

    def found_inf_groups(self) -> list:
        return [self.groups.mp, self.groups.dp_cp]

    def norm_groups(self) -> list:
        return [self.groups.mp, self.groups.dp_cp]

    def _local_grad_square(self, grads: list) -> torch.Tensor:
        entries = weighted_grads([p.param for p in self.pieces], grads, [p.start for p in self.pieces])
        return square_norm(entries, self.groups.device)

    def _master_copies(self) -> list:
        return [p.master for p in self.pieces if p.master.data_ptr() != p.model_shard.data_ptr()]

    def stepped_elements(self) -> tuple[int, int]:
        return sum(p.master.numel() for p in self.pieces), sum(m.numel() for m in self._master_copies())

    def optimizer_state_bytes(self) -> int:
        return _optimizer_state_bytes(self.optimizer, self._master_copies())


class DistributedOptimizer(ShardedOptimizer):
    def __init__(self, config: OptimizerConfig, model_chunks: list, groups: ParallelGroups):
        self.model_chunks = model_chunks
        self.overlap_param_gather = any(c.ddp_config.overlap_param_gather for c in model_chunks)
        self.overlap_with_step = any(c.ddp_config.overlap_param_gather_with_optimizer_step for c in model_chunks)
        self.gather_chain = chain_param_gathers(model_chunks)
        pieces = [piece for chunk in model_chunks for buffer in chunk.buffers for piece in shard_pieces(buffer)]
        model_params = [p for chunk in model_chunks for p in chunk.params]
        self._build(config, groups, pieces, model_params)

    def _apply_update(self, grads: list) -> None:
        """With --overlap-param-gather-with-optimizer-step (as Megatron's chained optimizer): the
        first model chunk's shards are stepped and their gathers dispatched first, so they run
        while the other chunks' shards are stepped. One inner optimizer does both passes: a pass
        steps only the masters that have a gradient."""
        if not self.overlap_with_step:
            super()._apply_update(grads)
            return
        first = self.model_chunks[0]
        for in_first_chunk in (True, False):
            for piece, grad in zip(self.pieces, grads):
                if (piece.buffer in first.buffers) == in_first_chunk:
                    piece.master.grad = grad if grad.dtype == piece.master.dtype else grad.to(piece.master.dtype)
            self.optimizer.step()
            for piece in self.pieces:
                piece.master.grad = None
            self._copy_masters_to_model(first_chunk_only=in_first_chunk)
            if in_first_chunk:
                first.dispatch_param_gathers()

    def _copy_masters_to_model(self, first_chunk_only: bool = None) -> None:
        """Masters into the parameter buffer shards (all, or with `first_chunk_only` True/False the
        first chunk's or the others'), then those chunks' gathers: left owed to the forward hooks
        with --overlap-param-gather, else run now."""
        chunks = self.model_chunks if first_chunk_only is None else (
            self.model_chunks[:1] if first_chunk_only else self.model_chunks[1:])
        buffers = {id(buffer) for chunk in chunks for buffer in chunk.buffers}
        pairs = [(p.model_shard, p.master) for p in self.pieces
                 if p.master is not p.model_shard and id(p.buffer) in buffers]
        if pairs:
            torch._foreach_copy_([m for m, _ in pairs], [s for _, s in pairs])
        for chunk in chunks:
            chunk.start_param_sync(overlap=self.overlap_param_gather)

    # -- layout-independent state -------------------------------------------------------------
    def _state_keys(self) -> tuple:
        return ("param",) + (_STATE_KEYS[self.config.optimizer] if self.num_applied_steps else ())

    def _piece_value(self, piece, key: str) -> torch.Tensor:
        return piece.master if key == "param" else self.optimizer.state[piece.master][key]

    def _global_names(self) -> dict:
        names = {}
        for chunk in self.model_chunks:
            for name, param in chunk.module.named_parameters():
                names[param] = chunk.module.global_param_name(name)
        return names

    @torch.no_grad()
    def full_state(self) -> dict:
        """Collective over the data- and tensor-parallel groups. Returns
        {"step": n, "params": {global name: {key: {part name: full fp32 tensor}}}} with key "param"
        (the master weight) and the optimizer's moments; every rank gets the tensors of its stage."""
        names = self._global_names()
        keys = self._state_keys()
        out = {}
        for chunk in self.model_chunks:
            for buffer in chunk.buffers:
                by_bucket = {}
                for piece in self.pieces:
                    if piece.buffer is buffer:
                        by_bucket.setdefault(piece.bucket.index, []).append(piece)
                for bucket in buffer.buckets:
                    shard_start, _ = bucket.shard_range(buffer.dp_rank, buffer.dp_size)
                    shard_len = bucket.numel // buffer.dp_size
                    for key in keys:
                        local = torch.zeros(shard_len, dtype=torch.float32, device=buffer.grad_data.device)
                        for piece in by_bucket.get(bucket.index, []):
                            offset = bucket.param_ranges[piece.param][0] + piece.start - shard_start
                            local[offset:offset + piece.end - piece.start] = self._piece_value(piece, key)
                        whole = local.new_empty(bucket.numel)
                        comm.all_gather_into_tensor(whole, local, buffer.dp_group)
                        for param in bucket.params:
                            start, end = bucket.param_ranges[param]
                            tp_local = whole[start - bucket.start:end - bucket.start].view(param.shape)
                            full = param.tp_layout.local_to_full(tp_local, self.groups.tp)
                            out.setdefault(names[param], {})[key] = full
        return {"step": self.num_applied_steps, "params": out}

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        """Takes this rank's shards from `full_state()`'s form (saved under any layout), then
        re-assembles the model's parameters from the loaded masters."""
        names = self._global_names()
        self.num_applied_steps = state["step"]
        for piece in self.pieces:
            entry = state["params"][names[piece.param]]
            for key, parts in entry.items():
                value = piece.param.tp_layout.full_to_local(parts).reshape(-1)[piece.start:piece.end]
                if key == "param":
                    piece.master.copy_(value)
                else:
                    slot = self.optimizer.state[piece.master]
                    if key not in slot:
                        slot[key] = torch.zeros_like(piece.master)
                        # fused/capturable Adam keeps its step count on the parameter's device
                        on_device = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
                        slot["step"] = torch.tensor(float(state["step"]),
                                                    device=piece.master.device if on_device else "cpu")
                    slot[key].copy_(value)
        self._copy_masters_to_model()
        for chunk in self.model_chunks:
            chunk.finish_param_sync()


@dataclass
class _FSDPPiece:
    param: torch.nn.Parameter   # an FSDP2 DTensor parameter
    start: int                  # flat index of this rank's shard in the (TP-local) parameter
    master: torch.Tensor        # the sharded fp32 parameter's local tensor, flattened (no copy)


class FSDPOptimizer(ShardedOptimizer):
    """The optimizer for FSDP2 chunks: its state covers this rank's shard of every parameter,
    stepping the sharded fp32 parameters in place (FSDP gathers them before the next forward)."""

    def __init__(self, config: OptimizerConfig, model_chunks: list, groups: ParallelGroups):
        from megatron.core.distributed.fsdp import shard_row_start

        self.model_chunks = model_chunks
        pieces = []
        for chunk in model_chunks:
            for param in chunk.params:
                local = param.to_local().detach()  # shares storage with the sharded parameter
                if local.numel() == 0:
                    continue
                row_stride = math.prod(param.shape[1:])
                pieces.append(_FSDPPiece(param, shard_row_start(param, groups) * row_stride, local.view(-1)))
        model_params = [p for chunk in model_chunks for p in chunk.params]
        self._build(config, groups, pieces, model_params)

    def grads(self) -> list:
        return [p.param.grad.to_local().view(-1) if p.param.grad is not None else torch.zeros_like(p.master)
                for p in self.pieces]

    def _master_copies(self) -> list:
        return []

    def _copy_masters_to_model(self) -> None:
        """The masters are the sharded parameters themselves."""
