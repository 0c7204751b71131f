"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

Every parameter carries a `TPLayout` (`param.tp_layout`) that says how its local tensor is cut from
the full ("logical") tensors of the unsharded model. That one description serves:

- TP-invariant initialization: the full tensor is generated from the seed and the parameter's
  global name, then this rank's slice is taken, so TP=4 starts from the weights of TP=1;
- gathering gradients or weights back to the full form (tests, checkpoints, HF conversion);
- counting replicated parameters once in the global gradient norm;
- summing gradients of replicas that each saw only part of the work (sequence-parallel norms,
  key/value heads replicated when TP exceeds the number of query groups).
"""
import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.distributed import comm
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron.core.utils import divide


@dataclass(frozen=True)
class Part:
    """One logical tensor inside a (possibly fused) parameter.

    The part's `full_size` rows along the layout's dim are cut into `num_shards` equal slices;
    tensor-parallel rank r holds slice `r // replicas` with `replicas = tp_size // num_shards`.
    `sum_replica_grads`: replicas each compute only part of this slice's gradient (so their
    gradients must be summed), rather than each computing all of it.
    """

    name: str
    full_size: int
    num_shards: int
    sum_replica_grads: bool = False


@dataclass(frozen=True)
class TPLayout:
    dim: int
    parts: tuple
    tp_size: int
    tp_rank: int

    def replicas(self, part: Part) -> int:
        return self.tp_size // part.num_shards

    def local_range(self, part: Part, tp_rank: Optional[int] = None) -> tuple[int, int]:
        rank = self.tp_rank if tp_rank is None else tp_rank
        length = part.full_size // part.num_shards
        return (rank // self.replicas(part)) * length, length

    def local_offsets(self):
        """(part, offset in the local tensor, length) for each part."""
        offset = 0
        for part in self.parts:
            _, length = self.local_range(part)
            yield part, offset, length
            offset += length

    def full_to_local(self, full: dict) -> torch.Tensor:
        """This rank's tensor from the full logical tensors {part name: tensor}."""
        pieces = []
        for part in self.parts:
            start, length = self.local_range(part)
            pieces.append(full[part.name].narrow(self.dim, start, length))
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0].clone()

    def local_to_full(self, local: torch.Tensor, group) -> dict:
        """Gathers the full logical tensors from every TP rank's local tensor (collective)."""
        world = comm.size(group)
        moved = local.detach().movedim(self.dim, 0).contiguous()
        gathered = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
        comm.all_gather_into_tensor(gathered, moved, group)
        per_rank = gathered.chunk(world, dim=0)
        full = {}
        for part, offset, length in self.local_offsets():
            slices = [per_rank[shard * self.replicas(part)].narrow(0, offset, length)
                      for shard in range(part.num_shards)]
            full[part.name] = torch.cat(slices, dim=0).movedim(0, self.dim).contiguous()
        return full

    def unique_square_norm(self, tensor: torch.Tensor) -> torch.Tensor:
        """Squared L2 norm of this rank's tensor with each replicated slice weighted 1/replicas,
        so a sum over the tensor-parallel group counts every logical element once."""
        total = tensor.new_zeros((), dtype=torch.float32)
        for part, offset, length in self.local_offsets():
            piece = tensor.narrow(self.dim, offset, length).float()
            total = total + piece.pow(2).sum() / self.replicas(part)
        return total

    def sum_partial_replica_grads(self, grad: torch.Tensor, group) -> None:
        """In place: sums, over the ranks replicating each slice, the parts marked sum_replica_grads."""
        for part, offset, length in self.local_offsets():
            if not part.sum_replica_grads or self.replicas(part) == 1:
                continue
            local = grad.narrow(self.dim, offset, length)
            if part.num_shards == 1:
                reduced = local.contiguous()
                comm.all_reduce(reduced, group)
            else:
                start, _ = self.local_range(part)
                shape = list(local.shape)
                shape[self.dim] = part.full_size
                slots = local.new_zeros(shape)
                slots.narrow(self.dim, start, length).copy_(local)
                comm.all_reduce(slots, group)
                reduced = slots.narrow(self.dim, start, length)
            local.copy_(reduced)


def replicated_layout(shape, tp_size: int, tp_rank: int, sum_replica_grads: bool = False) -> TPLayout:
    """A parameter every TP rank holds whole (norms, biases of row-parallel layers)."""
    return TPLayout(0, (Part("", shape[0], 1, sum_replica_grads),), tp_size, tp_rank)


def split_layout(dim: int, full_size: int, tp_size: int, tp_rank: int, what: str) -> TPLayout:
    divide(full_size, tp_size, f"{what} by --tensor-model-parallel-size")
    return TPLayout(dim, (Part("", full_size, tp_size),), tp_size, tp_rank)


def set_layout(param: torch.nn.Parameter, layout: TPLayout, init: str) -> None:
    """Attaches the TP layout and the init rule ('normal', 'scaled_normal', 'ones', 'zeros')."""
    param.tp_layout = layout
    param.init = init


