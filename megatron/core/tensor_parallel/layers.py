"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

Every parameter carries a `TPLayout` (`param.tp_layout`) that says how its local tensor is cut from
the full ("logical") tensors of the unsharded model. That one description serves:

- TP-invariant initialization: the full tensor is generated from the seed and the parameter's
  global name, then this rank's slice is taken, so TP=4 starts from the weights of TP=1;
- gathering gradients or weights back to the full form (tests, checkpoints, HF conversion);
- counting replicated parameters once in the global gradient norm;
- summing gradients of replicas that each saw only part of the work (sequence-parallel norms,
  key/value heads replicated when TP exceeds the number of query groups).

The column- and row-parallel linears (and the output layer) run one autograd Function,
`linear_with_grad_accumulation`, which also owns the tensor-parallel communication of its input and
input gradient, so it can (a) save only the local sequence shard under sequence parallelism and
re-gather it in backward, (b) overlap that gather and the input-gradient reduction with the GEMMs,
and (c) accumulate the weight gradient straight into the fp32 `main_grad` buffer that data
parallelism attaches (`--gradient-accumulation-fusion`, Megatron's default), instead of producing a
`param.grad` in the parameter's dtype that a hook then adds to `main_grad`.
"""
import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.distributed import comm
from megatron.core.distributed.replica_grads import all_reduce_partial_replica_grads
from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.mappings import (
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
        all_reduce_partial_replica_grads([(self, grad)], group)


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


# -- the one linear Function ---------------------------------------------------------------------
GATHER_INPUT = "gather_input"          # sequence parallel: all-gather dim 0 in, reduce-scatter the input grad
ALL_REDUCE_INPUT_GRAD = "all_reduce"   # replicated input: all-reduce the input grad


def main_grad_ready(param: torch.nn.Parameter) -> None:
    """Tells whoever owns `param.main_grad` (data parallelism's `main_grad_hook`) that this backward's
    contribution is in, as autograd's post-accumulate hook would have for a `param.grad`."""
    hook = getattr(param, "main_grad_hook", None)
    if hook is not None:
        hook(param)


def main_grad_accumulated(param: torch.nn.Parameter, notify: bool = True) -> None:
    """Records that this backward added into `param.main_grad` (no longer empty this step:
    `main_grad_empty`) and, with `notify`, tells its owner (`main_grad_ready`)."""
    param.main_grad_empty = False
    if notify:
        main_grad_ready(param)


def main_grad_empty(param: torch.nn.Parameter) -> bool:
    """Whether `param.main_grad` holds nothing yet this optimizer step: set when data parallelism
    zeroes its gradient buffer (`ParamAndGradBuffer.reset`), cleared by the first accumulation into it
    (here, in the embedding's backward and in data parallelism's gradient hook). False where unknown."""
    return getattr(param, "main_grad_empty", False)


_MIXED_ADDMM = {}


def _mixed_dtype_addmm_works(device: torch.device) -> bool:
    """Whether `torch.addmm(..., out_dtype=fp32)` runs bf16/fp16 GEMMs into an fp32 output on this
    device type (cuBLAS does; the CPU build has no such kernel). Probed once per device type."""
    if device.type not in _MIXED_ADDMM:
        try:
            out = torch.zeros(2, 2, device=device)
            half = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
            torch.addmm(out, half, half, out_dtype=torch.float32, out=out)
            _MIXED_ADDMM[device.type] = bool(torch.all(out == 2))
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_ADDMM[device.type] = False
    return _MIXED_ADDMM[device.type]


def accumulate_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b without a separate product tensor where the device allows: one GEMM with
    beta = 1, into an fp32 `out` even when a and b are bf16 (on GPU). Elsewhere the product is formed
    in a's dtype and added (the same arithmetic as autograd's gradient plus a hook's add)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    elif _mixed_dtype_addmm_works(out.device):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(a @ b)


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the tensor-parallel communication of x and of its gradient.

    input_comm GATHER_INPUT: x is this rank's sequence shard [s/tp, b, in]; forward all-gathers it;
    backward re-gathers it (asynchronously, under the input-gradient GEMM) for the weight gradient and
    reduce-scatters the input gradient (asynchronously, under the weight-gradient GEMM).
    ALL_REDUCE_INPUT_GRAD: x is replicated; the input gradient is all-reduced under the weight GEMM.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, input_comm, fuse_wgrad, notify, fp8):
        total = x
        if input_comm == GATHER_INPUT:
            total = x.new_empty((comm.size(group) * x.shape[0], *x.shape[1:]))
            comm.all_gather_into_tensor(total, x, group)
        fp8_input = None  # FP8: the input's cast transpose, kept for the weight gradient instead of x
        if fp8 is not None:
            y, fp8_input = fp8.forward_keeping_input(total, weight, keep_input=input_comm != GATHER_INPUT)
            y = y + bias if bias is not None else y
        else:
            y = F.linear(total, weight, bias)
        if fp8_input is not None:
            ctx.save_for_backward(None, weight, *fp8_input)
        else:
            ctx.save_for_backward(x, weight)  # x: the local shard under sequence parallelism
        ctx.group, ctx.input_comm, ctx.fp8 = group, input_comm, fp8
        ctx.fuse_wgrad, ctx.notify, ctx.has_bias = fuse_wgrad, notify, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, *fp8_input = ctx.saved_tensors
        group, fp8 = ctx.group, ctx.fp8
        total, gather = x, None
        if ctx.input_comm == GATHER_INPUT and ctx.needs_input_grad[1]:
            total = x.new_empty((comm.size(group) * x.shape[0], *x.shape[1:]))
            gather = comm.all_gather_into_tensor(total, x, group, async_op=True)
        # FP8: the output gradient is cast once, for both GEMMs.
        grad_fp8 = fp8.quantize_grad(grad, transpose=ctx.needs_input_grad[1]) if fp8 is not None else None
        by_sample = fp8 is None and _transposed_rows(grad)
        grad_input, reduction = None, None
        if ctx.needs_input_grad[0] and fp8 is not None:
            grad_input = fp8.dgrad(grad, weight, grad_fp8)
        elif ctx.needs_input_grad[0] and by_sample:  # [b, s, in] batch-first, as the input was
            grad_input = grad.new_empty((*grad.shape[:-1], weight.shape[1]))
            for sample in range(grad.shape[0]):
                torch.mm(grad[sample], weight, out=grad_input[sample])
        elif ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight)
        if gather is not None:
            gather.wait()
        if grad_input is not None and ctx.input_comm == GATHER_INPUT:
            shard = grad_input.new_empty((grad_input.shape[0] // comm.size(group), *grad_input.shape[1:]))
            reduction = comm.reduce_scatter_tensor(shard, grad_input, group, async_op=True)
            grad_input = shard
        elif grad_input is not None and ctx.input_comm == ALL_REDUCE_INPUT_GRAD:
            reduction = comm.all_reduce(grad_input, group, async_op=True)
        grad2d = None if by_sample else grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if by_sample:  # one GEMM per sample: grad[i] [s, out] (rows strided), total[i] [s, in]
                pairs = [(grad[i], total[i]) for i in range(grad.shape[0])]
            else:
                pairs = [(grad2d, total.reshape(-1, total.shape[-1]) if total is not None else None)]
            grad_weight = _weight_gradient(ctx, pairs, weight, grad_fp8, fp8_input or None)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 1)) if by_sample else grad2d.sum(0)
        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _transposed_rows(grad: torch.Tensor) -> bool:
    """Whether `grad` [b, s, out] (1 < b <= s) is a transposed view of [s, b, out] memory: the
    gradient of a batch-first output handed on sequence-first (attention's output projection). Its
    rows are then not one [b*s, out] matrix without a copy, so both gradient GEMMs run per sample
    (b of them; a longer first dim is copied into one matrix instead)."""
    return (grad.dim() == 3 and 1 < grad.shape[0] <= grad.shape[1] and not grad.is_contiguous()
            and grad.transpose(0, 1).is_contiguous())


