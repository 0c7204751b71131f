"""The iteration log line, throughput (TFLOP/s/GPU by Megatron's formula, see docs/performance.md) and TensorBoard."""
import datetime
from typing import Optional

from megatron.core.transformer.config import TransformerConfig
from megatron.training.planning.architecture import model_flops


def flops_per_iteration(model: TransformerConfig, global_batch_size: int, seq_length: int) -> float:
    """Megatron's model FLOPs of one iteration, counted on the model built on the meta device
    (planning/built.py: each layer kind's matrices and attention products, a token's top-k experts,
    the multi-token prediction modules and their logits; 3x the forward, causal attention counted
    as half, recomputation not). For a dense model it is
    6*B*s*[ L*( m*h*f + 2*h*q + 2*h*k*g + s*q ) + h*V ] (m = 3 for SwiGLU else 2; q = heads*kv_channels;
    k = kv_channels; g = query groups; V = padded vocab). One definition, the planner's, so the
    plan's MFU and the log line's TFLOP/s/GPU count the same FLOPs.
    """
    return model_flops(model, global_batch_size, seq_length)


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                   throughput: Optional[tuple], learning_rate: float, global_batch_size: int, losses: dict,
                   loss_scale: float, grad_norm: Optional[float], skipped: int, nan: int, peak_memory_gb: float,
                   decoupled_learning_rate: Optional[float] = None, params_norm: Optional[float] = None,
                   num_zeros: Optional[int] = None) -> str:
    """Megatron's iteration line. `throughput`: (TFLOP/s/GPU, tokens/s/GPU), shown with
    --log-throughput; the decoupled learning rate, parameter norm and zero count when given."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if throughput is not None:
        parts += [f"throughput per GPU (TFLOP/s/GPU): {throughput[0]:.2f}",
                  f"tokens per GPU (tokens/s/GPU): {throughput[1]:.1f}"]
    parts.append(f"learning rate: {learning_rate:.6E}")
    if decoupled_learning_rate is not None:
        parts.append(f"decoupled learning rate: {decoupled_learning_rate:.6E}")
    parts.append(f"global batch size: {global_batch_size:5d}")
    # lm loss first, then the auxiliary losses (as Megatron-LM); per-layer MoE values go to TensorBoard only
    ordered = sorted(losses.items(), key=lambda item: item[0] != "lm loss")
    parts += [f"{name}: {value:.6E}" for name, value in ordered if not name.startswith("moe/")]
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nan:3d}",
              f"peak memory (GB): {peak_memory_gb:.2f}"]
    return " | ".join(parts) + " |"


def tensorboard_scalars(logging_config, losses: dict, statistics: dict, world_size: int, memory: dict) -> dict:
    """Megatron's per-iteration TensorBoard scalars (tag: value) under the --log-* switches."""
    log = logging_config
    values = {name: statistics[name] for name in ("learning-rate", "decoupled-learning-rate", "batch-size",
                                                  "grad-norm", "params-norm", "num-zeros")}
    values.update(losses)
    if log.log_loss_scale_to_tensorboard:
        values["loss-scale"] = statistics["loss-scale"]
    if log.log_world_size_to_tensorboard:
        values["world-size"] = world_size
    if log.log_memory_to_tensorboard:
        values.update(memory)
    return values


class TensorBoardWriter:
    """Scalars to TensorBoard when --tensorboard-dir is given (and the package is installed)."""

    def __init__(self, directory: Optional[str]):
        self.writer = None
        if directory:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from error
            self.writer = SummaryWriter(log_dir=directory)

    def scalars(self, iteration: int, values: dict) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, iteration)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
