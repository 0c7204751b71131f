from megatron.core.optimizer.lr_scheduler import LRScheduleConfig, OptimizerParamScheduler, learning_rate
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, OptimizerConfig


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list, groups):
    """The optimizer for the (DDP-wrapped) model chunks of this rank."""
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    return MixedPrecisionOptimizer(config, params, groups)
