"""FP8 training without Transformer Engine: the transformer layers' linears run their three GEMMs
(forward, input gradient, weight gradient) as `torch._scaled_mm` on float8 operands.

Formats (`--fp8-format`): `e4m3` quantizes everything to E4M3 (max 448, 3 mantissa bits); `hybrid`
keeps E4M3 for activations and weights and uses E5M2 (max 57344, 2 mantissa bits) for gradients.

Recipes (`--fp8-recipe`), i.e. how the scale that maps a tensor into the format's range is chosen:

- `tensorwise` (current scaling): one scale per tensor from that tensor's own amax.
- `delayed`: one scale per tensor from the amax history of earlier micro-batches
  (`--fp8-amax-history-len` entries, reduced by `--fp8-amax-compute-algo max|most_recent`). Each
  quantization records its amax; the history rolls once per training micro-batch, at the start of
  the model's forward (evaluation forwards neither record nor roll). A weight is quantized once per
  optimizer step, and its amax enters the history on every roll of that step, so `max` over a
  history shorter than the micro-batches of a step still sees it. Until the first roll (the first
  micro-batch) it scales like `tensorwise`.
- `rowwise`: one scale per row of each GEMM operand along the contracted dimension (per token for
  activations and gradients, per channel for weights), so a tensor is quantized once per GEMM it
  feeds, along that GEMM's axis. E4M3 only.

Every recipe divides the scale by 2^`--fp8-margin`. Weights are quantized once per optimizer step
(the cast and its transpose are cached and reused by every micro-batch until the weight changes).
With one scale per tensor (`tensorwise`, `delayed`) every tensor is quantized once: the forward
casts its input together with the input's transpose (one kernel when compiled) and keeps the FP8
transpose for the weight-gradient GEMM instead of the bf16 input, and the backward casts the output
gradient once, with its transpose, for both the input- and the weight-gradient GEMM. Compiled, a
delayed-scaling cast reads its bf16 tensor once (the scale is the history's; this cast's amax is
reduced in the casting loop), a current-scaling cast twice (amax, then cast). Under sequence
parallelism the input is kept as the local bf16 shard, re-gathered and cast in backward, as in bf16.
`rowwise` scales each GEMM operand along that GEMM's contracted axis, so a tensor feeding two GEMMs
is cast twice, and its input is kept in bf16.
The weight-gradient GEMM cannot accumulate into `main_grad`, but it can write into it: on a step's
first micro-batch (while `main_grad` holds nothing) `wgrad(..., out=main_grad)` writes its fp32
output there; later micro-batches add a product in the gradient's dtype (tensor_parallel.layers).
- `blockwise` (DeepSeek-V3's recipe): one scale per 1x128 tile of activations and gradients (along
  the contracted dimension of the GEMM each feeds, so, like `rowwise`, a tensor feeding two GEMMs
  is cast twice and the input is kept in bf16) and per 128x128 block of weights, through PyTorch's
  block-scaled GEMM (`torch.nn.functional.scaled_mm`, cuBLAS). E4M3 only; Hopper GPUs only (the
  kernel's), checked at start-up against the block-dequantized product (`blockwise_unavailable`).
Megatron's `mxfp8` recipe exists only as Transformer Engine kernels for Blackwell and is a named
error here.
"""
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

FORMATS = {
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),   # (activations and weights, gradients)
    "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
}
RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")
E4M3_ONLY = {"rowwise": "torch._scaled_mm's row-wise kernels", "blockwise": "cuBLAS's block-scaled kernels"}
NOT_BUILT = {
    "mxfp8": "MXFP8 exists only as Transformer Engine kernels for Blackwell GPUs",
}
BLOCK = 128  # blockwise: 1 x BLOCK tiles of activations and gradients, BLOCK x BLOCK weight blocks
INPUT, WEIGHT, GRAD = 0, 1, 2  # the three scaled tensors of a linear


@dataclass(frozen=True)
class FP8Options:
    format: str
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        check_fp8_options(self.format, self.recipe, self.margin, self.amax_history_len, self.amax_compute_algo)


