from megatron.core.optimizer.lr_scheduler import LRScheduleConfig, OptimizerParamScheduler, learning_rate
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, OptimizerConfig


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list, groups):
    """The optimizer for the wrapped model chunks of this rank: the distributed optimizer when the
    chunks were wrapped with `use_distributed_optimizer`, the FSDP2 optimizer for FSDP2 chunks,
    else the mixed-precision optimizer over full replicas."""
    from megatron.core.distributed.fsdp import FullyShardedDataParallel
    from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer, FSDPOptimizer

    if model_chunks and all(isinstance(c, FullyShardedDataParallel) for c in model_chunks):
        return FSDPOptimizer(config, model_chunks, groups)
    ddp_config = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    if ddp_config is not None and ddp_config.use_distributed_optimizer:
        return DistributedOptimizer(config, model_chunks, groups)
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    return MixedPrecisionOptimizer(config, params, groups)
