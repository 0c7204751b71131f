"""Per-step guards: NaN/Inf in the loss or gradients, and loss or gradient-norm spikes.

The NaN/Inf check (--check-for-nan-in-loss-and-grad, on by default as in Megatron) is decided the
same way on every rank: each rank flags a non-finite loss (its own micro-batches) and a non-finite
share of the gradient norm (its gradients, after the data-parallel reduction), and one max-reduction
over all ranks agrees on both flags. That reduction is issued before the optimizer reads the
gradient norm to the host, and read in the same transfer (`MixedPrecisionOptimizer.step`), so the
check adds one small all-reduce per step and no device synchronization. Only when a flag is set
does a second collective (an all-gather of the flags) name the ranks.

A non-finite step is never applied. By default training then stops on every rank with
`NonFiniteError`, naming the iteration, the ranks and whether the loss or the gradients;
with --skip-iter-on-nan the step is skipped (counted in the log line's skipped and NaN iterations)
unless more than --max-skipped-iters come in a row.

Spikes (--check-for-large-grads, --check-for-spiky-loss) are reported, not acted on: a value
--spike-factor times above the largest of the previous 100 values (Megatron compares with the
largest of the first 100; a running window keeps checking after the early large values), with the
iteration and the last checkpoint, which is where to resume from (with --iterations-to-skip) if
the run then diverges.
"""
import collections
import math
from typing import Callable, Optional

import torch

from megatron.core.distributed import comm
from megatron.training.errors import NonFiniteError

HISTORY = 100         # values a spike is compared with
MIN_HISTORY = 10      # values needed before anything is called a spike


