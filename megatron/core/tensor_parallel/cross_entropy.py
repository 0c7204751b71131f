"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

Never materializes the full [s, b, V] logits on one rank: the max, the target logit and the sum of
exponentials are each reduced over the group (three small all-reduces of [s, b] tensors).
"""
import torch

from megatron.core.distributed import comm


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
