"""Test-only faults, injected through the environment variable MEGATRON_TEST_FAULTS.

For the reliability tests and `bench/chaos.py` only: never set it in a real run. It takes a
comma-separated list of KIND@ITERATION:RANK (RANK is the global rank; ITERATION the 1-based
iteration of the log line), and every fault fires in that iteration's first micro-batch on that rank:

    nan-loss    the loss is NaN (so are the gradients it gives)
    nan-grad    the loss is finite, the gradients are NaN
    spike       the loss (and so the gradients) x 1000
    kill        the process kills itself with SIGKILL, mid-step
    hang        the process sleeps forever, mid-step (it stops answering its peers)
    slow        the micro-batch takes 0.2 s longer (a straggler), in every iteration from ITERATION on

Faults fire in the first attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT 0), as a
transient fault would: a job restarted with --max-restarts then runs clean. Without the variable
(or in a restarted attempt) `FaultInjector.from_environment` returns None and nothing is wrapped.
"""
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

VARIABLE = "MEGATRON_TEST_FAULTS"
KINDS = ("nan-loss", "nan-grad", "spike", "kill", "hang", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int
    rank: int


def parse(text: str) -> list:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            kind, place = item.split("@")
            iteration, rank = place.split(":")
            fault = Fault(kind, int(iteration), int(rank))
        except ValueError:
            raise ValueError(f"{VARIABLE}: {item!r} is not KIND@ITERATION:RANK") from None
        if kind not in KINDS:
            raise ValueError(f"{VARIABLE}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


class _NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class FaultInjector:
    """Wraps a forward_step function; the training loop sets `iteration` before every step."""

    def __init__(self, faults: list, rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.iteration = 0
        self._fired = set()

    @classmethod
    def from_environment(cls, rank: int) -> Optional["FaultInjector"]:
        text = os.environ.get(VARIABLE)
        if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        return cls(parse(text), rank)

    def _due(self) -> list:
        due = []
        for fault in self.faults:
            if fault.kind == "slow" and self.iteration >= fault.iteration:
                due.append(fault)
            elif fault.iteration == self.iteration and (fault, self.iteration) not in self._fired:
                self._fired.add((fault, self.iteration))
                due.append(fault)
        return due

    def wrap(self, forward_step_func: Callable) -> Callable:
        def forward_step(data_iterator, model):
            output, loss_func = forward_step_func(data_iterator, model)
            if not torch.is_grad_enabled():  # evaluation
                return output, loss_func
            kinds = {fault.kind for fault in self._due()}
            if "kill" in kinds:
                os.kill(os.getpid(), signal.SIGKILL)
            if "hang" in kinds:
                while True:
                    time.sleep(60)
            if "slow" in kinds:
                time.sleep(0.2)
            return output, _faulty_loss(loss_func, kinds) if kinds else loss_func
        return forward_step


def _faulty_loss(loss_func: Callable, kinds: set) -> Callable:
    def faulty(*args, **kwargs):
        loss, reported = loss_func(*args, **kwargs)
        if "nan-loss" in kinds:
            loss = loss * float("nan")
            reported = {name: value * float("nan") for name, value in reported.items()}
        if "spike" in kinds:
            loss = loss * 1000.0
            reported = {name: value * torch.tensor([1000.0, 1.0], device=value.device)  # [sum, count]
                        for name, value in reported.items()}
        if "nan-grad" in kinds:
            loss = _NaNGradient.apply(loss)
        return loss, reported
    return faulty
