"""The experts' gradient GEMMs that PyTorch has no grouped kernel for, in Triton.

1. The weight gradient accumulated into `main_grad` by the GEMM itself (`accumulate_grouped_wgrad_`).

For each local expert e, whose rows of the permuted tokens end at `ends[e]` (a device tensor):

    main_grad[e] += grad[rows of e]^T @ x[rows of e]          [n, k], fp32 accumulation

`torch._grouped_mm` has no accumulating form: its path writes the product [E, n, k] and a second
pass adds it into `main_grad` (16 bytes per expert weight element and micro-batch with an fp32
product, `accumulate_expert_grads_`). Here each output tile sums its expert's rows in fp32
registers and adds them to `main_grad` where it stores them: 8 bytes per element (`main_grad` read
and written), no product tensor, and an expert without rows leaves its `main_grad` untouched (its
tiles skip the load and store). The offsets are read on the device: no host synchronization.

FP8 experts (--moe-router-padding-for-fp8, tensorwise or delayed) pass their casts as they are, the
gradient's [N, n] and the input's [N, k] (E4M3, or E5M2 gradients under `hybrid`), with each
expert's dequantizing factor 1 / (grad scale x input scale): the kernel reads one byte per element,
widens each tile to fp16 in registers (exactly), sums the products in fp32 and scales once per tile.
Neither the transposes the FP8 grouped GEMM needs, nor widened copies, nor the bf16 product is made.

2. FP8 `hybrid`'s input gradient (`fp8_grouped_rows_mm`): E5M2 gradient rows times each row's
   expert's E4M3 weight cast, which `torch._scaled_grouped_mm` (E4M3 only) cannot multiply (tiles
   widened to fp16 in registers, as above). Row
   tiles never span two experts: each expert's rows are cut into tiles of BLOCK_M, the tiles of all
   experts numbered on the device (`_row_tiles`, a few operators on [E] and on the tile count's
   bound N / BLOCK_M + E), so a program finds its expert and first row with two loads; the
   products are summed in fp32 and each row scaled by its dequantizing factor once. Rows past the
   experts' (the dispatcher's sentinel rows) are not written, as `torch._grouped_mm` leaves them.

Selected by --moe-grouped-wgrad triton (CUDA, Triton installed); the CPU tests run the same kernels
under Triton's interpreter (TRITON_INTERPRET=1).
"""
import functools
import importlib.util

import torch

