"""Learning-rate schedule: linear warmup (from init_lr), then constant, linear, cosine,
inverse-square-root or warmup-stable-decay (WSD) down to min_lr.

Steps are counted in samples, as Megatron-LM counts them: the scheduler advances by the global batch
size of each applied step, so a batch-size ramp-up moves it by what was actually trained on, and
iteration-based flags are converted (iterations x global batch size) by the caller."""
import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class LRScheduleConfig:
    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    decay_style: str = "linear"          # constant | linear | cosine | inverse-square-root | WSD
    wsd_decay_steps: Optional[float] = None
    wsd_decay_style: str = "exponential"  # exponential | linear | cosine | minus_sqrt (the WSD tail)
    init_lr: float = 0.0


def learning_rate(c: LRScheduleConfig, step: float, max_lr: Optional[float] = None,
                  min_lr: Optional[float] = None) -> float:
    """The lr after `step` samples; `max_lr`/`min_lr` override the config's (a param group's own)."""
    max_lr = c.max_lr if max_lr is None else max_lr
    min_lr = c.min_lr if min_lr is None else min_lr
    if c.warmup_steps > 0 and step <= c.warmup_steps:
        return c.init_lr + (max_lr - c.init_lr) * step / c.warmup_steps
    if c.decay_style == "constant":
        return max_lr
    if step > c.decay_steps:  # every decaying style, inverse-square-root included (as Megatron)
        return min_lr
    if c.decay_style == "inverse-square-root":
        warmup = max(c.warmup_steps, 1)
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
    decay_span = max(c.decay_steps - c.warmup_steps, 1)
    ratio = (step - c.warmup_steps) / decay_span
    if c.decay_style == "linear":
        coefficient = 1.0 - ratio
    elif c.decay_style == "cosine":
        coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif c.decay_style == "WSD":
        coefficient = _wsd_coefficient(c, step)
    else:
        raise ValueError(f"unknown `lr_decay_style` {c.decay_style!r}")
    return min_lr + coefficient * (max_lr - min_lr)


def _wsd_coefficient(c: LRScheduleConfig, step: float) -> float:
    tail = c.wsd_decay_steps or 0
    stable_end = c.decay_steps - tail
    if step <= stable_end or tail == 0:
        return 1.0
    ratio = (step - stable_end) / tail
    if c.wsd_decay_style == "linear":
        return 1.0 - ratio
    if c.wsd_decay_style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if c.wsd_decay_style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    return 2.0 * (0.5 ** ratio) - 1.0


class OptimizerParamScheduler:
    """Sets the learning rate of every param group; `step(global batch size)` after each applied
    optimizer step. A group with its own "max_lr"/"min_lr" (--decoupled-lr) follows the same
    schedule between its own bounds."""

    def __init__(self, optimizer, config: LRScheduleConfig):
        self.optimizer = optimizer
        self.config = config
        self.num_steps = 0  # samples
        self._apply()

    def get_lr(self) -> float:
        return learning_rate(self.config, self.num_steps)

    def get_decoupled_lr(self) -> Optional[float]:
        """The lr of the embedding and output layer groups, when they have their own (else None)."""
        for group in self.optimizer.param_groups:
            if "max_lr" in group:
                return group["lr"]
        return None

    def step(self, increment: int) -> None:
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, self.num_steps, group.get("max_lr"), group.get("min_lr"))

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self._apply()