def seeded_generator(seed: int, name: str, device="cpu") -> torch.Generator:
    """A generator keyed by (seed, logical tensor name): independent of layout and order.

    It lives on the parameter's device, so a GPU run draws its full tensors on the GPU (fast
    start-up for large models); every rank of a run uses the same device type, so all layouts of
    that run still start from the same weights."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def full_shape(param: torch.nn.Parameter, part: Part) -> list:
    shape = list(param.shape)
    shape[param.tp_layout.dim] = part.full_size
    return shape


@torch.no_grad()
def initialize_param(param: torch.nn.Parameter, name: str, seed: int, std: float, num_layers: int) -> None:
    """Fills `param` with its slice of the full tensor generated for `name` (see module docstring)."""
    param.copy_(param.tp_layout.full_to_local(initial_values(param, name, seed, std, num_layers, param.device)))


@torch.no_grad()
def initial_values(param: torch.nn.Parameter, name: str, seed: int, std: float, num_layers: int,
                   device) -> dict:
    """{part name: the full fp32 logical tensor} that `param`'s initial value is cut from."""
    layout: TPLayout = param.tp_layout
    full = {}
    for part in layout.parts:
        shape = full_shape(param, part)
        if param.init == "ones":
            full[part.name] = torch.ones(shape, device=device)
        elif param.init == "zeros":
            full[part.name] = torch.zeros(shape, device=device)
        else:
            part_std = std / math.sqrt(2.0 * num_layers) if param.init == "scaled_normal" else std
            key = f"{name}.{part.name}" if part.name else name
            generator = seeded_generator(seed, key, device)
            full[part.name] = torch.empty(shape, device=device).normal_(0.0, part_std, generator=generator)
    return full


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by rows (output features) over the tensor-parallel group.

    Input: [s, b, in] replicated (or [s/tp, b, in] with sequence parallelism, all-gathered here).
    Output: [s, b, out/tp] unless `gather_output`. `parts` describes a fused weight (e.g. q/k/v or
    gate/up) as a tuple of `Part`s; by default the weight is one part split evenly.
    """

    def __init__(self, input_size: int, output_size: Optional[int], *, tp_group, tp_size: int, tp_rank: int,
                 bias: bool, sequence_parallel: bool = False, gather_output: bool = False,
                 parts: Optional[tuple] = None, params_dtype=torch.float32, device=None,
                 init: str = "normal"):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.gather_output = gather_output
        if parts is None:
            divide(output_size, tp_size, "output features of a column-parallel linear by --tensor-model-parallel-size")
            parts = (Part("", output_size, tp_size),)
        self.layout = TPLayout(0, parts, tp_size, tp_rank)
        local_out = sum(self.layout.local_range(p)[1] for p in parts)
        self.weight = torch.nn.Parameter(torch.empty(local_out, input_size, dtype=params_dtype, device=device))
        set_layout(self.weight, self.layout, init)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(local_out, dtype=params_dtype, device=device))
            set_layout(self.bias, self.layout, "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by columns (input features) over the tensor-parallel group.

    Input: [s, b, in/tp] (already parallel). Output: [s, b, out] all-reduced, or [s/tp, b, out]
    reduce-scattered with sequence parallelism. The bias is added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, tp_size: int, tp_rank: int,
                 bias: bool, sequence_parallel: bool = False, input_is_parallel: bool = True,
                 params_dtype=torch.float32, device=None, init: str = "scaled_normal"):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.input_is_parallel = input_is_parallel
        layout = split_layout(1, input_size, tp_size, tp_rank, "input features of a row-parallel linear")
        local_in = input_size // tp_size
        self.weight = torch.nn.Parameter(torch.empty(output_size, local_in, dtype=params_dtype, device=device))
        set_layout(self.weight, layout, init)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            set_layout(self.bias, replicated_layout((output_size,), tp_size, tp_rank, self.sequence_parallel), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows over the tensor-parallel group.

    Each rank looks up the tokens in its row range, zeros the rest, and the partial results are
    summed (all-reduce, or reduce-scatter along the sequence with sequence parallelism).
    Input: [b, s] token ids. Output: [s, b, h] (or [s/tp, b, h]).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, tp_size: int, tp_rank: int,
                 sequence_parallel: bool = False, params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        layout = split_layout(0, num_embeddings, tp_size, tp_rank, "padded vocabulary size")
        self.vocab_start, local_rows = layout.local_range(layout.parts[0])
        self.vocab_end = self.vocab_start + local_rows
        self.tp_size = tp_size
        self.weight = torch.nn.Parameter(torch.empty(local_rows, embedding_dim, dtype=params_dtype, device=device))
        set_layout(self.weight, layout, "normal")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.t()  # [s, b]: sequence-first from here on
        if self.tp_size > 1:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(tokens, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)