# Tiles (bench/bench_moe_kernels.py on an H200, 2026-11-28: of six, this one was the fastest at
# every MoE preset's shape, 7-24% ahead of 128 x 128 x 64 rows with 8 warps and 3 stages).
BLOCK_N, BLOCK_K, BLOCK_ROWS = 128, 128, 32  # output tile [BLOCK_N, BLOCK_K]; rows summed per step
WGRAD_WARPS, WGRAD_STAGES = 4, 5
ROWS_BLOCK_M, ROWS_BLOCK_N, ROWS_BLOCK_K = 128, 128, 64  # the row-grouped GEMM's tile and its K step
NUM_WARPS, NUM_STAGES = 8, 3                             # the row-grouped GEMM's
# FP8 operands are widened in registers, tile by tile, before the tensor-core product: to fp16 on the
# GPU (every E4M3 and E5M2 value is an fp16 value, so the products are exact and summed in fp32; an
# FP8 product of E5M2 x E4M3 tiles ran 4x slower than bf16 there and Hopper's FP8 accumulator drops
# low bits), to fp32 under the interpreter (which multiplies 16-bit tiles wrongly).
AS_IS, TO_FP16, TO_FP32 = 0, 1, 2


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def supported(grad: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: a CUDA device (or Triton's CPU interpreter), inputs
    of one 16-bit or fp32 dtype, or both FP8 (E4M3/E5M2, on compute capability 8.9+), with unit
    column stride, and a contiguous fp32 `main_grad`."""
    import os

    if not ((grad.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available()):
        return False
    wide = grad.dtype == x.dtype and grad.dtype in (torch.bfloat16, torch.float16, torch.float32)
    fp8 = grad.dtype in FP8_DTYPES and x.dtype in FP8_DTYPES and (
        not grad.is_cuda or torch.cuda.get_device_capability(grad.device) >= (8, 9))
    return ((wide or fp8) and main_grad.dtype == torch.float32 and main_grad.is_contiguous()
            and grad.stride(-1) == 1 and x.stride(-1) == 1)


def accumulate_grouped_wgrad_(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor,
                              ends: torch.Tensor, scales=None) -> None:
    """main_grad [E, n, k] (fp32) += per expert e, scales[e] x grad[rows_e]^T @ x[rows_e]; grad [N, n]
    and x [N, k] sorted by expert, expert e's rows ending at ends[e] (int32 [E], on the device; rows
    past ends[-1] are left out); `scales` [E] fp32 (FP8's dequantizing factors) or None. One kernel
    launch."""
    num_experts, n, k = main_grad.shape
    if num_experts == 0 or n == 0 or k == 0:
        return
    if not grad.is_cuda and grad.dtype == torch.bfloat16:
        # Triton's interpreter (the CPU) multiplies bf16 tiles wrongly: widen them there (the same
        # products, exactly; the GPU kernel takes bf16 as it is).
        grad, x = grad.float(), x.float()
    kernel = _kernels()[0]
    grid = (triton_cdiv(n, BLOCK_N) * triton_cdiv(k, BLOCK_K), num_experts)
    scaled = scales is not None
    widen = _widening(grad)
    kernel[grid](grad, x, main_grad, ends, scales if scaled else ends, n, k, grad.stride(0), x.stride(0),
                 BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_ROWS=BLOCK_ROWS,
                 IEEE=grad.dtype == torch.float32 or widen == TO_FP32, SCALED=scaled, WIDEN=widen,
                 num_warps=WGRAD_WARPS, num_stages=WGRAD_STAGES)


def _widening(operand: torch.Tensor) -> int:
    """How the kernels widen this operand's tiles before the product (FP8: see TO_FP16)."""
    if operand.dtype not in FP8_DTYPES:
        return AS_IS
    return TO_FP16 if operand.is_cuda else TO_FP32


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_grouped_rows_mm(a: torch.Tensor, b: torch.Tensor, row_scale: torch.Tensor, ends: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """a [N, k] (FP8, rows sorted by expert, expert e's ending at ends[e]) times b [E, k, n] (FP8, any
    strides) per row's expert, each row scaled by `row_scale` [N] (fp32) -> [N, n] in `out_dtype`;
    rows past ends[-1] are not written. One kernel launch, nothing read back."""
    num_rows, k = a.shape
    num_experts, _, n = b.shape
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)
    if num_rows == 0 or n == 0 or num_experts == 0:
        return out
    tile_expert, tile_row = _row_tiles(ends, num_rows)
    grid = (tile_expert.numel(), triton_cdiv(n, ROWS_BLOCK_N))
    _kernels()[1][grid](a, b, out, row_scale, ends, tile_expert, tile_row, num_experts, n, k,
                        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
                        BLOCK_M=ROWS_BLOCK_M, BLOCK_N=ROWS_BLOCK_N, BLOCK_K=ROWS_BLOCK_K, WIDEN=_widening(a),
                        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _row_tiles(ends: torch.Tensor, num_rows: int) -> tuple:
    """For the row tiles of all experts (each expert's rows cut into tiles of ROWS_BLOCK_M, numbered
    expert after expert): each tile's expert and first row, [bound] int32 each, on the device; tiles
    past the last get expert E (their programs return). bound = N / BLOCK_M + E rounded up, the most
    tiles any split of N rows over E experts needs."""
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + ROWS_BLOCK_M - 1) // ROWS_BLOCK_M                  # [E]
    tile_ends = tiles.cumsum(0)
    bound = triton_cdiv(num_rows, ROWS_BLOCK_M) + ends.numel()
    index = torch.arange(bound, device=ends.device)
    expert = torch.searchsorted(tile_ends, index, right=True)                  # [bound], E past the last
    safe = expert.clamp(max=ends.numel() - 1)
    first_tile = tile_ends[safe] - tiles[safe]
    row = starts[safe] + (index - first_tile) * ROWS_BLOCK_M
    return expert.to(torch.int32), row.to(torch.int32)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The jitted kernels (Triton imported on first use: the CPU build of PyTorch runs without it):
    the weight gradient's, the row-grouped GEMM's."""
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_wgrad_accumulate(grad_ptr, x_ptr, out_ptr, ends_ptr, scales_ptr, n, k, stride_grad, stride_x,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                 IEEE: tl.constexpr, SCALED: tl.constexpr, WIDEN: tl.constexpr):
        tile = tl.program_id(0)
        expert = tl.program_id(1)
        tiles_k = (k + BLOCK_K - 1) // BLOCK_K  # (not tl.cdiv: a jit function, which the interpreter
        # runs only when Triton was imported with TRITON_INTERPRET set)
        tile_n, tile_k = tile // tiles_k, tile % tiles_k
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        end = tl.load(ends_ptr + expert).to(tl.int64)
        if end > start:
            cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
            in_n, in_k = cols_n < n, cols_k < k
            acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)  # (tl.zeros: a jit function, as tl.cdiv)
            for first in range(start, end, BLOCK_ROWS):
                rows = first + tl.arange(0, BLOCK_ROWS)
                live = rows < end
                g = tl.load(grad_ptr + rows[:, None] * stride_grad + cols_n[None, :],
                            mask=live[:, None] & in_n[None, :], other=0.0)          # [rows, BLOCK_N]
                a = tl.load(x_ptr + rows[:, None] * stride_x + cols_k[None, :],
                            mask=live[:, None] & in_k[None, :], other=0.0)          # [rows, BLOCK_K]
                if WIDEN == 1:
                    g, a = g.to(tl.float16), a.to(tl.float16)
                elif WIDEN == 2:
                    g, a = g.to(tl.float32), a.to(tl.float32)
                if IEEE:
                    acc += tl.dot(tl.trans(g), a, input_precision="ieee")
                else:
                    acc += tl.dot(tl.trans(g), a)
            if SCALED:
                acc = acc * tl.load(scales_ptr + expert)
            tile_base = out_ptr + expert.to(tl.int64) * n * k
            out = tile_base + cols_n[:, None].to(tl.int64) * k + cols_k[None, :]
            inside = in_n[:, None] & in_k[None, :]
            tl.store(out, tl.load(out, mask=inside, other=0.0) + acc, mask=inside)

    @triton.jit
    def grouped_rows_mm(a_ptr, b_ptr, out_ptr, scale_ptr, ends_ptr, tile_expert_ptr, tile_row_ptr, num_experts,
                        n, k, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        WIDEN: tl.constexpr):
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        if expert < num_experts:
            first = tl.load(tile_row_ptr + tile).to(tl.int64)
            end = tl.load(ends_ptr + expert).to(tl.int64)
            rows = first + tl.arange(0, BLOCK_M)
            live = rows < end
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_n = cols < n
            b_base = b_ptr + expert.to(tl.int64) * stride_be
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, k, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                in_k = ks < k
                a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                            mask=live[:, None] & in_k[None, :], other=0.0)             # [BLOCK_M, BLOCK_K]
                b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                            mask=in_k[:, None] & in_n[None, :], other=0.0)            # [BLOCK_K, BLOCK_N]
                if WIDEN == 1:
                    acc += tl.dot(a.to(tl.float16), b.to(tl.float16))
                elif WIDEN == 2:
                    acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
            scale = tl.load(scale_ptr + rows, mask=live, other=0.0)
            acc = acc * scale[:, None]
            out = out_ptr + rows[:, None] * n + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & in_n[None, :])

    return grouped_wgrad_accumulate, grouped_rows_mm
