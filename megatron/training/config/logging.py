"""Logging flags."""
from dataclasses import dataclass, field
from typing import Optional

from megatron.core.transformer.config.fields import Flag, flag_field


@dataclass
class LoggingConfig:
    log_interval: int = 100
    """Print the iteration log line every this many iterations."""
    log_throughput: bool = False
    """Show TFLOP/s/GPU and tokens/s/GPU in the log line and TensorBoard."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars (loss, lr, grad norm, loss scale, throughput, memory) here."""
    tensorboard_log_interval: int = 1
    """Write the iteration's TensorBoard scalars (loss, learning rate, grad norm, ...) every this many iterations."""
    moe_per_layer_logging: bool = False
    """Also write each mixture-of-experts layer's auxiliary losses to TensorBoard (moe/<loss>_layer_<i>)."""
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
    log_params_norm: bool = False
    """Compute the L2 norm of all parameters and show it in the log line and TensorBoard."""
    log_num_zeros_in_grad: bool = False
    """Count the gradient elements equal to zero and show the count in the log line and TensorBoard."""
    log_timers_to_tensorboard: bool = False
    """Write the time per iteration to TensorBoard (iteration-time, seconds)."""
    log_loss_scale_to_tensorboard: bool = flag_field(True, Flag(
        "--no-log-loss-scale-to-tensorboard", "store_false", "Do not write the loss scale to TensorBoard."))
    """Write the loss scale to TensorBoard (off with --no-log-loss-scale-to-tensorboard)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write validation perplexities to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write allocated, reserved and peak device memory (bytes) to TensorBoard."""
    log_world_size_to_tensorboard: bool = False
    """Write the number of processes to TensorBoard."""
    log_progress: bool = False
    """Append job start, each checkpoint and the end of training, with throughput and tokens so far, to --save/progress.txt."""
    logging_level: Optional[int] = None
    """Level of Python's root logger (10 debug, 20 info, 30 warning, ...)."""
    log_straggler: bool = False
    """At each log interval, report the spread of per-rank step times and name the slowest ranks."""
    straggler_minmax_count: int = 1
    """With --log-straggler: how many of the slowest and fastest ranks to name."""
