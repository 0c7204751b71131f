"""The routed experts of one rank, their weights stored stacked, and the shared experts.

GroupedMLP holds this rank's `num_local_experts` experts as stacked tensors, each expert an MLP with
the model's activation (SwiGLU or GeLU):

    linear_fc1.weight [E_local, ffn/etp (x2 when gated: gate then up), h]
    linear_fc2.weight [E_local, h, ffn/etp]

Tokens arrive sorted by expert (`tokens_per_expert` rows each). With --moe-grouped-gemm on a GPU
that has `torch._grouped_mm` (bf16, compute capability 9.0+) the experts run as two grouped GEMMs;
elsewhere as a loop of GEMMs over the experts, the same arithmetic. Either way each expert's
weight gradient accumulates straight into the fp32 `main_grad` that data parallelism attaches, one
GEMM per expert, as the dense linears' do (--gradient-accumulation-fusion): no stacked gradient in
the weights' dtype is written, read back and added by the data-parallel hook. Under FP8
(`attach_fp8`) the experts' GEMMs run in FP8, each expert with its own scaling state, on rows padded
per expert to a multiple of 16 (moe/fp8_experts.py). Expert-tensor parallelism splits the expert
hidden size as the dense MLP's TP does (fc2's partial sums are added by the dispatcher).

Initialization is per global expert index (`initialize_expert_param`), so an expert starts from the
same weights whatever the expert-parallel layout.
"""
import dataclasses
import re
import types

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import (
    Part,
    TPLayout,
    accumulate_matmul_,
    fuses_grad_accumulation,
    initial_values,
    main_grad_ready,
    replicated_layout,
    set_layout,
)
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.mlp import _ACTIVATIONS, MLP
from megatron.core.transformer.moe.fp8_experts import ExpertsFP8, pad_rows, padded_counts, real_rows
from megatron.core.utils import divide


