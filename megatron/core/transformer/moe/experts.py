"""The routed experts of one rank, their weights stored stacked, and the shared experts.

GroupedMLP holds this rank's `num_local_experts` experts as stacked tensors, each expert an MLP with
the model's activation (SwiGLU or GeLU):

    linear_fc1.weight [E_local, ffn/etp (x2 when gated: gate then up), h]
    linear_fc2.weight [E_local, h, ffn/etp]

Tokens arrive sorted by expert (`tokens_per_expert` rows each, a device tensor). Wherever PyTorch
has `torch._grouped_mm` for the device and dtype (CUDA compute capability 9.0+ in bf16; the CPU build
in fp32 and bf16) each weight's three GEMMs are one grouped GEMM each, forward, input gradient and
weight gradient, with the offsets computed on the device: the work per layer does not grow with the
expert count, and nothing is read back to the host. The weight gradient reaches the fp32 `main_grad`
that data parallelism attaches (--gradient-accumulation-fusion) in one pass per weight
(`accumulate_expert_grads_`, one kernel when compiled), or, with --moe-grouped-wgrad triton, by a
Triton grouped GEMM that adds into it itself (moe/triton_experts.py), or, with --moe-grouped-wgrad
per-expert, by one GEMM per expert accumulating into its slice (cuBLAS, beta = 1, fp32 output: no
product, no pass after it), the counts copied to the host without waiting in forward (`HostCounts`);
never a stacked gradient added by the data-parallel hook. Where `torch._grouped_mm` does not run
(and under FP8) the experts loop over GEMMs with the row counts read back once, each expert's
weight gradient accumulated into its `main_grad` slice. Under FP8 (`attach_fp8`) the experts' GEMMs run in FP8, each
expert with its own scaling state, on rows padded per expert to a multiple of 16
(moe/fp8_experts.py), or, with the routing padded instead (--moe-router-padding-for-fp8), as
grouped FP8 GEMMs with the counts on the device. Expert-tensor parallelism splits the expert hidden
size as the dense MLP's TP does (fc2's partial sums are added by the dispatcher).

Initialization is per global expert index (`initialize_expert_param`), so an expert starts from the
same weights whatever the expert-parallel layout.
"""
import dataclasses
import re
import types

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import (
    Part,
    TPLayout,
    accumulate_matmul_,
    fuses_grad_accumulation,
    initial_values,
    main_grad_accumulated,
    replicated_layout,
    set_layout,
)
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.fusions import swiglu
from megatron.core.transformer.mlp import _ACTIVATIONS, MLP
from megatron.core.transformer.moe import triton_experts
from megatron.core.transformer.moe.fp8_experts import (
    ExpertsFP8,
    grouped_fp8_supported,
    pad_rows,
    padded_counts,
    real_rows,
)
from megatron.core.utils import HostCopy, divide