def _weight_gradient(ctx, pairs, weight, grad_fp8=None, fp8_input=None):
    """dW = sum over `pairs` (grad [T, out], input [T, in]) of grad^T input, accumulated into
    `weight.main_grad` (returning None) when fused. FP8 (one pair): from the cast output gradient
    and the input as the forward kept it (else the pair's input)."""
    fp8 = ctx.fp8
    grad2d, input2d = pairs[0]
    if not ctx.fuse_wgrad and fp8 is not None:
        return fp8.wgrad(grad2d, input2d, grad_fp8, fp8_input)
    if not ctx.fuse_wgrad:
        grad_weight = grad2d.t().matmul(input2d)
        for grad_rows, input_rows in pairs[1:]:
            grad_weight.addmm_(grad_rows.t(), input_rows)
        return grad_weight
    if fp8 is not None and main_grad_empty(weight) and fp8.writes_into(weight.main_grad):
        # Nothing accumulated since the buffer was zeroed: the GEMM writes its product straight into
        # main_grad (4 bytes per element written, instead of 2 written + 2 + 4 read + 4 written).
        fp8.wgrad(grad2d, input2d, grad_fp8, fp8_input, out=weight.main_grad)
    elif fp8 is not None:
        # Later micro-batches: `_scaled_mm` cannot accumulate, and a product in the gradient's dtype
        # then added moves fewer bytes (2 + 2 + 4 + 4) than an fp32 product then added (4 + 4 + 4 + 4).
        weight.main_grad.add_(fp8.wgrad(grad2d, input2d, grad_fp8, fp8_input))
    else:
        for grad_rows, input_rows in pairs:
            accumulate_matmul_(weight.main_grad, grad_rows.t(), input_rows)
    main_grad_accumulated(weight, ctx.notify)
    return None