def check_fp8_options(fp8_format: str, recipe: str, margin: int, amax_history_len: int, amax_compute_algo: str) -> None:
    """Raises ValueError, naming the flag and value, for settings that cannot run."""
    if fp8_format not in FORMATS:
        raise ValueError(f"`fp8` must be e4m3 or hybrid, got {fp8_format!r}")
    if recipe in NOT_BUILT:
        raise ValueError(f"--fp8-recipe {recipe} is not available without Transformer Engine ({NOT_BUILT[recipe]}); "
                         f"use --fp8-recipe delayed, tensorwise, rowwise or blockwise")
    if recipe not in RECIPES:
        raise ValueError(f"--fp8-recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if recipe in E4M3_ONLY and fp8_format != "e4m3":
        raise ValueError(f"--fp8-recipe {recipe} takes --fp8-format e4m3 ({E4M3_ONLY[recipe]} multiply E4M3 "
                         f"operands), got --fp8-format {fp8_format}")
    if margin < 0:
        raise ValueError(f"`fp8_margin` must be >= 0, got {margin}")
    if amax_history_len < 1:
        raise ValueError(f"`fp8_amax_history_len` must be >= 1, got {amax_history_len}")
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"`fp8_amax_compute_algo` must be max or most_recent, got {amax_compute_algo!r}")


# -- quantization ---------------------------------------------------------------------------------
def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """fp8_max / amax / 2^margin (fp32), 1 where amax is 0 or not finite."""
    amax = amax.float()
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, fp8_max(dtype) / torch.where(usable, amax, 1.0), 1.0) * (2.0 ** -margin)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range, cast to `dtype` (scale broadcasts: 0-d or per row)."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def cast_to_fp8(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype, margin: int,
                transpose: bool, cast=quantize):
    """One scale for the whole tensor: (x cast to `dtype`, its transpose made contiguous or None,
    the scale used, amax of x). `scale` None: from x's own amax (current scaling). Compiled, the
    amax, the cast and the transpose are one function (one kernel for the cast and the transpose)."""
    amax = amax_of(x)
    if scale is None:
        scale = scale_from_amax(amax, dtype, margin)
    q = cast(x, scale, dtype)
    return q, (q.t().contiguous() if transpose else None), scale, amax


@functools.lru_cache(maxsize=None)
def compiled_quantize():
    """`quantize` as one fused kernel per cast (GPU). Shape-dynamic: one graph serves every linear's
    operands, instead of one recompilation per shape."""
    return torch.compile(quantize, dynamic=True)


@functools.lru_cache(maxsize=None)
def compiled_cast_to_fp8():
    """`cast_to_fp8` compiled (GPU), shape-dynamic like `compiled_quantize`."""
    return torch.compile(cast_to_fp8, dynamic=True)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() / scale).to(dtype)


def amax_of(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """max |x| in fp32, over everything or along `dim` (kept)."""
    if dim is None:
        return torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=math.inf, dim=dim, keepdim=True, dtype=torch.float32)


def scaled_mm(a_q, b_q, a_scale, b_scale, out_dtype, *, out: Optional[torch.Tensor] = None):
    """a @ b from FP8 operands and the scales they were quantized with (a row-major, b column-major).
    `out`: a tensor of dtype `out_dtype` the product is written into (overwritten, not added to)."""
    if out is not None:
        return torch._scaled_mm(a_q, b_q, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                                out_dtype=out_dtype, out=out)
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                            out_dtype=out_dtype)


_DIRECT_OUTPUT = {}


def writes_into(out: torch.Tensor, rowwise: bool) -> bool:
    """Whether `_scaled_mm` can write its product straight into `out` (its dtype, e.g. the fp32
    `main_grad`) on this device: tensorwise scaling can on every backend; row-wise scaling into fp32
    only where cuBLAS has the kernel (Hopper, cuBLAS 12.9+; elsewhere only bf16 output). Probed once
    per device type, output dtype and scaling kind."""
    key = (out.device.type, out.dtype, rowwise)
    if key not in _DIRECT_OUTPUT:
        a = torch.ones(16, 16, device=out.device).to(torch.float8_e4m3fn)
        scale_a = torch.ones(16, 1, device=out.device) if rowwise else torch.ones((), device=out.device)
        scale_b = scale_a.t() if rowwise else scale_a
        try:
            probe = torch.empty(16, 16, device=out.device, dtype=out.dtype)
            scaled_mm(a, a.t(), scale_a, scale_b, out.dtype, out=probe)
            _DIRECT_OUTPUT[key] = bool(torch.all(probe == 16))
        except (RuntimeError, ValueError, NotImplementedError):
            _DIRECT_OUTPUT[key] = False
    return _DIRECT_OUTPUT[key]


