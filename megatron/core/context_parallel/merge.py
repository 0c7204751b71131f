"""The online-softmax merge of partial attention results.

A query row's attention over keys split into blocks B1, B2, ... is, with o_i = softmax(S_i) V_i the
output over block i alone and l_i = logsumexp(S_i) its log-sum-exp:

    l = log(sum_i exp(l_i))          o = sum_i exp(l_i - l) o_i

so blocks can be attended one at a time (or on different ranks) and merged in any order. The
backward of each block needs only the merged o and l (softmax(S_i) restricted to the row is
exp(S_i - l)), which is how the context-parallel backward passes avoid storing per-block results.
"""
import torch


def empty_partial(q: torch.Tensor) -> tuple:
    """(out, lse) accumulators for q [b, n, s, d]: fp32 zeros and -inf (no block merged yet)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merges one block's (block_out [b, n, s, d], block_lse [b, n, s]) into the fp32 accumulators
    (out, lse) in place; `out` and `lse` may be views of rows of larger accumulators."""
    new_lse = torch.logaddexp(lse, block_lse.float())
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse.float() - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)
