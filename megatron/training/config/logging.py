"""Logging flags."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class LoggingConfig:
    log_interval: int = 100
    """Print the iteration log line every this many iterations."""
    log_throughput: bool = False
    """Include TFLOP/s/GPU and tokens/s/GPU in the log line (always computed)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars (loss, lr, grad norm, loss scale, throughput, memory) here."""
    tensorboard_log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""