class SpikeDetector:
    """Flags a value `factor` times above the largest of the previous HISTORY values (spikes and
    non-finite values are left out of the history)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.history = collections.deque(maxlen=HISTORY)

    def check(self, value: float) -> Optional[float]:
        """The largest recent value when `value` is a spike, else None (and `value` joins the history)."""
        if not math.isfinite(value):
            return None
        largest = max(self.history, default=0.0)
        if len(self.history) >= MIN_HISTORY and abs(value) >= self.factor * largest:
            return largest
        self.history.append(abs(value))
        return None


class StepGuard:
    """What `MixedPrecisionOptimizer.step(guard)` consults: `flags` (device values read with the
    gradient norm) and `allow` (the host decision). `iteration` is the iteration being run."""

    def __init__(self, training_config, groups, printer: Callable[[str], None],
                 last_checkpoint: Callable[[], Optional[str]]):
        t = training_config
        self.check = t.check_for_nan_in_loss_and_grad
        self.skip = t.skip_iter_on_nan
        self.max_skipped = t.max_skipped_iters
        self.grad_spikes = SpikeDetector(t.spike_factor) if t.check_for_large_grads else None
        self.loss_spikes = SpikeDetector(t.spike_factor) if t.check_for_spiky_loss else None
        self.groups = groups
        self.print = printer
        self.last_checkpoint = last_checkpoint
        self.iteration = 0
        self.in_a_row = 0
        self.vetoed = False               # this step was non-finite (and not applied)
        self._loss = None                 # this rank's [non-finite, sum, count] of the step's loss
        self._local_flags = None

    @classmethod
    def build(cls, training_config, groups, printer, last_checkpoint) -> Optional["StepGuard"]:
        t = training_config
        wanted = t.check_for_nan_in_loss_and_grad or t.check_for_large_grads or t.check_for_spiky_loss
        return cls(training_config, groups, printer, last_checkpoint) if wanted else None

    def observe_losses(self, reported: list) -> None:
        """This rank's reported [sum, count] values of the step, one dict per micro-batch (only the
        last pipeline stage has any). Stays on the device."""
        self.vetoed = False
        device = self.groups.device
        if not reported:
            self._loss = torch.zeros(3, dtype=torch.float32, device=device)
            return
        sums = torch.stack([torch.stack([r[name].detach().float() for name in sorted(r)]) for r in reported])
        first = sums[:, 0].sum(dim=0)  # [sum, count] of the first reported value (the loss)
        nonfinite = (~torch.isfinite(sums)).any().float().reshape(1)
        self._loss = torch.cat([nonfinite, first]).to(device)

    def flags(self, local_grad_square: Optional[torch.Tensor]) -> torch.Tensor:
        """[loss non-finite on any rank, gradients non-finite on any rank] (with the check on), then
        [this rank's loss sum, count] (with --check-for-spiky-loss): left on the device."""
        parts = []
        if self.check:
            grad_bad = (torch.zeros(1, device=self.groups.device) if local_grad_square is None else
                        (~torch.isfinite(local_grad_square.reshape(1))).float().to(self.groups.device))
            self._local_flags = torch.cat([self._loss[:1], grad_bad])
            agreed = self._local_flags.clone()
            comm.all_reduce_max(agreed, self.groups.world)
            parts.append(agreed)
        if self.loss_spikes is not None:
            parts.append(self._loss[1:])
        return torch.cat(parts) if parts else torch.zeros(0, device=self.groups.device)

    def allow(self, grad_norm: Optional[float], values: list) -> bool:
        """Whether to apply the step, from the values `flags` returned (read to the host). Raises
        NonFiniteError when training must stop. `grad_norm` is None when the fp16 loss scaler
        already skips the step for overflowing gradients."""
        if self.check:
            loss_bad, grad_bad = values[0] > 0, values[1] > 0
            values = values[2:]
            if loss_bad or grad_bad or (grad_norm is not None and not math.isfinite(grad_norm)):
                self._non_finite()
                return False
        self.in_a_row = 0
        self._check_spikes(grad_norm, values)
        return True

    def _non_finite(self) -> None:
        """Names the ranks (every rank takes part), then stops or counts a skip."""
        ranks = torch.zeros(self.groups.world_size * 2, dtype=torch.float32, device=self.groups.device)
        comm.all_gather_into_tensor(ranks, self._local_flags, self.groups.world)
        per_rank = ranks.view(-1, 2).tolist()
        loss_ranks = [r for r, (loss, _) in enumerate(per_rank) if loss > 0]
        grad_ranks = [r for r, (_, grad) in enumerate(per_rank) if grad > 0]
        parts = []
        if loss_ranks:
            parts.append(f"the loss on {_ranks(loss_ranks)}")
        if grad_ranks:
            parts.append(f"the gradients on {_ranks(grad_ranks)} (checked after the data-parallel reduction)")
        what = " and in ".join(parts) or "the global gradient norm"
        message = f"iteration {self.iteration}: NaN/Inf in {what}"
        self.vetoed = True
        self.in_a_row += 1
        if self.skip and self.in_a_row <= self.max_skipped:
            self.print(f"WARNING: {message}; the iteration is skipped (--skip-iter-on-nan: {self.in_a_row} in a "
                       f"row, at most {self.max_skipped})")
            return
        why = (f"more than --max-skipped-iters {self.max_skipped} in a row" if self.skip else
               "--check-for-nan-in-loss-and-grad")
        raise NonFiniteError(
            f"{message}; training stopped ({why}) without applying it. {self._resume_hint()} "
            "--skip-iter-on-nan skips such iterations, --no-check-for-nan-in-loss-and-grad trains on them")

    def _resume_hint(self) -> str:
        skip = f"--iterations-to-skip {self.iteration - 1}"
        checkpoint = self.last_checkpoint()
        if checkpoint:
            return f"To go past it, resume from {checkpoint} with {skip} (skips this iteration's data);"
        return f"No checkpoint was saved in this run; resuming from one with {skip} skips this iteration's data;"

    def _check_spikes(self, grad_norm: Optional[float], values: list) -> None:
        g = self.groups
        if self.grad_spikes is not None and grad_norm is not None:
            largest = self.grad_spikes.check(grad_norm)
            if largest is not None and g.global_rank == 0:
                self._report_spike(self.grad_spikes, "gradient norm", grad_norm, largest, "--check-for-large-grads")
        if self.loss_spikes is not None and values and values[1] > 0:
            loss = values[0] / values[1]
            largest = self.loss_spikes.check(loss)
            if largest is not None and g.tp_rank == 0 and g.cp_rank == 0:
                self._report_spike(self.loss_spikes, f"loss on rank {g.global_rank}", loss, largest,
                                   "--check-for-spiky-loss")

    def _report_spike(self, detector: SpikeDetector, what: str, value: float, largest: float, flag: str) -> None:
        checkpoint = self.last_checkpoint()
        pointer = f"last checkpoint: {checkpoint}" if checkpoint else "no checkpoint saved yet"
        print(f"WARNING: iteration {self.iteration}: {what} {value:.4E} is {value / largest:.1f}x the largest of the "
              f"previous {len(detector.history)} iterations ({largest:.4E}) ({flag}); {pointer}", flush=True)


def _ranks(ranks: list) -> str:
    shown = ", ".join(str(r) for r in ranks[:16]) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