def _column_major(q: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what `_scaled_mm` wants for its second operand)."""
    return q.t().contiguous().t()


# -- blockwise scaling -----------------------------------------------------------------------------
def quantize_blocks(x: torch.Tensor, rows: int, dtype: torch.dtype, margin: int = 0):
    """x [R, C] in blocks of `rows` x BLOCK (rows 1: tiles along C; BLOCK: square blocks), each
    scaled from its own amax: (fp8 [R, C], scale [R / rows, C / BLOCK] fp32)."""
    r, c = x.shape
    blocks = x.reshape(r // rows, rows, c // BLOCK, BLOCK)
    scale = scale_from_amax(blocks.abs().amax(dim=(1, 3)), dtype, margin)  # [R / rows, C / BLOCK]
    return quantize(blocks, scale[:, None, :, None], dtype).reshape(r, c), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The fp32 values `quantize_blocks` encoded (what the block-scaled GEMM multiplies)."""
    r, c = q.shape
    blocks = q.float().reshape(r // rows, rows, c // BLOCK, BLOCK) / scale[:, None, :, None]
    return blocks.reshape(r, c)


def blockwise_mm(a_q, a_scale, b_q, b_scale, b_rows: int, out_dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N]: a in 1 x BLOCK tiles along K (a_scale [M, K / BLOCK]), b in
    1 x BLOCK tiles (b_rows 1, b_scale [N, K / BLOCK]) or BLOCK x BLOCK blocks (b_rows BLOCK,
    b_scale [N / BLOCK, K / BLOCK]), as `quantize_blocks` made them, through PyTorch's block-scaled
    GEMM. The kernel takes the inverse scales stored outer-dimension-major (the transpose of a
    contiguous tensor), square blocks' with K / BLOCK padded to a multiple of 4, and b column-major."""
    kinds = F.ScalingType
    b_kind = kinds.BlockWise1x128 if b_rows == 1 else kinds.BlockWise128x128
    b_inverse = b_scale.reciprocal()
    if b_rows != 1:
        b_inverse = F.pad(b_inverse, (0, -b_inverse.shape[1] % 4))
    return F.scaled_mm(a_q, b_q.t(), _outer_dim_major(a_scale.reciprocal()), kinds.BlockWise1x128,
                       b_inverse.t() if b_rows != 1 else _outer_dim_major(b_inverse), b_kind,
                       output_dtype=out_dtype)


def _outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    return scale.t().contiguous().t()


_BLOCKWISE_CHECKED = {}


def has_block_scaled_gemm() -> bool:
    """Whether this PyTorch has the block-scaled GEMM (`torch.nn.functional.scaled_mm` with
    `ScalingType.BlockWise128x128`; PyTorch 2.13, the version this project is tested with, has)."""
    return hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise128x128")


def blockwise_unavailable(device: torch.device) -> Optional[str]:
    """Why `--fp8-recipe blockwise` cannot run on `device` (None: it can): the facts of this
    PyTorch and device, judged by `blockwise_refusal`. The GEMM's start-up check runs once per
    device type, on a Hopper GPU only."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gemm_error = None
    if has_block_scaled_gemm() and capability == (9, 0):
        if device.type not in _BLOCKWISE_CHECKED:
            _BLOCKWISE_CHECKED[device.type] = blockwise_gemm_error(device)
        gemm_error = _BLOCKWISE_CHECKED[device.type]
    return blockwise_refusal(has_block_scaled_gemm(), device.type, capability, gemm_error)


def blockwise_refusal(has_gemm: bool, device_type: str, capability: Optional[tuple],
                      gemm_error: Optional[str]) -> Optional[str]:
    """The reason blockwise scaling cannot run, naming what would run it, or None. cuBLAS has the
    block-scaled FP8 kernels for Hopper (compute capability 9.0) only."""
    if not has_gemm:
        return (f"PyTorch {torch.__version__} has no block-scaled GEMM (torch.nn.functional.scaled_mm with "
                f"ScalingType.BlockWise128x128); PyTorch 2.13 has it")
    if device_type != "cuda":
        return f"PyTorch's block-scaled FP8 GEMM runs on Hopper GPUs (compute capability 9.0), not on {device_type}"
    if capability != (9, 0):
        return (f"PyTorch's block-scaled FP8 GEMM (cuBLAS) runs on Hopper GPUs (compute capability 9.0); "
                f"this GPU is {capability[0]}.{capability[1]}")
    if gemm_error is not None:
        return f"PyTorch's block-scaled GEMM failed its start-up check on this GPU: {gemm_error}"
    return None


def blockwise_gemm_error(device: torch.device) -> Optional[str]:
    """Runs both block-scaled GEMM kinds (1x128 by 128x128, 1x128 by 1x128) on operands whose blocks
    have scales 2^0 to 2^7 apart, against the product of their block-dequantized values: None when
    they agree (a scale applied to the wrong block is off by a factor of up to 128), else what went
    wrong."""
    generator = torch.Generator(device=device).manual_seed(0)
    m, n, k = 256, 384, 512
    spread = 2.0 ** torch.randint(0, 8, (m, k // BLOCK), device=device, generator=generator)
    a = torch.randn(m, k, device=device, generator=generator) * spread.repeat_interleave(BLOCK, dim=1)
    b = torch.randn(n, k, device=device, generator=generator)
    a_q, a_scale = quantize_blocks(a, 1, torch.float8_e4m3fn)
    for rows in (BLOCK, 1):
        b_q, b_scale = quantize_blocks(b, rows, torch.float8_e4m3fn)
        want = dequantize_blocks(a_q, a_scale, 1) @ dequantize_blocks(b_q, b_scale, rows).t()
        try:
            got = blockwise_mm(a_q, a_scale, b_q, b_scale, rows, torch.float32)
        except (RuntimeError, ValueError, NotImplementedError) as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0]}"
        relative = ((got - want).norm() / want.norm()).item()
        if not relative <= 1e-3:  # FP8 tensor cores sum within a tile in reduced precision
            return f"{'1x128 by 128x128' if rows == BLOCK else '1x128 by 1x128'} off by {relative:.2g} (relative)"
    return None


# -- scaling state ----------------------------------------------------------------------------------
class DelayedScaling:
    """The amax history and scales of every FP8 tensor of one model chunk, as single tensors so the
    per-micro-batch update is a handful of kernels, not one per tensor."""

    def __init__(self, options: FP8Options):
        self.options = options
        self.num_slots = 0
        self.history = self.amax = self.scale = self.weight_amax = None
        self.ready = False      # a scale from history exists (after the first roll)
        self._recorded = False  # amaxes were recorded since the last roll
        self.recording = True   # False in evaluation forwards: they leave the history as it is

    def new_slots(self, count: int) -> int:
        first = self.num_slots
        self.num_slots += count
        return first

    def allocate(self, device) -> None:
        self.history = torch.zeros(self.options.amax_history_len, self.num_slots, device=device)
        self.amax = torch.zeros(self.num_slots, device=device)
        self.scale = torch.ones(self.num_slots, device=device)
        self.weight_amax = torch.zeros(self.num_slots, device=device)  # the cached weights' amaxes
        self.limits = torch.full((self.num_slots,), fp8_max(torch.float8_e4m3fn), device=device)

    def state_tensors(self) -> dict:
        """Everything a resumed run needs to scale exactly as this one would (checkpoints)."""
        return {"history": self.history, "amax": self.amax, "scale": self.scale, "weight_amax": self.weight_amax,
                "flags": torch.tensor([self.ready, self._recorded])}

    def load_state_tensors(self, tensors: dict) -> None:
        self.history = tensors["history"].to(self.history.device)
        self.amax = tensors["amax"].to(self.amax.device)
        self.scale = tensors["scale"].to(self.scale.device)
        if "weight_amax" in tensors:  # absent from checkpoints written before it was kept
            self.weight_amax = tensors["weight_amax"].to(self.weight_amax.device)
        self.ready, self._recorded = (bool(flag) for flag in tensors["flags"])

    def set_limit(self, slot: int, dtype: torch.dtype) -> None:
        self.limits[slot] = fp8_max(dtype)

    def record(self, slot: int, amax: torch.Tensor) -> None:
        if not self.recording:
            return
        current = self.amax.narrow(0, slot, 1)
        torch.maximum(current, amax.reshape(1), out=current)
        self._recorded = True

    def record_slots(self, slots: torch.Tensor, amaxes: torch.Tensor) -> None:
        """`record` for several distinct slots at once (slots [S] on the device, amaxes [S] fp32):
        one kernel where the experts' grouped casts have one amax per expert."""
        if not self.recording:
            return
        self.amax.scatter_reduce_(0, slots, amaxes, "amax")
        self._recorded = True

    def record_weight_slots(self, slots: torch.Tensor, amaxes: torch.Tensor) -> None:
        """`record_weight` for several distinct slots at once (slots [S] on the device, amaxes [S])."""
        self.weight_amax.index_copy_(0, slots, amaxes)
        self._recorded = self._recorded or self.recording

    def record_weight(self, slot: int, amax: torch.Tensor) -> None:
        """A weight's amax, at its one cast per optimizer step: it enters every roll until the
        weight is cast again (the cast is cached, so nothing else records it). Kept in evaluation
        too: a weight first cast by an evaluation forward is not cast again by training's."""
        self.weight_amax.narrow(0, slot, 1).copy_(amax.reshape(1))
        self._recorded = self._recorded or self.recording

    def roll(self) -> None:
        """Called once per training micro-batch (model forward): the amaxes recorded since the last
        call, and the cached weights' amaxes, become the newest history entry, and the scales are
        recomputed from the history."""
        if not self._recorded or not self.recording:
            return
        self.history = torch.roll(self.history, 1, dims=0)
        torch.maximum(self.amax, self.weight_amax, out=self.history[0])
        self.amax.zero_()
        if self.options.amax_compute_algo == "max":
            amax = self.history.amax(dim=0)
        else:
            amax = self.history[0]
        usable = (amax > 0) & torch.isfinite(amax)
        new_scale = self.limits / torch.where(usable, amax, 1.0) * (2.0 ** -self.options.margin)
        self.scale = torch.where(usable, new_scale, self.scale)
        self.ready = True
        self._recorded = False


class FP8Linear:
    """The GEMMs of one linear layer in FP8 (the `fp8` argument of `linear_with_grad_accumulation`).

    The linear layer calls `forward_keeping_input` (which also returns what backward keeps of the
    input), then in backward `quantize_grad` once, and `dgrad` and `wgrad` with its result. Called
    alone, `forward`, `dgrad` and `wgrad` cast what they are given."""

    def __init__(self, options: FP8Options, scaling: Optional[DelayedScaling], compiled: bool = False):
        self.options = options
        self.compiled = compiled
        self._cast = compiled_quantize() if compiled else quantize
        self.forward_dtype, self.grad_dtype = FORMATS[options.format]
        self.rowwise = options.recipe == "rowwise"
        self.blockwise = options.recipe == "blockwise"
        self.scaling = scaling if options.recipe == "delayed" else None
        if self.scaling is not None:
            self.first_slot = self.scaling.new_slots(3)
        self._weight_key = None
        self._weight = None

    def bind(self) -> None:
        """After the scaling state is allocated: records each slot's format limit."""
        if self.scaling is not None:
            for role, dtype in ((INPUT, self.forward_dtype), (WEIGHT, self.forward_dtype), (GRAD, self.grad_dtype)):
                self.scaling.set_limit(self.first_slot + role, dtype)

    def _cast_whole(self, x: torch.Tensor, role: int, dtype: torch.dtype, transpose: bool = False):
        """One scale for the whole tensor (tensorwise or delayed; records the amax for delayed):
        (fp8 tensor, its contiguous transpose or None, scale)."""
        scaling = self.scaling
        slot = None if scaling is None else self.first_slot + role
        scale = scaling.scale[slot] if scaling is not None and scaling.ready else None
        if self.compiled:
            q, q_t, scale, amax = compiled_cast_to_fp8()(x, scale, dtype, self.options.margin, transpose)
        else:
            q, q_t, scale, amax = cast_to_fp8(x, scale, dtype, self.options.margin, transpose, cast=self._cast)
        if scaling is not None:
            (scaling.record_weight if role == WEIGHT else scaling.record)(slot, amax)
        return q, q_t, scale

    def _tensor_scale(self, x: torch.Tensor, role: int, dtype: torch.dtype) -> torch.Tensor:
        """The scale `_cast_whole` would use for `x` (recording its amax, as a cast does)."""
        return self._cast_whole(x, role, dtype)[2]

    def _quantize_rowwise(self, x: torch.Tensor, dtype: torch.dtype, dim: int):
        """(fp8 tensor, scale per slice along `dim`)."""
        scale = scale_from_amax(amax_of(x, dim), dtype, self.options.margin)
        return self._cast(x, scale, dtype), scale

    def _weights(self, weight: torch.Tensor) -> dict:
        """The FP8 casts of `weight` for the forward and the input-gradient GEMM, made once per
        weight update (keyed by the parameter's storage and version counter)."""
        key = (weight.data_ptr(), weight._version)
        if key != self._weight_key:
            w = weight.detach()
            if self.blockwise:  # W [N, K] in 128x128 blocks; W^T's blocks are the same, transposed
                w_q, scale = quantize_blocks(w, BLOCK, self.forward_dtype, self.options.margin)
                self._weight = {"forward": (w_q, scale), "dgrad": (w_q.t().contiguous(), scale.t().contiguous())}
            elif self.rowwise:
                forward_q, forward_scale = self._quantize_rowwise(w, self.forward_dtype, dim=1)   # [N, 1]
                dgrad_q, dgrad_scale = self._quantize_rowwise(w, self.forward_dtype, dim=0)     # [1, K]
                self._weight = {"forward": (forward_q.t(), forward_scale.t()),
                                "dgrad": (_column_major(dgrad_q), dgrad_scale)}
            else:
                # W^T contiguous is W column-major: the input-gradient GEMM's second operand.
                w_q, w_t, scale = self._cast_whole(w, WEIGHT, self.forward_dtype, transpose=True)
                self._weight = {"forward": (w_q.t(), scale), "dgrad": (w_t.t(), scale)}
            self._weight_key = key
        return self._weight

    def writes_into(self, out: torch.Tensor) -> bool:
        """Whether `wgrad(..., out=out)` runs on this device (module function `writes_into`); the
        block-scaled GEMM has no output argument."""
        return not self.blockwise and writes_into(out, self.rowwise)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype."""
        return self.forward_keeping_input(x, weight, keep_input=False)[0]

    def forward_keeping_input(self, x: torch.Tensor, weight: torch.Tensor, keep_input: bool):
        """As `forward`, returning (output, kept): `kept` is what `wgrad` needs of the input, its FP8
        transpose and scale (a tuple of tensors), or None where backward must bring the bf16 input
        (rowwise, blockwise, or `keep_input` False)."""
        x2d = x.reshape(-1, x.shape[-1])
        kept = None
        if self.blockwise:  # [T, K] in 1x128 tiles along K; the weight in 128x128 blocks
            x_q, x_scale = quantize_blocks(x2d, 1, self.forward_dtype, self.options.margin)
            w_q, w_scale = self._weights(weight)["forward"]
            y = blockwise_mm(x_q, x_scale, w_q, w_scale, BLOCK, x.dtype)
            return y.view(*x.shape[:-1], y.shape[-1]), None
        if self.rowwise:
            x_q, x_scale = self._quantize_rowwise(x2d, self.forward_dtype, dim=1)
        else:
            x_q, x_t, x_scale = self._cast_whole(x2d, INPUT, self.forward_dtype, transpose=keep_input)
            kept = (x_t, x_scale) if keep_input else None
        w_q, w_scale = self._weights(weight)["forward"]
        y = scaled_mm(x_q, w_q, x_scale, w_scale, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1]), kept

    def quantize_grad(self, grad: torch.Tensor, transpose: bool = True):
        """The output gradient [..., N], cast once for both gradient GEMMs: (fp8 [T, N], its
        transpose [N, T] or None, scale, dtype, shape). Rowwise casts per GEMM, so it keeps `grad`."""
        grad2d = grad.reshape(-1, grad.shape[-1])
        if self.rowwise or self.blockwise:
            return grad2d, None, None, grad.dtype, grad.shape
        g_q, g_t, scale = self._cast_whole(grad2d, GRAD, self.grad_dtype, transpose=transpose)
        return g_q, g_t, scale, grad.dtype, grad.shape

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor, grad_fp8: Optional[tuple] = None) -> torch.Tensor:
        """grad [..., N] @ weight [N, K] -> [..., K]; `grad_fp8`: grad as `quantize_grad` cast it."""
        if grad_fp8 is None:
            grad_fp8 = self.quantize_grad(grad, transpose=False)
        g_q, _, g_scale, dtype, shape = grad_fp8
        if self.blockwise:  # grad [T, N] in 1x128 tiles along N; W^T [K, N] in 128x128 blocks
            g_q, g_scale = quantize_blocks(g_q, 1, self.grad_dtype, self.options.margin)
            w_t, w_t_scale = self._weights(weight)["dgrad"]
            out = blockwise_mm(g_q, g_scale, w_t, w_t_scale, BLOCK, dtype)
            return out.view(*shape[:-1], out.shape[-1])
        if self.rowwise:
            g_q, g_scale = self._quantize_rowwise(g_q, self.grad_dtype, dim=1)
        w_q, w_scale = self._weights(weight)["dgrad"]
        out = scaled_mm(g_q, w_q, g_scale, w_scale, dtype)
        return out.view(*shape[:-1], out.shape[-1])

    def wgrad(self, grad2d: torch.Tensor, input2d: Optional[torch.Tensor], grad_fp8: Optional[tuple] = None,
              kept: Optional[tuple] = None, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """grad^T [N, T] @ input [T, K] -> [N, K] in the gradient's dtype, or written into `out`
        [N, K] in its dtype (overwriting it; see `writes_into`). `grad_fp8`: grad as `quantize_grad`
        cast it; the input as `forward_keeping_input` kept it, else `input2d`."""
        if grad_fp8 is None:
            grad_fp8 = self.quantize_grad(grad2d)
        g_q, g_t, g_scale, dtype, _ = grad_fp8
        dtype = out.dtype if out is not None else dtype
        if self.blockwise:  # grad^T [N, T] and input^T [K, T], each in 1x128 tiles along the tokens T
            g_q, g_scale = quantize_blocks(g_q.t().contiguous(), 1, self.grad_dtype, self.options.margin)
            x_q, x_scale = quantize_blocks(input2d.t().contiguous(), 1, self.forward_dtype, self.options.margin)
            return blockwise_mm(g_q, g_scale, x_q, x_scale, 1, dtype)
        if self.rowwise:
            g_q, g_scale = self._quantize_rowwise(g_q, self.grad_dtype, dim=0)        # [1, N]
            x_q, x_scale = self._quantize_rowwise(input2d, self.forward_dtype, dim=0)  # [1, K]
            return scaled_mm(g_q.t().contiguous(), _column_major(x_q), g_scale.t(), x_scale, dtype, out=out)
        if kept is None:
            _, x_t, x_scale = self._cast_whole(input2d, INPUT, self.forward_dtype, transpose=True)
        else:
            x_t, x_scale = kept
        return scaled_mm(g_t, x_t.t(), g_scale, x_scale, dtype, out=out)


# -- which linears run in FP8, by a start-up measurement ---------------------------------------------
def choose_fp8_linears(chunks: list, tokens: int, device, time_linear=None) -> str:
    """Leaves in bf16 the FP8 linears of `chunks` whose GEMMs the start-up probe finds slower in FP8
    (forward, input and weight gradient, casts included, on `tokens` rows of this rank's weight
    shape), e.g. small attention projections; returns what it left, for the fast paths line ("" if
    nothing). Probed once per (linear, weight shape) on an accelerator; on the CPU every FP8 linear
    stays (its float8 GEMMs are emulated there: a timing would say nothing of a GPU).
    `time_linear(fp8_linear, weight_shape)` -> (bf16 seconds, fp8 seconds) replaces the timing (tests)."""
    if time_linear is None and device.type == "cpu":
        return ""
    if time_linear is None:
        def time_linear(fp8_linear, shape):
            return time_linear_gemms(fp8_linear, shape, tokens, device)
    kinds = {}  # (name, weight shape) -> the modules of that kind
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.fp8 is not None:
                kinds.setdefault((name.rsplit(".", 1)[-1], tuple(module.weight.shape)), []).append(module)
    left = []
    for (name, shape), modules in kinds.items():
        bf16_seconds, fp8_seconds = time_linear(modules[0].fp8, shape)
        if fp8_seconds >= bf16_seconds:
            for module in modules:
                module.fp8 = None
            left.append(f"{name} {shape[0]}x{shape[1]} ({fp8_seconds * 1e3:.2f} ms in FP8, "
                        f"{bf16_seconds * 1e3:.2f} in bf16)")
    return f"left in bf16 (slower in FP8 at start-up): {', '.join(left)}" if left else ""


def time_linear_gemms(fp8_linear: "FP8Linear", shape: tuple, tokens: int, device) -> tuple:
    """Median seconds of one linear's three GEMMs on [tokens, in] rows of weight `shape` [out, in]:
    (bf16, FP8 with its casts; the weight cast once, as per optimizer step)."""
    from megatron.core.transformer.attention import PROBE_REPEATS, PROBE_WARMUP, median_seconds

    out_features, in_features = shape
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    recipe = "tensorwise" if fp8_linear.options.recipe == "delayed" else fp8_linear.options.recipe
    linear = FP8Linear(FP8Options(fp8_linear.options.format, recipe), None, compiled=fp8_linear.compiled)

    def bf16_step():
        x @ weight.t(), grad @ weight, grad.t() @ x

    def fp8_step():
        _, kept = linear.forward_keeping_input(x, weight, keep_input=True)
        grad_fp8 = linear.quantize_grad(grad)
        linear.dgrad(grad, weight, grad_fp8)
        linear.wgrad(grad, x, grad_fp8, kept)

    return (median_seconds(bf16_step, device, PROBE_WARMUP, PROBE_REPEATS),
            median_seconds(fp8_step, device, PROBE_WARMUP, PROBE_REPEATS))


def fp8_layer_numbers(execution, num_layers: int) -> set:
    """Global numbers of the layers that run in FP8 (all, less --first-last-layers-bf16's)."""
    layers = set(range(num_layers))
    if execution.first_last_layers_bf16:
        start, end = execution.num_layers_at_start_in_bf16, execution.num_layers_at_end_in_bf16
        layers = {n for n in layers if start <= n < num_layers - end}
    return layers


def attach_fp8(decoder, config, num_layers: int, device) -> Optional[DelayedScaling]:
    """Gives every column/row-parallel linear of the FP8 layers of `decoder` an `FP8Linear` (the
    routed experts one per expert and weight);
    returns the chunk's delayed-scaling state (None for the other recipes, or no FP8 layer)."""
    options = FP8Options(config.fp8, config.fp8_recipe, config.fp8_margin, config.fp8_amax_history_len,
                         config.fp8_amax_compute_algo)
    if options.recipe == "blockwise" and (reason := blockwise_unavailable(torch.device(device))) is not None:
        raise ValueError(f"`fp8_recipe` blockwise cannot run here: {reason}; use `fp8_recipe` tensorwise, "
                         f"delayed or rowwise")
    scaling = DelayedScaling(options) if options.recipe == "delayed" else None
    fp8_layers = fp8_layer_numbers(config, num_layers)
    linears = []
    for number, layer in zip(decoder.layer_numbers, decoder.layers):
        if number not in fp8_layers:
            continue
        for module in layer.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.fp8 = FP8Linear(options, scaling, compiled=config.fuse_elementwise)
                linears.append(module.fp8)
            elif hasattr(module, "attach_fp8"):  # the routed experts: an FP8Linear per expert GEMM
                linears += module.attach_fp8(lambda: FP8Linear(options, scaling, compiled=config.fuse_elementwise))
    if scaling is None or scaling.num_slots == 0:
        return None
    scaling.allocate(device)
    for linear in linears:
        linear.bind()
    return scaling
