"""Loss scaling for fp16: a constant scale, or Megatron's dynamic scaler with hysteresis."""
import torch


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = torch.tensor([scale], dtype=torch.float32)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


class DynamicGradScaler:
    """Halves the scale after `hysteresis` overflowing steps; doubles it after `growth_interval`
    clean steps in a row; never drops below `min_scale`."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        self.scale = torch.tensor([initial_scale], dtype=torch.float32)
        self.min_scale = min_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._hysteresis_left = hysteresis
        self._clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]
