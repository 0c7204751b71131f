"""Typed configuration: one dataclass per concern; the command-line flags are generated from it."""
from dataclasses import dataclass, field

from megatron.training.config.checkpoint import CheckpointConfig
from megatron.training.config.data import DataConfig
from megatron.training.config.logging import LoggingConfig
from megatron.training.config.model import ModelConfig
from megatron.training.config.parallel import ParallelConfig
from megatron.training.config.training import OptimizerArgs, TrainingConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerArgs,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerArgs
    data: DataConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    megatron_lm_flags: dict = field(default_factory=dict)  # given Megatron-LM flags not built here: {flag: value}
