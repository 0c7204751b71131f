"""Logging flags."""
from dataclasses import dataclass, field
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
    profile: bool = False
    """Profile iterations --profile-step-start to --profile-step-end (nsys capture range, or the PyTorch profiler)."""
    use_pytorch_profiler: bool = False
    """With --profile: use the PyTorch profiler and write a Chrome trace per profiled rank."""
    profile_step_start: int = 10
    """First profiled iteration (1-based count of completed iterations before it)."""
    profile_step_end: int = 12
    """Profiling stops before this iteration."""
    profile_ranks: list = field(default_factory=lambda: ["0"])
    """Global ranks to profile."""
    profile_dir: Optional[str] = None
    """Where PyTorch profiler traces go; default --tensorboard-dir, else ./profiles."""
    log_straggler: bool = False
    """At each log interval, report the spread of per-rank step times and name the slowest ranks."""
    straggler_minmax_count: int = 1
    """With --log-straggler: how many of the slowest and fastest ranks to name."""