class GroupedMLP(torch.nn.Module):
    def __init__(self, config, *, execution=DEFAULT_EXECUTION, num_local_experts: int, expert_offset: int,
                 etp_size: int, etp_rank: int, tp_size: int, tp_rank: int, device):
        super().__init__()
        self.gated = config.swiglu
        self.activation = _ACTIVATIONS[config.activation]
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset  # global index of local expert 0
        self.grouped_gemm = config.moe_grouped_gemm
        self.gradient_accumulation_fusion = execution.gradient_accumulation_fusion
        self.fp8 = None  # {"fc1": ExpertsFP8, "fc2": ExpertsFP8}, set by `attach_fp8`
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        local_ffn = divide(ffn, etp_size, "--moe-ffn-hidden-size by --expert-tensor-parallel-size")
        dtype = execution.params_dtype
        rows = 2 * local_ffn if self.gated else local_ffn
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, rows, hidden, dtype=dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, local_ffn, dtype=dtype,
                                                         device=device))
        self.fc1_bias = self.fc2_bias = None
        if config.add_bias_linear:
            self.fc1_bias = torch.nn.Parameter(torch.empty(num_local_experts, rows, dtype=dtype, device=device))
            self.fc2_bias = torch.nn.Parameter(torch.empty(num_local_experts, hidden, dtype=dtype, device=device))
        self.add_fc2_bias = etp_rank == 0  # fc2's outputs are partial sums over etp: add its bias once
        # Layouts of the stacked tensors (dim 0 is the expert) over the expert-tensor-parallel ranks:
        # the hidden size split like the dense MLP's. With etp = 1 an expert is whole on every rank
        # that holds it, and the gradients of its copies are summed over the expert-data-parallel
        # group (which then includes the TP ranks); fc2's bias is added on etp rank 0 only, so its
        # gradient is summed over the etp ranks.
        if etp_size > 1 and etp_size != tp_size:
            raise ValueError(f"--expert-tensor-parallel-size ({etp_size}) must be 1 or "
                             f"--tensor-model-parallel-size ({tp_size})")
        fc1_parts = ((Part("gate", ffn, etp_size), Part("up", ffn, etp_size)) if self.gated
                     else (Part("", ffn, etp_size),))
        layouts = {
            "fc1_weight": TPLayout(1, fc1_parts, etp_size, etp_rank),
            "fc2_weight": TPLayout(2, (Part("", ffn, etp_size),), etp_size, etp_rank),
            "fc1_bias": TPLayout(1, fc1_parts, etp_size, etp_rank),
            "fc2_bias": TPLayout(1, (Part("", hidden, 1, etp_size > 1),), etp_size, etp_rank),
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

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list, probs: torch.Tensor) -> torch.Tensor:
        """tokens [N, h] sorted by local expert, probs [N] -> probs-weighted expert outputs [N, h]
        (partial sums over expert-tensor-parallel ranks)."""
        counts = padded_counts(tokens_per_expert) if self.fp8 is not None else tokens_per_expert
        if counts != list(tokens_per_expert):
            # FP8: rows per expert padded to its alignment, the padding dropped again at the end.
            rows = real_rows(tokens_per_expert, counts, tokens.device)
            out = self._mlp(pad_rows(tokens, rows, sum(counts)), counts).index_select(0, rows)
        else:
            out = self._mlp(tokens, tokens_per_expert)
        return out * probs.unsqueeze(-1).to(out.dtype)

    def _mlp(self, tokens: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
        h = self._linear(tokens, "fc1", tokens_per_expert)
        if self.fc1_bias is not None:
            h = h + _per_token(self.fc1_bias, tokens_per_expert)
        out = self._linear(self._activate(h), "fc2", tokens_per_expert)
        if self.fc2_bias is not None and self.add_fc2_bias:
            out = out + _per_token(self.fc2_bias, tokens_per_expert)
        return out

    def _linear(self, x: torch.Tensor, name: str, tokens_per_expert: list) -> torch.Tensor:
        weight = self.fc1_weight if name == "fc1" else self.fc2_weight
        fuse_wgrad = fuses_grad_accumulation(weight, self.gradient_accumulation_fusion)
        if self.fp8 is not None:
            return self.fp8[name](x, weight, tokens_per_expert, fuse_wgrad)
        grouped = self.grouped_gemm and _grouped_mm_supported(x)
        if grouped and not fuse_wgrad:
            return _grouped_linear(x, weight, tokens_per_expert)
        return _ExpertsFunction.apply(x, weight, list(tokens_per_expert), grouped, fuse_wgrad)

    def _activate(self, h):
        if not self.gated:
            return self.activation(h)
        gate, up = h.chunk(2, dim=-1)
        return self.activation(gate) * up


class _ExpertsFunction(torch.autograd.Function):
    """Per expert e, rows_e @ weight[e]^T: one grouped GEMM (`grouped`) or a loop of GEMMs.
    Backward: the input gradient rows_grad_e @ weight[e] (grouped or looped likewise), and the
    weight gradient rows_grad_e^T rows_e either accumulated into `weight.main_grad[e]` (`fuse_wgrad`:
    one GEMM per expert into the fp32 buffer where the device has one with an fp32 output, as
    Transformer Engine's grouped linear accumulates per GEMM; the data-parallel hook is then told
    once) or returned stacked [E, n, k] (the loop only: unfused grouped GEMMs run under autograd).
    """

    @staticmethod
    def forward(ctx, x, weight, counts, grouped, fuse_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.grouped, ctx.fuse_wgrad = counts, grouped, fuse_wgrad
        return _grouped_linear(x, weight, counts) if grouped else _looped_linear(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_input = None
        if ctx.needs_input_grad[0] and ctx.grouped:
            grad_input = torch._grouped_mm(grad, weight, offs=_offsets(ctx.counts, grad.device))
        elif ctx.needs_input_grad[0]:
            grad_input = _looped_linear(grad, weight.transpose(1, 2), ctx.counts)
        if not ctx.needs_input_grad[1]:
            return grad_input, None, None, None, None
        pairs = list(zip(grad.split(ctx.counts), x.split(ctx.counts)))
        if ctx.fuse_wgrad:
            for index, (rows_grad, rows) in enumerate(pairs):
                if rows.shape[0]:
                    accumulate_matmul_(weight.main_grad[index], rows_grad.t(), rows)
            weight.main_grad_empty = False
            main_grad_ready(weight)
            return grad_input, None, None, None, None
        grad_weight = torch.empty_like(weight)
        for index, (rows_grad, rows) in enumerate(pairs):
            if rows.shape[0]:
                torch.mm(rows_grad.t(), rows, out=grad_weight[index])
            else:
                grad_weight[index].zero_()
        return grad_input, grad_weight, None, None, None


def _looped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
    """One GEMM per expert: rows of expert e times weight[e]^T."""
    pieces = [F.linear(rows, weight[index]) for index, rows in enumerate(x.split(tokens_per_expert))]
    if not pieces:
        return x.new_zeros((0, weight.shape[1]))
    return torch.cat(pieces)


def _offsets(tokens_per_expert: list, device) -> torch.Tensor:
    """The end row of each expert's group, as `torch._grouped_mm` takes them."""
    return torch.tensor(tokens_per_expert, device=device).cumsum(0).to(torch.int32)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=_offsets(tokens_per_expert, x.device))


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def _per_token(bias: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
    """[E_local, n] bias -> [N, n]: each token's expert's bias."""
    counts = torch.tensor(tokens_per_expert, device=bias.device)
    return bias.repeat_interleave(counts, dim=0)


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

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp_group, tp_size: int, tp_rank: int, device):
        super().__init__()
        shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.mlp = MLP(shared, execution=execution, tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank,
                       device=device)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=execution.params_dtype,
                                                              device=device))
            partial = execution.sequence_parallel and tp_size > 1
            set_layout(self.gate_weight, replicated_layout((1,), tp_size, tp_rank, partial), "normal")

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
