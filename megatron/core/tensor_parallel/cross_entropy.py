"""Cross entropy over logits whose vocabulary dimension may be split across tensor-parallel ranks.

Two implementations, the same loss:

- `fused_vocab_parallel_cross_entropy` (`--cross-entropy-loss-fusion`, the default): reads the logits
  (bf16 in mixed precision) chunk by chunk, `chunk_elements` at a time in fp32, keeps only the
  per-token log-sum-exp for backward, and in backward writes the gradient over the logits in place,
  chunk by chunk, in the logits' dtype. No fp32 [s, b, V] tensor is ever allocated. Over a
  tensor-parallel group each rank computes its local log-sum-exp and target logit, and two small
  all-reduces of [s*b] values (a max, then one sum of two rows) combine them.
- `vocab_parallel_cross_entropy`: the plain version (fp32 copy of the logits; at TP=1
  `F.cross_entropy` on `logits.float()`), kept as the reference and for
  `--no-cross-entropy-loss-fusion`.
"""
import torch

from megatron.core.distributed import comm
from megatron.core.utils import pick

DEFAULT_CHUNK_ELEMENTS = 1 << 26  # fp32 elements per chunk: 256 MiB of temporaries per pass


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        # logits: [s, b, V/tp] (any float dtype, computed in fp32); target: [s, b] global ids
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        comm.all_reduce_max(logits_max, group)
        shifted = logits - logits_max.unsqueeze(-1)

        local_vocab = shifted.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reused in place: softmax - onehot(target)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int = 0):
    """Per-token loss [s, b] (fp32). `vocab_start`: first vocabulary id of this rank's slice."""
    if comm.size(group) == 1:
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), target.flatten(), reduction="none").view_as(target)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)


# -- fused, chunked ------------------------------------------------------------------------------
def chunk_log_sum_exp(chunk: torch.Tensor, local_target: torch.Tensor, outside: torch.Tensor):
    """chunk [n, V/tp] -> (log-sum-exp over this rank's vocabulary [n], target logit or 0 [n]), fp32."""
    logits = chunk.float()
    maximum = logits.amax(dim=-1)
    lse = maximum + (logits - maximum.unsqueeze(-1)).exp().sum(dim=-1).log()
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return lse, target_logit


def chunk_softmax_grad_(chunk: torch.Tensor, lse: torch.Tensor, local_target: torch.Tensor,
                        outside: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """In place: chunk <- (softmax(chunk) - onehot(target)) * grad_loss, computed in fp32.

    The one-hot is a comparison inside the same elementwise expression (`where`), not a
    `scatter_add_` into the probabilities: compiled, this is one pass that reads the logits and
    writes the gradient over them, with no fp32 [rows, V] buffer (a scatter makes inductor
    materialize the probabilities in fp32 and pass over them three times)."""
    probs = (chunk.float() - lse.unsqueeze(-1)).exp()
    vocab_ids = torch.arange(chunk.shape[-1], device=chunk.device)
    is_target = (vocab_ids == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    chunk.copy_(torch.where(is_target, probs - 1.0, probs) * grad_loss.unsqueeze(-1))


def eager_chunk_softmax_grad_(chunk: torch.Tensor, lse: torch.Tensor, local_target: torch.Tensor,
                              outside: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """chunk_softmax_grad_ for eager execution: every step in place on one fp32 copy of the chunk
    (uncompiled, the `where` above would allocate three more chunk-sized buffers), and the one-hot
    subtracted at the target entries only."""
    probs = chunk.float().sub_(lse.unsqueeze(-1)).exp_().mul_(grad_loss.unsqueeze(-1))
    rows = torch.arange(chunk.shape[0], device=chunk.device)
    probs[rows, local_target] -= grad_loss.masked_fill(outside, 0.0)
    chunk.copy_(probs)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, chunk_elements, compiled):
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)  # a view: logits are contiguous out of the linear
        target = target.reshape(-1)
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        rows = max(1, chunk_elements // local_vocab)
        lse_of = pick(chunk_log_sum_exp, compiled)
        pieces = [lse_of(flat[i:i + rows], local_target[i:i + rows], outside[i:i + rows])
                  for i in range(0, flat.shape[0], rows)]
        lse = torch.cat([p[0] for p in pieces])
        target_logit = torch.cat([p[1] for p in pieces])
        if comm.size(group) > 1:
            # log sum_r exp(lse_r) = m + log sum_r exp(lse_r - m), m = max_r lse_r; target logits sum.
            maximum = lse.clone()
            comm.all_reduce_max(maximum, group)
            sums = torch.stack(((lse - maximum).exp(), target_logit))
            comm.all_reduce(sums, group)
            lse = maximum + sums[0].log()
            target_logit = sums[1]
        ctx.save_for_backward(flat, lse, local_target, outside)
        ctx.rows, ctx.compiled, ctx.shape = rows, compiled, logits.shape
        return (lse - target_logit).view(ctx.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        flat, lse, local_target, outside = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1).float()
        rows = ctx.rows
        grad_of = pick(chunk_softmax_grad_, True) if ctx.compiled else eager_chunk_softmax_grad_
        for i in range(0, flat.shape[0], rows):
            grad_of(flat[i:i + rows], lse[i:i + rows], local_target[i:i + rows], outside[i:i + rows],
                    grad_loss[i:i + rows])
        return flat.view(ctx.shape), None, None, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int = 0,
                                       *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, compiled: bool = False):
    """Per-token loss [s, b] (fp32), as `vocab_parallel_cross_entropy`, with bounded memory.

    Backward overwrites `logits` with their gradient (the logits are not needed after the loss), so
    the caller must not read them after backward. `compiled`: run each chunk's arithmetic as one
    torch.compile'd kernel (GPU)."""
    if logits.grad_fn is None:  # a leaf's data belongs to the caller: work on a copy
        logits = logits.clone()
    return _FusedCrossEntropy.apply(logits.contiguous(), target, group, vocab_start, chunk_elements, compiled)
