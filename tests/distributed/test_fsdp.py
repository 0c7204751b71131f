"""FSDP2 (`--use-torch-fsdp2`): parity with one process running the same global batch (fp32, 3 Adam
steps, clipping active) at DP=2 and at DP=2 x TP=2 with sequence parallelism and replicated
key/value heads; and the settings it refuses. PyTorch's `fully_shard` runs on a CPU device mesh over
gloo with torch 2.13, so this runs on CPU."""
import pytest
import torch

from megatron.core.distributed.ddp import validate_data_parallel
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distributed_optimizer import FSDPOptimizer
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.test_data_parallel import (
    SEED,
    TP2_OVERRIDES,
    assert_matches_reference,
    model_config,
    optimizer_config,
    parallel_run,
    reference_run,
    scenario,
)


def _fsdp_run(tp, per_rank, model_overrides):
    groups = initialize_model_parallel(tp, 1)
    model = GPTModel(model_config(**dict(model_overrides)), groups, rng_tracker=None, device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    chunk = FullyShardedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(optimizer_config(), [chunk], groups)
    assert isinstance(optimizer, FSDPOptimizer)
    result = parallel_run(groups, model, chunk, optimizer, per_rank)
    result["sharded"] = all(p.to_local().numel() < p.numel() for p in chunk.params if p.shape[0] >= groups.dp_size)
    return result


def test_fsdp2_dp2_matches_single_process():
    for result in scenario(2, "fsdp"):
        assert result["sharded"]
        assert_matches_reference(result, reference_run(4))


def test_fsdp2_dp2_tp2_matches_single_process():
    for result in scenario(4, "fsdp tp2"):
        assert result["sharded"]
        assert_matches_reference(result, reference_run(4, TP2_OVERRIDES))


def test_fsdp2_refuses_the_distributed_optimizer():
    with pytest.raises(ValueError, match="--use-torch-fsdp2 and --use-distributed-optimizer"):
        validate_data_parallel(use_torch_fsdp2=True, use_distributed_optimizer=True)