def fuses_grad_accumulation(weight: torch.nn.Parameter, enabled: bool) -> bool:
    """Fusion applies where data parallelism gave the weight an fp32 `main_grad` buffer (not under
    FSDP2, not for a bare module) and a backward will run."""
    return enabled and torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad")


def linear_with_grad_accumulation(x, weight, bias=None, *, group=None, input_comm=None,
                                  gradient_accumulation_fusion: bool = True, notify: bool = True, fp8=None):
    """The linear layer every parallel linear calls (see `_LinearFunction`).

    `notify=False` leaves the "gradient ready" signal to another use of the same weight later in
    backward (the tied output layer before the embedding). `fp8`: an FP8 GEMM recipe
    (`transformer.fp8`) or None."""
    if comm.size(group) == 1:
        input_comm = None
    fuse = fuses_grad_accumulation(weight, gradient_accumulation_fusion)
    return _LinearFunction.apply(x, weight, bias, group, input_comm, fuse, notify, fp8)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by rows (output features) over the tensor-parallel group.

    Input: [s, b, in] replicated (or [s/tp, b, in] with sequence parallelism, all-gathered here).
    Output: [s, b, out/tp] unless `gather_output`. `parts` describes a fused weight (e.g. q/k/v or
    gate/up) as a tuple of `Part`s; by default the weight is one part split evenly.
    """

    def __init__(self, input_size: int, output_size: Optional[int], *, tp: TensorParallel = TensorParallel(),
                 bias: bool, sequence_parallel: bool = False, gather_output: bool = False,
                 parts: Optional[tuple] = None, params_dtype=torch.float32, device=None,
                 init: str = "normal", gradient_accumulation_fusion: bool = True):
        super().__init__()
        self.tp_group = tp.group
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.gather_output = gather_output
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.fp8 = None  # an FP8 GEMM recipe, attached by the model for FP8 layers
        if parts is None:
            divide(output_size, tp.size, "output features of a column-parallel linear by `tensor_model_parallel_size`")
            parts = (Part("", output_size, tp.size),)
        self.layout = TPLayout(0, parts, tp.size, tp.rank)
        local_out = sum(self.layout.local_range(p)[1] for p in parts)
        self.weight = torch.nn.Parameter(torch.empty(local_out, input_size, dtype=params_dtype, device=device))
        set_layout(self.weight, self.layout, init)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(local_out, dtype=params_dtype, device=device))
            set_layout(self.bias, self.layout, "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_with_grad_accumulation(
            x, self.weight, self.bias, group=self.tp_group,
            input_comm=GATHER_INPUT if self.sequence_parallel else ALL_REDUCE_INPUT_GRAD,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion, fp8=self.fp8)
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by columns (input features) over the tensor-parallel group.

    Input: [s, b, in/tp] (already parallel). Output: [s, b, out] all-reduced, or [s/tp, b, out]
    reduce-scattered with sequence parallelism. The bias is added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TensorParallel = TensorParallel(),
                 bias: bool, sequence_parallel: bool = False, input_is_parallel: bool = True,
                 params_dtype=torch.float32, device=None, init: str = "scaled_normal",
                 gradient_accumulation_fusion: bool = True):
        super().__init__()
        self.tp_group = tp.group
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.input_is_parallel = input_is_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.fp8 = None  # an FP8 GEMM recipe, attached by the model for FP8 layers
        layout = split_layout(1, input_size, tp.size, tp.rank, "input features of a row-parallel linear")
        local_in = input_size // tp.size
        self.weight = torch.nn.Parameter(torch.empty(output_size, local_in, dtype=params_dtype, device=device))
        set_layout(self.weight, layout, init)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            set_layout(self.bias, replicated_layout((output_size,), tp.size, tp.rank, self.sequence_parallel), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        y = linear_with_grad_accumulation(x, self.weight, group=self.tp_group,
                                          gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                          fp8=self.fp8)
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

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel = TensorParallel(),
                 sequence_parallel: bool = False, params_dtype=torch.float32, device=None,
                 gradient_accumulation_fusion: bool = True):
        super().__init__()
        self.tp_group = tp.group
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel = sequence_parallel and tp.size > 1
        layout = split_layout(0, num_embeddings, tp.size, tp.rank, "padded vocabulary size")
        self.vocab_start, local_rows = layout.local_range(layout.parts[0])
        self.vocab_end = self.vocab_start + local_rows
        self.tp_size = tp.size
        self.weight = torch.nn.Parameter(torch.empty(local_rows, embedding_dim, dtype=params_dtype, device=device))
        set_layout(self.weight, layout, "normal")

    def forward(self, tokens: torch.Tensor, notify: bool = True) -> torch.Tensor:
        """`notify=False` leaves the "gradient ready" signal to another lookup in the same table
        whose backward runs later (multi-token prediction embeds the tokens several times)."""
        tokens = tokens.t()  # [s, b]: sequence-first from here on
        outside = None
        local_ids = tokens
        if self.tp_size > 1:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        if fuses_grad_accumulation(self.weight, self.gradient_accumulation_fusion):
            out = _EmbeddingFunction.apply(local_ids, outside, self.weight, notify)
        else:
            out = F.embedding(local_ids, self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0) if outside is not None else out
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)


class _EmbeddingFunction(torch.autograd.Function):
    """Embedding lookup whose backward adds the rows' gradients straight into `weight.main_grad`
    (`index_add_` over the s*b looked-up rows) instead of building a dense [V/tp, h] gradient."""

    @staticmethod
    def forward(ctx, local_ids, outside, weight, notify=True):
        out = F.embedding(local_ids, weight)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        ctx.save_for_backward(local_ids, outside)
        ctx.weight = weight
        ctx.notify = notify
        return out

    @staticmethod
    def backward(ctx, grad):
        local_ids, outside = ctx.saved_tensors
        if outside is not None:
            grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
        main_grad = ctx.weight.main_grad
        main_grad.index_add_(0, local_ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype))
        main_grad_accumulated(ctx.weight, ctx.notify)
        return None, None, None, None
