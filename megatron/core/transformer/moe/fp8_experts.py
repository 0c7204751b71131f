"""FP8 GEMMs for the routed experts, under --fp8-format / --fp8-recipe.

Megatron-Core runs its experts in FP8 through Transformer Engine's grouped linear, which keeps FP8
metadata per GEMM. Here likewise each local expert's GEMMs have their own scaling state: one
`FP8Linear` (transformer/fp8.py) per expert and stacked weight, with its own amax and scale for the
input, the weight and the output gradient. An expert's scales follow only the rows routed to it, so
expert parallelism leaves them unchanged (an expert sees the same rows on whichever rank holds it).

Rows are padded per expert with zeros to a multiple of `FP8_ALIGNMENT` (16) before the GEMMs and the
padding is removed after, as Megatron-Core's Fp8Padding / Fp8Unpadding do: FP8 GEMM kernels take
dimensions that are multiples of 16, and the weight gradient's contracted dimension is the
expert's row count. Zero rows change no amax and no real row's result. Counts that are multiples
of 16 already (as with balanced routing at usual sizes) are not copied.

Each expert keeps the dense FP8 linear's properties: the forward keeps the input's FP8 transpose for
the weight gradient (tensorwise, delayed), the output gradient is cast once for both gradient GEMMs,
an expert's weight is cast once per optimizer step (cached on the parameter's version), and
evaluation forwards do not roll the amax history (the chunk's `DelayedScaling`, shared with the
dense layers).

The GEMMs run as one `torch._scaled_grouped_mm` per GEMM where it exists (an NVIDIA GPU of compute
capability 9.0, H100/H200; bf16 activations; one scale per expert and tensor, i.e. tensorwise or
delayed), with each expert's scale given per row (and per output column of its weight): E4M3
operands only, so under `hybrid` (E5M2 gradients) the two gradient GEMMs run as one bf16 grouped
GEMM of the casts widened to bf16, the dequantizing factors folded into one operand
(`_bf16_grouped_mm_of_casts`; an fp32 grouped GEMM on the GPU is PyTorch's slow fallback, which
reads the offsets back), unless --moe-grouped-wgrad per-expert: then both gradient GEMMs are one
`torch._scaled_mm` per expert on the same casts (cuBLAS multiplies E5M2 by E4M3 at the FP8 rate),
the counts copied to the host without waiting in forward (`_per_expert_gradients`; with
`bf16_accumulation`, which --moe-grouped-wgrad auto sets where it times faster, the weight gradients
of a step's later micro-batches are bf16 GEMMs of the widened casts accumulating into main_grad
instead of FP8 products added to it). Elsewhere, and
for rowwise, all three GEMMs loop over the experts that received rows, each with its `FP8Linear`.

Under --moe-router-padding-for-fp8 the dispatcher pads the routing instead of these rows: every
expert's count is a multiple of 16 already, so the counts stay on the device and the tensorwise and
delayed recipes take the grouped path everywhere, with no host read (the row of each expert, its
scale and the GEMM offsets computed on the device). Where no FP8 grouped GEMM exists (the CPU), it
runs as `torch._grouped_mm` on the dequantized casts: the same FP8 values and scales, products
exact in fp32 (an E4M3 x E4M3 product has 8 significant bits), sums in fp32 as the kernel's, so
only the order of the fp32 additions and the output's rounding differ from the GPU's.
"""
import itertools

import torch

from megatron.core.tensor_parallel.layers import accumulate_matmul_, main_grad_accumulated, main_grad_empty
from megatron.core.transformer.moe import triton_experts
from megatron.core.transformer.fp8 import GRAD, INPUT, WEIGHT, quantize, scale_from_amax
from megatron.core.utils import compiled

FP8_ALIGNMENT = 16  # rows per expert are padded to a multiple of this (Megatron-Core's FP8 alignment)


