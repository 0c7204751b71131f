"""FP8 GEMMs for the routed experts, under --fp8-format / --fp8-recipe.

Megatron-Core runs its experts in FP8 through Transformer Engine's grouped linear, which keeps FP8
metadata per GEMM. Here likewise each local expert's GEMMs have their own scaling state: one
`FP8Linear` (transformer/fp8.py) per expert and stacked weight, with its own amax and scale for the
input, the weight and the output gradient. An expert's scales follow only the rows routed to it, so
expert parallelism leaves them unchanged (an expert sees the same rows on whichever rank holds it).

Rows are padded per expert with zeros to a multiple of `FP8_ALIGNMENT` (16) before the GEMMs and the
padding is removed after, as Megatron-Core's Fp8Padding / Fp8Unpadding do: FP8 GEMM kernels take
dimensions that are multiples of 16, and the weight gradient's contracted dimension is the
expert's row count. Zero rows change no amax and no real row's result.

Each expert keeps the dense FP8 linear's properties: the forward keeps the input's FP8 transpose for
the weight gradient (tensorwise, delayed), the output gradient is cast once for both gradient GEMMs,
an expert's weight is cast once per optimizer step (cached on the parameter's version), and
evaluation forwards do not roll the amax history (the chunk's `DelayedScaling`, shared with the
dense layers). The GEMMs run as a loop of `torch._scaled_mm` over the experts that received rows.
"""
import torch

FP8_ALIGNMENT = 16  # rows per expert are padded to a multiple of this (Megatron-Core's FP8 alignment)


def padded_counts(tokens_per_expert: list, multiple: int = FP8_ALIGNMENT) -> list:
    """Each expert's row count rounded up to `multiple` (an expert with no rows keeps none)."""
    return [-(-count // multiple) * multiple for count in tokens_per_expert]


def real_rows(tokens_per_expert: list, padded: list, device) -> torch.Tensor:
    """Indices, in the padded row layout, of the real rows (each expert's first `count` rows)."""
    starts = torch.tensor([0] + padded[:-1], device=device).cumsum(0)
    counts = torch.tensor(tokens_per_expert, device=device)
    first = torch.repeat_interleave(starts, counts)
    within = torch.arange(int(counts.sum()), device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return first + within


def pad_rows(x: torch.Tensor, rows: torch.Tensor, num_padded: int) -> torch.Tensor:
    """x [N, k] -> [num_padded, k] with x's rows at `rows`, zeros elsewhere."""
    return x.new_zeros((num_padded, x.shape[-1])).index_copy(0, rows, x)


class _ExpertsFP8Function(torch.autograd.Function):
    """y = per expert e, rows_e @ weight[e]^T, every GEMM in FP8 with expert e's `FP8Linear`."""

    @staticmethod
    def forward(ctx, x, weight, counts, linears):
        outputs, kept = [], []
        for index, rows in enumerate(x.split(counts)):
            if rows.shape[0] == 0:
                outputs.append(rows.new_empty((0, weight.shape[1])))
                continue
            y, expert_kept = linears[index].forward_keeping_input(rows, weight[index], keep_input=True)
            outputs.append(y)
            kept.extend(expert_kept if expert_kept is not None else (rows,))
        # Rowwise keeps the input rows themselves (it casts per GEMM axis); the other recipes keep
        # each expert's FP8 transpose and its scale.
        ctx.save_for_backward(weight, *kept)
        ctx.counts, ctx.linears = counts, linears
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_inputs, position = [], 0
        for index, rows_grad in enumerate(grad.split(ctx.counts)):
            if rows_grad.shape[0] == 0:
                grad_inputs.append(rows_grad.new_empty((0, weight.shape[2])))
                continue
            linear = ctx.linears[index]
            # The output gradient cast once, for both GEMMs.
            grad_fp8 = linear.quantize_grad(rows_grad, transpose=grad_weight is not None)
            grad_inputs.append(linear.dgrad(rows_grad, weight[index], grad_fp8))
            if linear.rowwise:
                expert_kept, input_rows = None, kept[position]
                position += 1
            else:
                expert_kept, input_rows = tuple(kept[position:position + 2]), None
                position += 2
            if grad_weight is not None:
                grad_weight[index] = linear.wgrad(rows_grad, input_rows, grad_fp8, expert_kept)
        grad_input = torch.cat(grad_inputs) if ctx.needs_input_grad[0] else None
        return grad_input, grad_weight, None, None


def experts_linear_fp8(x: torch.Tensor, weight: torch.Tensor, counts: list, linears: list) -> torch.Tensor:
    """x [N, k] (rows sorted by expert, `counts` each, every count a multiple of FP8_ALIGNMENT) times
    weight [E, n, k] per expert -> [N, n] in x's dtype."""
    return _ExpertsFP8Function.apply(x, weight, list(counts), linears)
