"""The operand rules of the GPU's FP8 GEMMs, checked on the CPU.

The CPU's `torch._scaled_mm` multiplies whatever it is given; CUDA's (cuBLASLt on Hopper) and
`torch._scaled_grouped_mm` (CUTLASS, no CPU kernel) refuse operands the CPU takes, and such a refusal
is found only on a GPU, after its start-up, where a run costs minutes. These are those rules, so the
CPU tests of every FP8 path can hold the operands they pass to them:

`torch._scaled_mm(a [M, K], b [K, N], scale_a, scale_b, out_dtype, out=)`:
- a and b float8 and not both E5M2; a row-major, b column-major (cuBLASLt's only FP8 layout, "TN");
- K and N multiples of 16 (PyTorch's own checks);
- every matrix's leading dimension and start address 16-byte aligned (cuBLASLt: an FP8 operand's
  columns sliced from a wider matrix whose rows are not 16-byte multiples are refused);
- scales fp32: one each (tensorwise), or [M, 1] and [1, N] (row-wise: both operands E4M3, bf16
  output unless written into fp32 where cuBLAS has that kernel);
- `out` row-major [M, N] of `out_dtype`, 16-byte aligned.

`torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)` on Hopper:
- both operands E4M3; a row-major, b column-major (its last two dimensions); strides and start
  addresses 16-byte aligned; K and N multiples of 16;
- `offs` int32, one end offset per group, non-decreasing; each group along a contracted dimension
  (a and b both 2-D: the weight gradient) a multiple of 16 long;
- scales fp32 and contiguous: a 2-D and b 3-D (groups of a's rows): scale_a [M], scale_b [G, N];
  both 2-D: scale_a [G * M], scale_b [G * N]; bf16 output.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ALIGN = 16  # bytes


def _row_major(t) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _column_major(t) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def _aligned(t, name: str, leading: int) -> list:
    problems = []
    if t.data_ptr() % ALIGN:
        problems.append(f"{name} starts {t.data_ptr() % ALIGN} bytes past a 16-byte boundary")
    if (leading * t.element_size()) % ALIGN:
        problems.append(f"{name}'s leading dimension ({leading} elements of {t.element_size()} bytes) "
                        f"is no multiple of 16 bytes")
    return problems


def _operand_layouts(a, b) -> list:
    """a row-major and b column-major (in their last two dimensions), each aligned."""
    if not _row_major(a):
        problems = [f"a must be row-major, got strides {a.stride()} for {tuple(a.shape)}"]
    else:
        problems = _aligned(a, "a", a.stride(-2))
    if not _column_major(b):
        problems.append(f"b must be column-major, got strides {b.stride()} for {tuple(b.shape)}")
    else:
        problems += _aligned(b, "b", b.stride(-1))
    return problems


def scaled_mm_problems(a, b, scale_a, scale_b, out_dtype=None, out=None) -> list:
    """What CUDA's `torch._scaled_mm` would refuse in these arguments ([] if nothing)."""
    problems = []
    if a.dim() != 2 or b.dim() != 2:
        return [f"operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}"]
    if a.dtype not in FP8 or b.dtype not in FP8:
        problems.append(f"operands must be float8, got {a.dtype} and {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("two E5M2 operands (cuBLAS multiplies E5M2 only by E4M3)")
    (m, k), n = a.shape, b.shape[1]
    if 0 in (m, k, n):
        return problems
    problems += _operand_layouts(a, b)
    if k % 16 or n % 16:
        problems.append(f"K ({k}) and N ({n}) must be multiples of 16")
    out_dtype = out_dtype or a.dtype
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.dtype != torch.float32:
            problems.append(f"{name} must be fp32, got {scale.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        problems.append(f"scales {tuple(scale_a.shape)} and {tuple(scale_b.shape)} are neither one each nor "
                        f"[M, 1] and [1, N] ({m}, {n})")
    if rowwise and not tensorwise and not a.dtype == b.dtype == torch.float8_e4m3fn:
        problems.append(f"row-wise scales need two E4M3 operands, got {a.dtype} and {b.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"output dtype {out_dtype} (bf16, fp16 or fp32)")
    if out is not None:
        if out.dtype != out_dtype or tuple(out.shape) != (m, n):
            problems.append(f"out is {out.dtype} {tuple(out.shape)}, the product {out_dtype} {(m, n)}")
        if not _row_major(out):
            problems.append(f"out must be row-major, got strides {out.stride()}")
        else:
            problems += _aligned(out, "out", out.stride(0))
    return problems


def scaled_grouped_mm_problems(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16) -> list:
    """What CUDA's `torch._scaled_grouped_mm` (Hopper) would refuse in these arguments."""
    problems = []
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        problems.append(f"operands must both be E4M3, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() not in (2, 3):
        return problems + [f"operands must be 2-D and 2- or 3-D, got {tuple(a.shape)} and {tuple(b.shape)}"]
    problems += _operand_layouts(a, b)
    if b.dim() == 3 and (b.stride(0) * b.element_size()) % ALIGN:
        problems.append(f"b's group stride ({b.stride(0)}) is no multiple of 16 bytes")
    k, n = a.shape[1], b.shape[-1]
    if k % 16 or n % 16:
        problems.append(f"K ({k}) and N ({n}) must be multiples of 16")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        problems.append(f"offs must be 1-D int32, got {offs.dtype} {tuple(offs.shape)}")
    groups = offs.numel()
    ends = offs.tolist()
    if any(later < earlier for earlier, later in zip([0] + ends, ends)):
        problems.append(f"offs must not decrease: {ends}")
    m = a.shape[0]
    if b.dim() == 3:
        if b.shape[0] != groups or b.shape[1] != k:
            problems.append(f"b {tuple(b.shape)} for {groups} groups of a {tuple(a.shape)}")
        if ends and ends[-1] > m:
            problems.append(f"the last offset {ends[-1]} is past a's {m} rows")
        want_a, want_b = (m,), (groups, n)
    else:
        if ends and ends[-1] > k:
            problems.append(f"the last offset {ends[-1]} is past the contracted {k}")
        sizes = [later - earlier for earlier, later in zip([0] + ends, ends)]
        if any(size % 16 for size in sizes):
            problems.append(f"groups along the contracted dimension must be multiples of 16 long: {sizes}")
        want_a, want_b = (groups * m,), (groups * n,)
    for name, scale, want in (("scale_a", scale_a, want_a), ("scale_b", scale_b, want_b)):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want or not scale.is_contiguous():
            problems.append(f"{name} must be contiguous fp32 {want}, got {scale.dtype} {tuple(scale.shape)} "
                            f"strides {scale.stride()}")
    if out_dtype != torch.bfloat16:
        problems.append(f"output dtype {out_dtype} (bf16 only)")
    return problems


class CudaOperandRules(TorchDispatchMode):
    """Fails every `torch._scaled_mm` call (either form) that CUDA would refuse, naming why; counts
    the calls it checked (`checked`)."""

    def __init__(self):
        super().__init__()
        self.checked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm.out):
            bound = dict(zip([argument.name for argument in func._schema.arguments], args)) | kwargs
            problems = scaled_mm_problems(bound["self"], bound["mat2"], bound["scale_a"], bound["scale_b"],
                                          bound.get("out_dtype"), bound.get("out"))
            assert not problems, "a GPU would refuse this torch._scaled_mm: " + "; ".join(problems)
            self.checked += 1
        return func(*args, **kwargs)
