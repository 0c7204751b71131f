"""The run's state: where training stands (`TrainState`, saved in every checkpoint), what was built
to train (`ModelBundle`), and how many samples each iteration trains on, and for how many
iterations (`BatchSchedule`, Megatron-LM's rules).

Training is iteration-based (--train-iters) or sample-based (--train-samples: iterations = samples /
global batch size, the partial last batch dropped). With --rampup-batch-size START INCREMENT SAMPLES
(sample-based only) the global batch size starts at START and grows by INCREMENT each time another
SAMPLES / ((GLOBAL - START) / INCREMENT) samples have been consumed, until it reaches
--global-batch-size; an iteration runs that many samples as micro-batches of
micro-batch-size x data-parallel size.
"""
from dataclasses import dataclass
from typing import Optional

from megatron.core.optimizer import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    floating_point_operations: float = 0.0  # of all iterations so far, every job of the run (--log-progress)
    exit_reason: Optional[str] = None  # why training stopped before --train-iters (not saved)


@dataclass(frozen=True)
class ModelBundle:
    """The model as built to train: what a step runs, what a checkpoint saves and loads."""

    chunks: list                         # of ModelChunk (DDP or FSDP2), one per virtual pipeline stage
    optimizer: MixedPrecisionOptimizer
    scheduler: OptimizerParamScheduler
    config: TransformerConfig            # the architecture (derived)
    execution: ExecutionConfig           # how the layers run it
    vocab_size: int                      # the tokenizer's (the model's is padded: config.padded_vocab_size)


@dataclass(frozen=True)
class BatchSchedule:
    global_batch_size: int
    micro_batch_times_dp: int
    rampup: Optional[tuple] = None  # (start, increment, samples)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.global_batch_size
        samples_per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / samples_per_increment) * increment

    def num_microbatches_at(self, consumed_samples: int) -> int:
        return self.global_batch_size_at(consumed_samples) // self.micro_batch_times_dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration once any ramp-up is over (evaluation always runs this many)."""
        return self.global_batch_size // self.micro_batch_times_dp

    def batch_sizes(self) -> list:
        """Every global batch size the schedule uses, smallest first."""
        if self.rampup is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup
        return list(range(start, self.global_batch_size + 1, increment))

    def iterations_for(self, train_samples: int) -> int:
        """Iterations that train on at most `train_samples` samples: through the ramp one iteration
        at a time, then whole global batches."""
        iterations = consumed = 0
        if self.rampup is not None:
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def global_batch_size(training_config, data_parallel_size: int) -> int:
    """--global-batch-size, or Megatron's default: one micro-batch per data-parallel rank."""
    t = training_config
    return t.global_batch_size or t.micro_batch_size * data_parallel_size


def batch_schedule(training_config, data_parallel_size: int) -> BatchSchedule:
    """The schedule of validated flags (--rampup-batch-size parsed to three integers)."""
    t = training_config
    micro_batch_times_dp = t.micro_batch_size * data_parallel_size
    rampup = tuple(int(value) for value in t.rampup_batch_size) if t.rampup_batch_size else None
    return BatchSchedule(global_batch_size(t, data_parallel_size), micro_batch_times_dp, rampup)