class GroupedMLP(torch.nn.Module):
    compilable = {"accumulate_grads": "fuse_elementwise", "_swiglu": "fuse_elementwise"}  # parallelize.py
    compiled_dynamic = {"_swiglu"}  # the routed rows vary between micro-batches at EP > 1 (all-to-all)

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, num_local_experts: int, expert_offset: int,
                 etp: TensorParallel = TensorParallel(), tp: TensorParallel = TensorParallel(), device):
        super().__init__()
        self.gated = config.swiglu
        self.activation = _ACTIVATIONS[config.activation]
        self._swiglu = swiglu if self.gated and config.activation == "silu" else None  # as the dense MLP's
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset  # global index of local expert 0
        self.gradient_accumulation_fusion = execution.gradient_accumulation_fusion
        self.fp8 = None  # {"fc1": ExpertsFP8, "fc2": ExpertsFP8}, set by `attach_fp8`
        self.routing_padded = execution.moe_router_padding_for_fp8  # counts are multiples of 16 already
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        local_ffn = divide(ffn, etp.size, "`moe_ffn_hidden_size` by `expert_tensor_parallel_size`")
        dtype = execution.params_dtype
        rows = 2 * local_ffn if self.gated else local_ffn
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, rows, hidden, dtype=dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, local_ffn, dtype=dtype,
                                                         device=device))
        self.fc1_bias = self.fc2_bias = None
        if config.add_bias_linear:
            self.fc1_bias = torch.nn.Parameter(torch.empty(num_local_experts, rows, dtype=dtype, device=device))
            self.fc2_bias = torch.nn.Parameter(torch.empty(num_local_experts, hidden, dtype=dtype, device=device))
        self.add_fc2_bias = etp.rank == 0  # fc2's outputs are partial sums over etp: add its bias once
        # The grouped weight gradient's way into main_grad (compiled with the elementwise fusions:
        # one pass over the experts' weights instead of two).
        self.accumulate_grads = accumulate_expert_grads_
        self.triton_wgrad = execution.moe_grouped_wgrad == "triton"  # (where the kernel runs: triton_experts.py)
        self.per_expert_wgrad = execution.moe_grouped_wgrad == "per-expert"  # (the grouped paths: HostCounts)
        # auto: the grouped path until the start-up probe sets `per_expert_wgrad` (moe/wgrad_choice.py)
        self.wgrad_auto = execution.moe_grouped_wgrad == "auto"
        # Layouts of the stacked tensors (dim 0 is the expert) over the expert-tensor-parallel ranks:
        # the hidden size split like the dense MLP's. With etp = 1 an expert is whole on every rank
        # that holds it, and the gradients of its copies are summed over the expert-data-parallel
        # group (which then includes the TP ranks); fc2's bias is added on etp rank 0 only, so its
        # gradient is summed over the etp ranks.
        if etp.size > 1 and etp.size != tp.size:
            raise ValueError(f"`expert_tensor_parallel_size` ({etp.size}) must be 1 or "
                             f"`tensor_model_parallel_size` ({tp.size})")
        fc1_parts = ((Part("gate", ffn, etp.size), Part("up", ffn, etp.size)) if self.gated
                     else (Part("", ffn, etp.size),))
        layouts = {
            "fc1_weight": TPLayout(1, fc1_parts, etp.size, etp.rank),
            "fc2_weight": TPLayout(2, (Part("", ffn, etp.size),), etp.size, etp.rank),
            "fc1_bias": TPLayout(1, fc1_parts, etp.size, etp.rank),
            "fc2_bias": TPLayout(1, (Part("", hidden, 1, etp.size > 1),), etp.size, etp.rank),
        }
        for name, param in self.named_parameters():
            init = "zeros" if "bias" in name else ("scaled_normal" if name == "fc2_weight" else "normal")
            set_layout(param, layouts[name], init)
            param.expert_offset = expert_offset

    def attach_fp8(self, make_fp8_linear) -> list:
        """Runs the experts' GEMMs in FP8: one `FP8Linear` (from `make_fp8_linear()`) per local
        expert and weight, each with its own scaling state. Returns them all (to bind)."""
        self.fp8 = {name: ExpertsFP8([make_fp8_linear() for _ in range(self.num_local_experts)])
                    for name in ("fc1", "fc2")}
        return self.fp8["fc1"].linears + self.fp8["fc2"].linears

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs=None) -> torch.Tensor:
        """tokens [N, h] sorted by local expert (`tokens_per_expert` [E_local] rows each, a device
        tensor or a list; rows past their sum are the dispatcher's sentinel rows) -> expert outputs
        [N, h] (partial sums over expert-tensor-parallel ranks), weighted by `probs` [N] if given
        (the MoE layer's dispatcher weights them itself, in its combine)."""
        if self.uses_grouped_mm(tokens) if self.fp8 is None else self.fp8_counts_on_device(tokens):
            out = self._mlp(tokens, tokens_per_expert, grouped=True)
        else:
            out = self._host_counted(tokens, tokens_per_expert)
        return out if probs is None else out * probs.unsqueeze(-1).to(out.dtype)

    def uses_grouped_mm(self, tokens: torch.Tensor) -> bool:
        """Whether the experts run as grouped GEMMs with offsets on the device (wherever PyTorch has
        `torch._grouped_mm` for this device, dtype and these widths), whatever --moe-grouped-gemm
        says: the loop is only the fallback, so the path the CPU tests run is the GPU's."""
        return _grouped_mm_supported(tokens) and _grouped_mm_aligned(tokens, self.fc1_weight, self.fc2_weight)

    def fp8_counts_on_device(self, tokens: torch.Tensor) -> bool:
        """Whether the FP8 experts take their row counts as a device tensor: with the routing padded
        (--moe-router-padding-for-fp8, so no row padding is left to do) and one scale per expert and
        tensor (tensorwise, delayed), on the FP8 grouped kernel or, off the GPU, its fp32 arithmetic
        (moe/fp8_experts.py). Rowwise and blockwise still loop over the experts."""
        if not (self.routing_padded and self.fp8["fc1"].options.recipe in ("delayed", "tensorwise")):
            return False
        if tokens.is_cuda:
            return grouped_fp8_supported(tokens, rowwise=False)
        as_fp32 = tokens.new_empty((0, tokens.shape[-1]), dtype=torch.float32)  # the fallback's operands
        return hasattr(torch, "_grouped_mm") and _grouped_mm_aligned(as_fp32, self.fc1_weight, self.fc2_weight)

    def _host_counted(self, tokens: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """The paths that need the row counts on the host (one read-back): the loop of GEMMs where
        `torch._grouped_mm` does not run, and FP8 (rows padded per expert to its alignment). Sentinel
        rows past the counted ones get zeros."""
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        num_rows = sum(counts)
        rows = tokens[:num_rows]
        padded = padded_counts(counts) if self.fp8 is not None else counts
        if padded != counts:
            # FP8: rows per expert padded to its alignment, the padding dropped again at the end.
            real = real_rows(counts, padded, tokens.device)
            out = self._mlp(pad_rows(rows, real, sum(padded)), padded, grouped=False).index_select(0, real)
        else:
            out = self._mlp(rows, counts, grouped=False)
        if num_rows == tokens.shape[0]:
            return out
        return torch.cat([out, out.new_zeros((tokens.shape[0] - num_rows, out.shape[-1]))])

    def _mlp(self, tokens: torch.Tensor, tokens_per_expert, grouped: bool) -> torch.Tensor:
        row_expert = None
        if self.fc1_bias is not None:
            row_expert = _row_experts(tokens_per_expert, tokens.shape[0], tokens.device)
        # --moe-grouped-wgrad per-expert: the counts start on their way to the host now, for both
        # weights' backward (which reads them without waiting on the GPU's queue).
        host_counts = None
        weights = (self.fc1_weight, self.fc2_weight)
        if grouped and self.per_expert_wgrad and any(
                fuses_grad_accumulation(w, self.gradient_accumulation_fusion) for w in weights):
            host_counts = HostCounts(tokens_per_expert)
        h = self._linear(tokens, "fc1", tokens_per_expert, grouped, host_counts)
        if self.fc1_bias is not None:
            h = h + _per_row(self.fc1_bias, row_expert)
        out = self._linear(self._activate(h), "fc2", tokens_per_expert, grouped, host_counts)
        if self.fc2_bias is not None and self.add_fc2_bias:
            out = out + _per_row(self.fc2_bias, row_expert)
        return out

    def _linear(self, x: torch.Tensor, name: str, tokens_per_expert, grouped: bool,
                host_counts=None) -> torch.Tensor:
        weight = self.fc1_weight if name == "fc1" else self.fc2_weight
        # Fused: the weight gradient goes into main_grad here (`accumulate`: the grouped paths' way).
        fused = fuses_grad_accumulation(weight, self.gradient_accumulation_fusion)
        accumulate = self.accumulate_grads if fused else None
        if self.fp8 is not None:
            return self.fp8[name](x, weight, tokens_per_expert, accumulate, self.triton_wgrad,
                                  host_counts if fused else None)
        return _ExpertsFunction.apply(x, weight, tokens_per_expert, grouped, accumulate, self.triton_wgrad,
                                      host_counts if fused else None)

    def _activate(self, h):
        if self._swiglu is not None:
            return self._swiglu(h)
        if not self.gated:
            return self.activation(h)
        gate, up = h.chunk(2, dim=-1)
        return self.activation(gate) * up


class _ExpertsFunction(torch.autograd.Function):
    """Per expert e, rows_e @ weight[e]^T: one grouped GEMM (`grouped`: `counts` a device tensor or a
    list, the offsets computed on the device) or a loop of GEMMs (`counts` a list).

    Backward, grouped: the input gradient is one grouped GEMM grad_e @ weight[e], and the weight
    gradient one grouped GEMM grad^T x with the groups along the contracted (row) dimension, giving
    all experts' [n, k] products at once ([E, n, k]; an expert without rows gets zeros). Given
    `accumulate` (--gradient-accumulation-fusion: `accumulate_expert_grads_`, compiled with the
    elementwise fusions) that product reaches the fp32 `weight.main_grad` in one pass per weight
    and micro-batch: `torch._grouped_mm` has no accumulating form, so its output is fp32 where the
    device's kernel writes fp32 from the weights' dtype (no rounding of the product), else the
    weights' dtype; one pass over E x n x k elements costs far less than a GEMM per expert.
    With `triton_wgrad` (--moe-grouped-wgrad triton, where its kernel runs) one Triton grouped GEMM
    adds each expert's gradient into `main_grad` itself instead (moe/triton_experts.py: no product).
    With `host_counts` (--moe-grouped-wgrad per-expert: a `HostCounts` started in forward) the
    weight gradient is one GEMM per expert with rows, each accumulating into main_grad[e] (no product,
    work growing with the expert count: for a few large experts, as Mixtral's).
    Looped: a GEMM per expert for each gradient, the weight's accumulated into `main_grad[e]`
    (given `accumulate`) or returned stacked. Either way data parallelism's hook is told once.
    """

    @staticmethod
    def forward(ctx, x, weight, counts, grouped, accumulate, triton_wgrad=False, host_counts=None):
        ctx.grouped, ctx.accumulate, ctx.triton_wgrad, ctx.host_counts = grouped, accumulate, triton_wgrad, host_counts
        if grouped:
            counts = torch.as_tensor(counts, device=x.device)
            offsets = _offsets(counts)
            ctx.save_for_backward(x, weight, offsets, counts)
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return _looped_linear(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.grouped:
            return _grouped_backward(ctx, grad)
        return _looped_backward(ctx, grad)


def _grouped_backward(ctx, grad):
    x, weight, offsets, counts = ctx.saved_tensors
    grad_input = torch._grouped_mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
    if not ctx.needs_input_grad[1]:
        return grad_input, None, None, None, None, None, None
    accumulate = ctx.accumulate
    if accumulate is not None and ctx.triton_wgrad and triton_experts.supported(grad, x, weight.main_grad):
        triton_experts.accumulate_grouped_wgrad_(weight.main_grad, grad, x, offsets)
        main_grad_accumulated(weight)
        return grad_input, None, None, None, None, None, None
    if accumulate is not None and ctx.host_counts is not None:
        # --moe-grouped-wgrad per-expert: one GEMM per expert that received rows, accumulating into
        # its main_grad slice (on the GPU: cuBLAS with beta = 1 and an fp32 output; no product).
        _accumulate_per_expert_(weight.main_grad, grad, x, ctx.host_counts.read())
        main_grad_accumulated(weight)
        return grad_input, None, None, None, None, None, None
    fused_dtype = accumulate is not None and _grouped_mm_writes(grad, weight.main_grad.dtype)
    out_dtype = weight.main_grad.dtype if fused_dtype else None
    product = torch._grouped_mm(grad.t(), x, offs=offsets, out_dtype=out_dtype)    # [E, n, k]
    if accumulate is None:
        # An expert without rows: zeros whatever the kernel leaves in its slot.
        return grad_input, product.masked_fill_(counts.eq(0).view(-1, 1, 1), 0), None, None, None, None, None
    accumulate(weight.main_grad, product, counts)
    main_grad_accumulated(weight)
    return grad_input, None, None, None, None, None, None


def accumulate_expert_grads_(main_grad: torch.Tensor, product: torch.Tensor, counts: torch.Tensor) -> None:
    """main_grad [E, n, k] += the grouped weight gradient `product` [E, n, k], except for the experts
    without rows (`counts` [E] zero), whatever the kernel left in their slots (a group with nothing
    along the contracted dimension is not necessarily written). Compiled (`GroupedMLP.compilable`):
    one kernel reading the product and main_grad once and writing main_grad once; eager: the slots
    zeroed in place, then an add (two passes, nothing allocated)."""
    empty = counts.eq(0).view(-1, 1, 1)
    if torch.compiler.is_compiling():
        main_grad.add_(torch.where(empty, 0, product))  # (writing the product back would be a pass)
    else:
        main_grad.add_(product.masked_fill_(empty, 0))


def _accumulate_per_expert_(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, counts: list) -> None:
    """main_grad[e] += grad[rows of e]^T @ x[rows of e] for each expert e with rows (`counts` on the
    host; rows past their sum, the dispatcher's sentinel rows, are left out)."""
    start = 0
    for index, rows in enumerate(counts):
        if rows:
            accumulate_matmul_(main_grad[index], grad[start:start + rows].t(), x[start:start + rows])
        start += rows


class HostCounts:
    """The experts' row counts on their way to the host for --moe-grouped-wgrad per-expert: a device
    tensor is copied into pinned host memory without waiting (`utils.HostCopy`: non-blocking, an
    event recorded after it) when the forward routes, and `read()` in backward waits for that copy
    only, which finished long before (the forward's other work queued after it); nothing stalls the
    GPU's queue (as Megatron-Core's all-to-all dispatcher copies its counts). Counts given as a list
    are read as they are; a CPU tensor's values are kept as they were (this micro-batch's, whatever
    follows). Read once, for both weights."""

    def __init__(self, counts):
        self._copy, self._list = (HostCopy(counts), None) if torch.is_tensor(counts) else (
            None, [int(count) for count in counts])

    def read(self) -> list:
        if self._list is None:
            self._list = self._copy.tolist()
        return self._list


def _looped_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_input = None
    if ctx.needs_input_grad[0]:
        grad_input = _looped_linear(grad, weight.transpose(1, 2), ctx.counts)
    if not ctx.needs_input_grad[1]:
        return grad_input, None, None, None, None, None, None
    pairs = list(zip(grad.split(ctx.counts), x.split(ctx.counts)))
    if ctx.accumulate is not None:
        for index, (rows_grad, rows) in enumerate(pairs):
            if rows.shape[0]:
                accumulate_matmul_(weight.main_grad[index], rows_grad.t(), rows)
        main_grad_accumulated(weight)
        return grad_input, None, None, None, None, None, None
    grad_weight = torch.empty_like(weight)
    for index, (rows_grad, rows) in enumerate(pairs):
        if rows.shape[0]:
            torch.mm(rows_grad.t(), rows, out=grad_weight[index])
        else:
            grad_weight[index].zero_()
    return grad_input, grad_weight, None, None, None, None, None


def _looped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
    """One GEMM per expert: rows of expert e times weight[e]^T."""
    pieces = [F.linear(rows, weight[index]) for index, rows in enumerate(x.split(tokens_per_expert))]
    if not pieces:
        return x.new_zeros((0, weight.shape[1]))
    return torch.cat(pieces)


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The end row of each expert's group, as `torch._grouped_mm` takes them, computed on the device."""
    return tokens_per_expert.cumsum(0).to(torch.int32)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert) -> torch.Tensor:
    return _ExpertsFunction.apply(x, weight, tokens_per_expert, True, None, False)


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    """Where PyTorch has a `torch._grouped_mm` for x: CUDA devices of compute capability 9.0 or later
    in bf16, and the CPU build (a reference kernel) in fp32 or bf16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def _grouped_mm_aligned(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """The kernel takes operands whose row strides are multiples of 16 bytes: the widths of x and of
    both weights' rows and columns."""
    widths = [x.shape[-1]] + [size for weight in weights for size in weight.shape[1:]]
    return all(width * x.element_size() % 16 == 0 for width in widths)


_GROUPED_OUT_DTYPES = {}


def _grouped_mm_writes(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this device's `torch._grouped_mm` writes `out_dtype` from x's dtype (CUDA writes fp32
    from bf16; the CPU build only its inputs' dtype). Tried once per device type and dtype pair."""
    if x.dtype == out_dtype:
        return True
    key = (x.device.type, x.dtype, out_dtype)
    if key not in _GROUPED_OUT_DTYPES:
        a = torch.zeros(16, 8, dtype=x.dtype, device=x.device)
        try:
            torch.ops.aten._grouped_mm(a.t(), a, offs=torch.tensor([8, 16], dtype=torch.int32, device=x.device),
                                       out_dtype=out_dtype)
            _GROUPED_OUT_DTYPES[key] = True
        except RuntimeError:
            _GROUPED_OUT_DTYPES[key] = False
    return _GROUPED_OUT_DTYPES[key]


def _row_experts(tokens_per_expert, num_rows: int, device) -> torch.Tensor:
    """The local expert of each row [N], computed on the device; sentinel rows past the counted ones
    get E_local (the zero row `_per_row` appends)."""
    counts = torch.as_tensor(tokens_per_expert, device=device)
    ends = counts.cumsum(0)
    return torch.searchsorted(ends, torch.arange(num_rows, device=device), right=True)


def _per_row(bias: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """[E_local, n] bias -> [N, n]: each row's expert's bias (zeros for sentinel rows)."""
    return torch.cat([bias, bias.new_zeros((1, bias.shape[-1]))]).index_select(0, row_expert)


def expert_param_names(global_name: str, param) -> list:
    """The layout-independent name of each local expert's tensor:
    decoder.layers.3.mlp.experts.fc1_weight -> decoder.layers.3.mlp.experts.{g}.fc1_weight."""
    prefix, _, leaf = global_name.rpartition(".")
    return [f"{prefix}.{param.expert_offset + index}.{leaf}" for index in range(param.shape[0])]


@torch.no_grad()
def initialize_expert_param(param, global_name: str, seed: int, std: float, num_layers: int) -> None:
    """Each local expert's slice from the full tensor generated for its global expert name."""
    layout = dataclasses.replace(param.tp_layout, dim=param.tp_layout.dim - 1)
    one_expert = types.SimpleNamespace(shape=param.shape[1:], tp_layout=layout, init=param.init)
    for index, name in enumerate(expert_param_names(global_name, param)):
        full = initial_values(one_expert, name, seed, std, num_layers, param.device)
        param[index].copy_(layout.full_to_local(full))


class SharedExpertMLP(torch.nn.Module):
    """Experts every token goes through (--moe-shared-expert-intermediate-size, their total hidden
    size): a dense MLP, tensor-parallel like the model's, optionally scaled by a per-token sigmoid
    gate sigmoid(x w_g) (Qwen2-MoE)."""

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp: TensorParallel = TensorParallel(), device):
        super().__init__()
        shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.mlp = MLP(shared, execution=execution, tp=tp, device=device)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=execution.params_dtype,
                                                              device=device))
            partial = execution.sequence_parallel and tp.size > 1
            set_layout(self.gate_weight, replicated_layout((1,), tp.size, tp.rank, partial), "normal")

    def forward(self, x):
        out = self.mlp(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(fc[12]_(?:weight|bias))$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(fc[12]_(?:weight|bias))$")


def split_experts(logical: dict) -> dict:
    """A logical state ({name: {part: full tensor}}) with each stacked expert tensor [E, ...] split
    into one entry per global expert index, as checkpoints store them."""
    out = {}
    for name, parts in logical.items():
        match = _STACKED.match(name)
        if match is None:
            out[name] = parts
            continue
        prefix, leaf = match.groups()
        for part, tensor in parts.items():
            for index in range(tensor.shape[0]):
                out.setdefault(f"{prefix}.{index}.{leaf}", {})[part] = tensor[index]
    return out


def stack_experts(logical: dict) -> dict:
    """The inverse of `split_experts`: per-expert entries stacked in expert order."""
    out, experts = {}, {}
    for name, parts in logical.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = parts
            continue
        prefix, index, leaf = match.groups()
        for part, tensor in parts.items():
            experts.setdefault((f"{prefix}.{leaf}", part), {})[int(index)] = tensor
    for (name, part), by_index in experts.items():
        out.setdefault(name, {})[part] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out
