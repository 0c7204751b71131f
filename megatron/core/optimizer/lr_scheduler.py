"""Learning-rate schedule: linear warmup, then constant, linear, cosine, inverse-square-root or
warmup-stable-decay (WSD) down to min_lr, counted in iterations."""
import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class LRScheduleConfig:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str = "linear"          # constant | linear | cosine | inverse-square-root | WSD
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "exponential"  # exponential | linear | cosine (the WSD tail)
    init_lr: float = 0.0


def learning_rate(c: LRScheduleConfig, step: int) -> float:
    if c.warmup_steps > 0 and step <= c.warmup_steps:
        return c.init_lr + (c.max_lr - c.init_lr) * step / c.warmup_steps
    if c.decay_style == "constant":
        return c.max_lr
    if step > c.decay_steps:  # every decaying style, inverse-square-root included (as Megatron)
        return c.min_lr
    if c.decay_style == "inverse-square-root":
        warmup = max(c.warmup_steps, 1)
        return max(c.min_lr, c.max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
    decay_span = max(c.decay_steps - c.warmup_steps, 1)
    ratio = (step - c.warmup_steps) / decay_span
    if c.decay_style == "linear":
        coefficient = 1.0 - ratio
    elif c.decay_style == "cosine":
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif c.decay_style == "WSD":
        coefficient = _wsd_coefficient(c, step)
    else:
        raise ValueError(f"unknown --lr-decay-style {c.decay_style!r}")
    return c.min_lr + coefficient * (c.max_lr - c.min_lr)


def _wsd_coefficient(c: LRScheduleConfig, step: int) -> float:
    tail = c.wsd_decay_steps or 0
    stable_end = c.decay_steps - tail
    if step <= stable_end or tail == 0:
        return 1.0
    ratio = (step - stable_end) / tail
    if c.wsd_decay_style == "linear":
        return 1.0 - ratio
    if c.wsd_decay_style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return 2.0 * (0.5 ** ratio) - 1.0


class OptimizerParamScheduler:
    """Sets the learning rate of every param group; `step()` after each optimizer step."""

    def __init__(self, optimizer, config: LRScheduleConfig):
        self.optimizer = optimizer
        self.config = config
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> float:
        return learning_rate(self.config, self.num_steps)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self._apply()
