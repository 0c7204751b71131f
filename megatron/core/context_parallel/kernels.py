"""Attention of one block of queries against one block of keys/values, returning the log-sum-exp.

Context-parallel attention computes a rank's output from several such blocks and merges them
(`merge.merge_block`), so it needs each block's log-sum-exp of the scaled scores per query row,
and a backward that takes the *merged* output and log-sum-exp (then each block's gradient is its
exact share of the gradient of the whole row). These are the kernels that provide both:

| device | dtype        | kernel                                                        | GQA          |
|--------|--------------|---------------------------------------------------------------|--------------|
| CPU    | any          | `aten._scaled_dot_product_flash_attention_for_cpu`            | native       |
| GPU    | bf16, fp16   | `aten._scaled_dot_product_flash_attention` (SDPA's flash)     | native       |
| GPU    | fp32         | `aten._scaled_dot_product_efficient_attention`                | K/V repeated |
| GPU    | bf16, fp16   | the flash-attn package (`--use-flash-attn`, when installed)    | native       |

"native": grouped-query attention without repeating K/V in memory. Every kernel takes q [b, nq, sq, d],
k/v [b, nkv, sk, d] and returns out [b, nq, sq, d] and lse [b, nq, sq] (fp32). `causal` is the
top-left aligned causal mask, used here only on square diagonal blocks. Dropout is not supported
(context parallelism refuses --attention-dropout > 0).
"""
import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

CPU_FLASH, FLASH, EFFICIENT, FLASH_ATTN = "cpu_flash", "flash", "efficient", "flash_attn"


@functools.lru_cache(maxsize=None)
def flash_attn_package_usable() -> bool:
    """The flash-attn package is installed and has the forward/backward entry points used here
    (flash-attn >= 2.6: `_flash_attn_forward(..., window_size_left, window_size_right, softcap, ...)`)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    from flash_attn import flash_attn_interface

    forward = getattr(flash_attn_interface, "_flash_attn_forward", None)
    return forward is not None and "window_size_left" in inspect.signature(forward).parameters


def select_kernel(device: torch.device, dtype: torch.dtype, use_flash_attn_package: bool = False) -> str:
    """The kernel for blocks of this device and dtype; `use_flash_attn_package` only when
    `flash_attn_package_usable()`."""
    if device.type == "cpu":
        return CPU_FLASH
    half = dtype in (torch.float16, torch.bfloat16)
    if use_flash_attn_package and half:
        return FLASH_ATTN
    return FLASH if half else EFFICIENT


def block_forward(kernel: str, q, k, v, causal: bool) -> tuple:
    """(out, lse, state): `state` is what `block_backward` needs besides the tensors."""
    if kernel == CPU_FLASH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, None
    if kernel == FLASH:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    if kernel == EFFICIENT:
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                        causal)
        # The kernel pads lse's last dim (to a multiple of 32); the merge uses the real rows.
        return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])
    if kernel == FLASH_ATTN:
        from flash_attn.flash_attn_interface import _flash_attn_forward

        out, lse, _, rng_state = _flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0,
            softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out.transpose(1, 2), lse, rng_state
    raise ValueError(f"unknown attention kernel {kernel!r}")


def block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, state) -> tuple:
    """(dq, dk, dv) of one block, given the merged `out` and `lse` of the query rows."""
    if kernel == CPU_FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if kernel == FLASH:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
    if kernel == EFFICIENT:
        seed, offset, padded = state
        groups = q.shape[1] // k.shape[1]
        lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, out, lse, seed, offset, 0.0,
            [True, True, True, False], causal)
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
    if kernel == FLASH_ATTN:
        from flash_attn.flash_attn_interface import _flash_attn_backward

        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
        dq, dk, dv = (torch.empty_like(t) for t in (q_, k_, v_))
        _flash_attn_backward(dout.transpose(1, 2), q_, k_, v_, out.transpose(1, 2), lse.contiguous(), dq, dk, dv,
                             dropout_p=0.0, softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_size_left=-1,
                             window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                             rng_state=state)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    groups = num_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // groups, groups, s, d).sum(dim=2)