def padded_counts(tokens_per_expert: list, multiple: int = FP8_ALIGNMENT) -> list:
    """Each expert's row count rounded up to `multiple` (an expert with no rows keeps none)."""
    return [-(-count // multiple) * multiple for count in tokens_per_expert]


def real_rows(tokens_per_expert: list, padded: list, device) -> torch.Tensor:
    """Indices, in the padded row layout, of the real rows (each expert's first `count` rows)."""
    total = sum(tokens_per_expert)  # output sizes known on the host: no device sync
    starts = torch.tensor([0] + padded[:-1], device=device).cumsum(0)
    counts = torch.tensor(tokens_per_expert, device=device)
    first = torch.repeat_interleave(starts, counts, output_size=total)
    within = torch.arange(total, device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                          output_size=total)
    return first + within


def pad_rows(x: torch.Tensor, rows: torch.Tensor, num_padded: int) -> torch.Tensor:
    """x [N, k] -> [num_padded, k] with x's rows at `rows`, zeros elsewhere."""
    return x.new_zeros((num_padded, x.shape[-1])).index_copy(0, rows, x)


class _ExpertsFP8Function(torch.autograd.Function):
    """y = per expert e, rows_e @ weight[e]^T, every GEMM in FP8 with expert e's `FP8Linear`."""

    @staticmethod
    def forward(ctx, x, weight, counts, linears, fuse_wgrad):
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
        ctx.counts, ctx.linears, ctx.fuse_wgrad = counts, linears, fuse_wgrad
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        wgrad = ctx.needs_input_grad[1]
        fused = wgrad and ctx.fuse_wgrad
        # Fused: each expert's weight gradient goes into its slice of the fp32 main_grad, written by
        # the GEMM itself while nothing is accumulated there yet this step, else added.
        write_into = fused and main_grad_empty(weight) and ctx.linears[0].writes_into(weight.main_grad)
        grad_weight = torch.zeros_like(weight) if wgrad and not fused else None
        grad_inputs, position = [], 0
        for index, rows_grad in enumerate(grad.split(ctx.counts)):
            if rows_grad.shape[0] == 0:
                grad_inputs.append(rows_grad.new_empty((0, weight.shape[2])))
                continue
            linear = ctx.linears[index]
            # The output gradient cast once, for both GEMMs.
            grad_fp8 = linear.quantize_grad(rows_grad, transpose=wgrad)
            grad_inputs.append(linear.dgrad(rows_grad, weight[index], grad_fp8))
            if linear.rowwise:
                expert_kept, input_rows = None, kept[position]
                position += 1
            else:
                expert_kept, input_rows = tuple(kept[position:position + 2]), None
                position += 2
            if write_into:
                linear.wgrad(rows_grad, input_rows, grad_fp8, expert_kept, out=weight.main_grad[index])
            elif fused:
                weight.main_grad[index].add_(linear.wgrad(rows_grad, input_rows, grad_fp8, expert_kept))
            elif wgrad:
                grad_weight[index] = linear.wgrad(rows_grad, input_rows, grad_fp8, expert_kept)
        if fused:
            main_grad_accumulated(weight)
        grad_input = torch.cat(grad_inputs) if ctx.needs_input_grad[0] else None
        return grad_input, grad_weight, None, None, None


def grouped_fp8_supported(x: torch.Tensor, rowwise: bool) -> bool:
    """Whether `torch._scaled_grouped_mm` runs here: CUDA compute capability 9.x, bf16 output, one
    scale per expert (its row-wise scales then carry each expert's scale)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and not rowwise and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def _scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm with dequantizing scales (one per row of a, one per column of b per
    group; b 2-D: groups along the contracted dimension, scales group-major), bf16 output. A
    function of its own so the CPU tests can stand in for the kernel."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def widen_scaled(a: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """An FP8 cast times its dequantizing factors (broadcast), in fp32, rounded to bf16 once.
    Compiled (`ExpertsFP8.widen`): one kernel reading one byte and writing two per element."""
    return (a.float() * factor).to(torch.bfloat16)


def _grouped_gemm(kernel: bool, a, b, scale_a, scale_b, offs, out_dtype, widen=widen_scaled):
    """The FP8 grouped GEMM: the kernel (`kernel`, bf16 output); where it has none, on a GPU that runs
    bf16 grouped GEMMs `_bf16_grouped_mm_of_casts` (`widen`: its widening of the scaled operand,
    `widen_scaled` or that compiled), elsewhere (the CPU) `_dequantized_grouped_mm`."""
    if kernel:
        return _scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    if _bf16_grouped_mm_runs(a, b):
        return _bf16_grouped_mm_of_casts(a, b, scale_a, scale_b, offs, out_dtype, widen)
    return _dequantized_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)


def _bf16_grouped_mm_runs(a, b) -> bool:
    """Whether the GPU's bf16 grouped GEMM takes the casts widened to bf16 (compute capability 9.0+,
    `_bf16_grouped_layout` for both; the widened copies keep the casts' layouts). An fp32
    `torch._grouped_mm` on the GPU is PyTorch's fallback: a loop of fp32 GEMMs after reading the
    offsets back, which `_dequantized_grouped_mm` would hit there."""
    return _grouped_mm_on_gpu(a) and _bf16_grouped_layout(a) and _bf16_grouped_layout(b)


def _grouped_mm_on_gpu(a) -> bool:
    return a.is_cuda and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(a.device)[0] >= 9


def _bf16_grouped_layout(t) -> bool:
    """Whether a bf16 tensor of t's sizes and strides is an operand `torch._grouped_mm` takes: in its
    last two dimensions row-major or column-major (a transposed view: the weight gradient's
    gradient operand), the other stride a multiple of 16 bytes (8 elements) and not overlapping."""
    (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
    return ((col_stride == 1 and row_stride % 8 == 0 and row_stride >= max(1, cols))
            or (row_stride == 1 and col_stride % 8 == 0 and col_stride >= max(1, rows)))


def _bf16_grouped_mm_of_casts(a, b, scale_a, scale_b, offs, out_dtype, widen=widen_scaled):
    """The FP8 grouped GEMM (same arguments as `_dequantized_grouped_mm`, one scale per expert and
    tensor: tensorwise and delayed) as one bf16 `torch._grouped_mm`: b widened to bf16 (exactly:
    every E4M3 and E5M2 value is a bf16 value), a widened with each row's (b 3-D) or each contracted
    index's (b 2-D) whole dequantizing factor folded in, in fp32 then rounded to bf16 once; fp32
    sums, one rounding of the output. Nothing is read back."""
    if b.dim() == 3:                               # a [N, k], b [E, k, n], scale_a [N], scale_b [E, n]
        group = _row_groups(offs, a.shape[0])      # sentinel rows: group E, factor 0 (scale_a is 0 there too)
        factor = scale_a * _with_sentinel(scale_b[:, 0]).index_select(0, group)
        a16 = widen(a, factor.unsqueeze(1))
    else:                                          # a [m, N], b [N, n], scale_a [E*m], scale_b [E*n]
        num_groups = offs.numel()
        per_group = scale_a.view(num_groups, -1)[:, 0] * scale_b.view(num_groups, -1)[:, 0]
        factor = _with_sentinel(per_group).index_select(0, _row_groups(offs, a.shape[1]))   # [N]
        a16 = widen(a, factor.unsqueeze(0))
    return torch._grouped_mm(a16, b.to(torch.bfloat16), offs=offs).to(out_dtype)


def _dequantized_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """The FP8 grouped GEMM's arithmetic where it has no kernel (the CPU): the FP8 operands times their
    scales in fp32 (exact products of the same FP8 values), one fp32 `torch._grouped_mm`, one rounding
    to `out_dtype`. Groups come from `offs` on the device: nothing is read back."""
    if b.dim() == 3:                               # a [N, k], b [E, k, n], scale_a [N], scale_b [E, n]
        a32 = a.float() * scale_a.view(-1, 1)
        b32 = b.float() * scale_b.unsqueeze(1)
    else:                                          # a [m, N], b [N, n], scale_a [E*m], scale_b [E*n]
        num_groups = offs.numel()
        group = _row_groups(offs, a.shape[1])      # [N] the group of each contracted index
        a32 = a.float() * _with_sentinel(scale_a.view(num_groups, -1)).index_select(0, group).t()
        b32 = b.float() * _with_sentinel(scale_b.view(num_groups, -1)).index_select(0, group)
    return torch._grouped_mm(a32, b32, offs=offs).to(out_dtype)


def _row_groups(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The group of each of `num_rows` rows [N] from the groups' end offsets (on the device); rows
    past the last offset get the sentinel group len(offs)."""
    return torch.searchsorted(offs, torch.arange(num_rows, device=offs.device, dtype=offs.dtype), right=True)


def _with_sentinel(per_group: torch.Tensor) -> torch.Tensor:
    """[E, ...] -> [E + 1, ...]: a zero entry for the sentinel group (rows left out of the GEMMs)."""
    return torch.cat([per_group, per_group.new_zeros((1, *per_group.shape[1:]))])


def _expert_amaxes(x: torch.Tensor, row_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """max |x| over each expert's rows [E] (fp32; 0 for an expert without rows). One segment
    reduction on the device; sentinel rows (`row_expert` E) land in a bin that is dropped."""
    row_amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, dtype=torch.float32)
    return row_amax.new_zeros(num_experts + 1).scatter_reduce(0, row_expert, row_amax, "amax")[:num_experts]


def quantize_rows(x: torch.Tensor, scales: torch.Tensor, row_expert: torch.Tensor, dtype) -> torch.Tensor:
    """x [N, k] cast to FP8 in one kernel, each row with its expert's scale (`scales` [E]; sentinel
    rows get scale 0, i.e. FP8 zeros)."""
    return quantize(x, _with_sentinel(scales).index_select(0, row_expert).unsqueeze(1), dtype)


class ExpertsFP8:
    """The FP8 GEMMs of one stacked expert weight [E, n, k]: an `FP8Linear` per expert (its scaling
    state; the loop path runs through it), and the grouped path's cached weight casts."""

    def __init__(self, linears: list):
        self.linears = linears
        first = linears[0]
        self.options, self.scaling, self.rowwise = first.options, first.scaling, first.rowwise
        self.forward_dtype, self.grad_dtype = first.forward_dtype, first.grad_dtype
        # The casts of all experts' rows and the widening of hybrid's E5M2 casts, each one kernel when
        # compiled (as the dense FP8 linears' casts: the elementwise fusions), else a few fp32 passes.
        fuse = getattr(first, "compiled", False)
        self.quantize_rows = compiled(quantize_rows, None) if fuse else quantize_rows
        self.widen = compiled(widen_scaled, None) if fuse else widen_scaled
        self._weight_key = self._weight = None
        self._slots = {}  # role -> the experts' slots in the delayed-scaling state, as a device tensor
        # Per expert (`host_counts`), once main_grad holds this step's sum: the weight gradient as a
        # bf16 GEMM of the widened casts accumulating into main_grad (set by --moe-grouped-wgrad auto
        # where it times faster, moe/wgrad_choice.py), instead of an FP8 product added to it.
        self.bf16_accumulation = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts, accumulate=None,
                 triton_wgrad: bool = False, host_counts=None) -> torch.Tensor:
        """x [N, k] (rows sorted by expert, `counts` each, every count a multiple of FP8_ALIGNMENT)
        times weight [E, n, k] per expert -> [N, n] in x's dtype. `counts`: a list, or a device
        tensor [E] (routing padded; rows past their sum are sentinel rows, left out of the GEMMs):
        then the grouped path, whose GEMMs run as the FP8 grouped kernel or, where none exists, on
        the dequantized casts. `accumulate` (--gradient-accumulation-fusion): the weight gradient goes
        into `weight.main_grad` here, the grouped product through `accumulate(main_grad, product,
        counts)` (experts.accumulate_expert_grads_), the loop's per expert; with `triton_wgrad`
        (--moe-grouped-wgrad triton, where it runs) the grouped path's by the Triton kernel, which
        adds into `main_grad` from the casts themselves (moe/triton_experts.py); with `host_counts`
        (--moe-grouped-wgrad per-expert: the counts on their way to the host, `experts.HostCounts`)
        both gradient GEMMs by `torch._scaled_mm` per expert (`_per_expert_gradients`)."""
        per_expert = host_counts if accumulate is not None else None
        if torch.is_tensor(counts):
            return _GroupedExpertsFP8Function.apply(x, weight, counts, self, accumulate, triton_wgrad, per_expert)
        if grouped_fp8_supported(x, self.rowwise):
            return _GroupedExpertsFP8Function.apply(x, weight, list(counts), self, accumulate, triton_wgrad,
                                                    per_expert)
        return _ExpertsFP8Function.apply(x, weight, list(counts), self.linears, accumulate is not None)

    def scales(self, amaxes: torch.Tensor, role: int, dtype: torch.dtype) -> torch.Tensor:
        """Each expert's scale [E] for `role` (recording the amaxes under delayed scaling)."""
        if self.scaling is None:
            return scale_from_amax(amaxes, dtype, self.options.margin)
        if role not in self._slots:
            self._slots[role] = torch.tensor([linear.first_slot + role for linear in self.linears],
                                             device=amaxes.device)
        slots = self._slots[role]
        # All experts' amaxes recorded in one kernel (not one per expert).
        (self.scaling.record_weight_slots if role == WEIGHT else self.scaling.record_slots)(slots, amaxes)
        if not self.scaling.ready:
            return scale_from_amax(amaxes, dtype, self.options.margin)
        return self.scaling.scale[slots]

    def weights(self, weight: torch.Tensor):
        """(forward operand [E, k, n] and input-gradient operand [E, n, k], both column-major FP8,
        the experts' scales [E]), cast once per weight update."""
        key = (weight.data_ptr(), weight._version)
        if key != self._weight_key:
            w = weight.detach()
            amaxes = torch.linalg.vector_norm(w, ord=float("inf"), dim=(1, 2), dtype=torch.float32)
            scale = self.scales(amaxes, WEIGHT, self.forward_dtype)
            w_q = quantize(w, scale.view(-1, 1, 1), self.forward_dtype)                 # [E, n, k]
            self._weight = (w_q.transpose(1, 2), w_q.transpose(1, 2).contiguous().transpose(1, 2), scale)
            self._weight_key = key
        return self._weight


class _GroupedExpertsFP8Function(torch.autograd.Function):
    """The experts' three GEMMs as grouped FP8 GEMMs, each tensor cast once for all experts (one
    kernel, each row scaled by its expert's scale)."""

    @staticmethod
    def forward(ctx, x, weight, counts, fp8, accumulate, triton_wgrad=False, host_counts=None):
        num_experts = weight.shape[0]
        counts_t = torch.as_tensor(counts, device=x.device)                          # [E]
        offs = counts_t.cumsum(0).to(torch.int32)
        row_expert = _row_groups(offs, x.shape[0])                                    # [N], E: sentinel
        x_scale = fp8.scales(_expert_amaxes(x, row_expert, num_experts), INPUT, fp8.forward_dtype)
        x_q = fp8.quantize_rows(x, x_scale, row_expert, fp8.forward_dtype)            # [N, k]
        w_forward, _, w_scale = fp8.weights(weight)
        out_features = weight.shape[1]
        # Row counts given as a list: this path runs only where the kernel does (`__call__`).
        kernel = not torch.is_tensor(counts) or grouped_fp8_supported(x, fp8.rowwise)
        x_row_scale = _with_sentinel(x_scale.reciprocal()).index_select(0, row_expert)   # [N]
        y = _grouped_gemm(kernel, x_q, w_forward, x_row_scale,
                          w_scale.reciprocal().unsqueeze(1).expand(-1, out_features).contiguous(), offs, x.dtype)
        # The input's FP8 transpose [k, N] is what the grouped weight-gradient GEMM needs of it; the
        # Triton kernel, which adds into main_grad, takes the cast [N, k] itself.
        ctx.triton = (accumulate is not None and triton_wgrad
                      and triton_experts.supported(x_q, x_q, weight.main_grad))
        # Per expert (`host_counts`): the transpose with a leading dimension of a 16-byte multiple,
        # so that each expert's columns are an operand `torch._scaled_mm` takes.
        ctx.host_counts = host_counts   # (given with `accumulate` only: `ExpertsFP8.__call__`)
        if ctx.triton:
            x_kept = x_q
        else:
            x_kept = aligned_transpose(x_q) if host_counts is not None else x_q.t().contiguous()
        ctx.save_for_backward(x_kept, x_scale, weight, row_expert, offs)
        ctx.counts, ctx.fp8, ctx.kernel, ctx.accumulate = counts, fp8, kernel, accumulate
        return y

    @staticmethod
    def backward(ctx, grad):
        x_kept, x_scale, weight, row_expert, offs = ctx.saved_tensors
        fp8, counts = ctx.fp8, ctx.counts
        num_experts, out_features, in_features = weight.shape
        grad = grad.contiguous()
        g_scale = fp8.scales(_expert_amaxes(grad, row_expert, num_experts), GRAD, fp8.grad_dtype)
        g_q = fp8.quantize_rows(grad, g_scale, row_expert, fp8.grad_dtype)            # [N, n], cast once
        _, w_dgrad, w_scale = fp8.weights(weight)
        if ctx.host_counts is not None:
            grad_input = _per_expert_gradients(weight, g_q, g_scale, x_kept, x_scale, w_dgrad, w_scale,
                                               ctx.host_counts.read(), fp8, grad.dtype, row_expert)
            return grad_input, None, None, None, None, None, None
        # The grouped kernel multiplies E4M3 operands only: under `hybrid` (E5M2 gradients) both
        # gradient GEMMs run as a bf16 grouped GEMM of the widened casts on the GPU, as the fp32 one
        # on the CPU (`_grouped_gemm`: the same FP8 values and scales; no host read). (Per expert,
        # above, the transposes' leading dimensions are padded: an expert's columns of an unpadded
        # [n, N] transpose were refused by cuBLAS on an H200 when N was no multiple of 16.)
        # With the Triton kernels (--moe-grouped-wgrad triton) the input gradient the grouped kernel
        # cannot take runs as Triton's row-grouped FP8 GEMM instead: E5M2 times E4M3 at the FP8 rate.
        kernel = ctx.kernel and fp8.grad_dtype == fp8.forward_dtype
        g_row_scale = _with_sentinel(g_scale.reciprocal()).index_select(0, row_expert)          # [N]
        if ctx.triton and not kernel:
            row_factor = g_row_scale * _with_sentinel(w_scale.reciprocal()).index_select(0, row_expert)
            grad_input = triton_experts.fp8_grouped_rows_mm(g_q, w_dgrad, row_factor, offs, grad.dtype)
        else:
            grad_input = _grouped_gemm(kernel, g_q, w_dgrad, g_row_scale,
                                       w_scale.reciprocal().unsqueeze(1).expand(-1, in_features).contiguous(),
                                       offs, grad.dtype, fp8.widen)
        if ctx.triton:  # into main_grad from the casts [N, n] and [N, k], each expert's sum dequantized
            triton_experts.accumulate_grouped_wgrad_(weight.main_grad, g_q, x_kept, offs,
                                                          (g_scale * x_scale).reciprocal())
            main_grad_accumulated(weight)
            return grad_input, None, None, None, None, None, None
        # Weight gradient: groups along the contracted (row) dimension, scales group-major.
        # The kernel takes the gradient's transpose [n, N] row-major; the widening reads it as a view.
        g_t = g_q.t().contiguous() if kernel else g_q.t()                             # [n, N]
        grad_weight = _grouped_gemm(kernel, g_t, x_kept.t(), g_scale.reciprocal().repeat_interleave(out_features),
                                    x_scale.reciprocal().repeat_interleave(in_features), offs, grad.dtype,
                                    fp8.widen)
        counts_t = torch.as_tensor(counts, device=grad.device)
        if ctx.accumulate is None:
            return grad_input, grad_weight.masked_fill_(counts_t.eq(0).view(-1, 1, 1), 0), None, None, None, None, None
        ctx.accumulate(weight.main_grad, grad_weight, counts_t)
        main_grad_accumulated(weight)
        return grad_input, None, None, None, None, None, None


def _widened_for_accumulation(g_q, factors, row_expert, x_t, widen):
    """The weight gradient's operands for `fp8.bf16_accumulation`: the output gradient's cast g_q [N, n]
    widened to bf16 with each row's expert's whole dequantizing factor (`factors` [E]: 1 / (g_scale
    x_scale); sentinel rows 0) folded in, in fp32 and rounded to bf16 once (as the grouped path's
    `_bf16_grouped_mm_of_casts`), and the input's transpose x_t [k, N] (FP8) widened exactly (every
    E4M3 and E5M2 value is a bf16 value), kept with its 16-element leading dimension. Two kernels, each
    reading one byte and writing two per element (`widen`: `widen_scaled`, compiled where the casts
    are)."""
    factor = _with_sentinel(factors).index_select(0, row_expert).unsqueeze(1)        # [N, 1]
    g16 = widen(g_q, factor)                                                         # [N, n]
    rows, cols = x_t.shape
    x16 = x_t.new_empty((rows, x_t.stride(0)), dtype=torch.bfloat16)[:, :cols].copy_(x_t)   # [k, N]
    return g16, x16


def aligned_transpose(q: torch.Tensor) -> torch.Tensor:
    """q [N, k] -> its transpose [k, N] stored row-major with a leading dimension rounded up to 16
    elements (FP8: 16 bytes), so that any columns [s, s + r) with s a multiple of 16 are a row-major
    operand `torch._scaled_mm` takes (cuBLAS wants 16-byte aligned leading dimensions)."""
    rows, cols = q.shape
    padded = -(-rows // FP8_ALIGNMENT) * FP8_ALIGNMENT
    return q.new_empty((cols, padded))[:, :rows].copy_(q.t())


def _per_expert_gradients(weight, g_q, g_scale, x_t, x_scale, w_dgrad, w_scale, counts: list, fp8, dtype,
                          row_expert):
    """--moe-grouped-wgrad per-expert under FP8: for each expert e with rows (`counts` read on the host,
    each a multiple of 16 on padded routing), its input gradient g_e @ W_e into its rows of the
    result and its weight gradient g_e^T @ x_e into main_grad[e], each one `torch._scaled_mm` of the
    casts as they are (one scale per expert and tensor): on the GPU cuBLAS multiplies E5M2 by E4M3
    (hybrid) at the FP8 rate, which `torch._scaled_grouped_mm` (E4M3 only) cannot. The weight
    gradient is written into fp32 main_grad by the GEMM while nothing is accumulated there yet this
    step (where `_scaled_mm` writes fp32). Later, `_scaled_mm` having no accumulating output, its
    product in the compute dtype is added (12 bytes per weight element: the product written and
    read, main_grad read and written), or, with `fp8.bf16_accumulation`, the same casts widened to
    bf16 (`_widened_for_accumulation`) are multiplied by one GEMM per expert that adds into main_grad
    itself (`accumulate_matmul_`: cuBLAS, fp32 output, beta = 1), at the bf16 rate but with no pass
    over main_grad, which can be cheaper when an expert gets few rows (the start-up probe decides). Returns the input gradient [N, k]
    (the dispatcher's sentinel rows past the counted ones zero)."""
    num_rows, in_features = g_q.shape[0], w_dgrad.shape[2]
    grad_input = g_q.new_empty((num_rows, in_features), dtype=dtype)
    g_inv, w_inv, x_inv = g_scale.reciprocal(), w_scale.reciprocal(), x_scale.reciprocal()
    main_grad = weight.main_grad
    write_into = main_grad_empty(weight) and fp8.linears[0].writes_into(main_grad)
    widened = not write_into and fp8.bf16_accumulation
    if widened:
        g16, x16 = _widened_for_accumulation(g_q, g_inv * x_inv, row_expert, x_t, fp8.widen)   # [N, n], [k, N]
    else:
        g_t = aligned_transpose(g_q)                                                 # [n, N]
    ends = list(itertools.accumulate(counts))
    for index, (start, end) in enumerate(zip([0] + ends, ends)):
        if start == end:
            continue
        torch._scaled_mm(g_q[start:end], w_dgrad[index], scale_a=g_inv[index], scale_b=w_inv[index],
                         out_dtype=dtype, out=grad_input[start:end])
        if widened:                                                                  # [n, r] @ [r, k]
            accumulate_matmul_(main_grad[index], g16[start:end].t(), x16[:, start:end].t())
            continue
        a, b = g_t[:, start:end], x_t[:, start:end].t()                             # [n, r], [r, k]
        if write_into:
            torch._scaled_mm(a, b, scale_a=g_inv[index], scale_b=x_inv[index], out_dtype=main_grad.dtype,
                             out=main_grad[index])
        else:
            main_grad[index].add_(torch._scaled_mm(a, b, scale_a=g_inv[index], scale_b=x_inv[index],
                                                   out_dtype=dtype))
    grad_input[sum(counts):].zero_()
    main_grad_accumulated(weight)
    return grad_input
