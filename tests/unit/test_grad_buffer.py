"""Gradient buffers and buckets, single process: layout, accumulation, flag checks, and the
theoretical memory figures against the optimizers' real state."""
import types

import pytest
import torch

from megatron.core.distributed.ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
    validate_data_parallel,
)
from megatron.core.distributed.param_and_grad_buffer import plan_buckets
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer
from megatron.core.parallel_state import single_process
from megatron.training.memory import memory_report, theoretical_bytes
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.test_data_parallel import (
    SEED,
    global_batches,
    micro_batch_loss,
    model_config,
    optimizer_config,
    train_step,
)


def _tensors(*sizes):
    return [torch.nn.Parameter(torch.zeros(size)) for size in sizes]


def test_buckets_close_at_size_pad_and_isolate_shared_params():
    a, b, c, d = _tensors(10, 7, 5, 3)
    buckets, total = plan_buckets([a, b, c, d], bucket_size=12, pad_multiple=4, own_bucket=frozenset({c}))
    assert [bucket.params for bucket in buckets] == [[a, b], [c], [d]]
    assert [(bucket.start, bucket.end) for bucket in buckets] == [(0, 20), (20, 28), (28, 32)]
    assert buckets[0].param_ranges[b] == (10, 17)
    assert total == 32
    assert buckets[0].shard_range(1, 4) == (5, 10)
    one, total = plan_buckets([a, b, c, d], bucket_size=None)
    assert len(one) == 1 and total == 25
    # The distributed optimizer's layout: every parameter starts at a multiple of 64 elements.
    aligned, total = plan_buckets([a, b, c, d], bucket_size=None, pad_multiple=128, param_alignment=64)
    assert [aligned[0].param_ranges[p] for p in (a, b, c, d)] == [(0, 10), (64, 71), (128, 133), (192, 195)]
    assert total == 256


@pytest.mark.parametrize("size", [0, -5])
def test_bucket_size_must_be_positive(size):
    with pytest.raises(ValueError, match=f"--ddp-bucket-size must be a positive number of elements, got {size}"):
        DistributedDataParallelConfig(bucket_size=size)


def test_flag_combinations_are_refused_with_the_flags_named():
    with pytest.raises(ValueError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        validate_data_parallel(overlap_param_gather=True)
    with pytest.raises(ValueError, match="--use-torch-fsdp2 and --use-distributed-optimizer"):
        validate_data_parallel(use_torch_fsdp2=True, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"):
        validate_data_parallel(use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(ValueError, match="--overlap-param-gather-with-optimizer-step needs interleaved pipeline"):
        validate_data_parallel(use_distributed_optimizer=True, overlap_param_gather=True,
                               overlap_param_gather_with_optimizer_step=True)
    validate_data_parallel(ddp_bucket_size=1, use_distributed_optimizer=True, overlap_param_gather=True)
    validate_data_parallel(use_distributed_optimizer=True, overlap_param_gather=True,
                           overlap_param_gather_with_optimizer_step=True, virtual_pipeline_size=2)


def _model(dtype=torch.float32):
    model = GPTModel(model_config(), single_process(), execution=ExecutionConfig(params_dtype=dtype),
                     device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    return model


def test_micro_batches_accumulate_into_the_buffer_and_overlap_marks_buckets():
    groups = single_process()
    reference = _model()
    micro_batches = list(global_batches(3)[0])
    for tokens in micro_batches:
        (micro_batch_loss(reference, tokens) / 3).backward()
    model = _model()
    chunk = DistributedDataParallel(model, groups, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=2000))
    buckets = [b for buffer in chunk.buffers for b in buffer.buckets]
    assert len(buckets) > 3
    chunk.zero_grad_buffer()
    for index, tokens in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with chunk.no_sync() if not last else torch.enable_grad():
            (micro_batch_loss(chunk, tokens) / 3).backward()
        assert all(b.grad_sync_started for b in buckets) == last
    finalize_model_grads([chunk], groups)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is None
        assert param.main_grad.data_ptr() >= chunk.buffers[0].grad_data.data_ptr()
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_distributed_optimizer_at_dp1_matches_the_replicated_optimizer():
    groups = single_process()
    batches = global_batches(2)
    runs = []
    for use_distributed_optimizer in (False, True):
        model = _model()
        chunk = DistributedDataParallel(model, groups, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer, bucket_size=3000))
        optimizer = get_megatron_optimizer(optimizer_config(), [chunk], groups)
        assert isinstance(optimizer, DistributedOptimizer) == use_distributed_optimizer
        norms = [train_step(chunk, optimizer, groups, list(batches[step]))[2] for step in range(2)]
        runs.append((norms, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_theoretical_optimizer_state_equals_the_real_state_in_bf16(use_distributed_optimizer):
    groups = single_process()
    model = _model(torch.bfloat16)
    chunk = DistributedDataParallel(model, groups, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer))
    optimizer = get_megatron_optimizer(optimizer_config(bf16=True), [chunk], groups)
    assert train_step(chunk, optimizer, groups, list(global_batches(1)[0]))[1]
    figures = theoretical_bytes([chunk], optimizer)
    elements = sum(p.numel() for p in model.parameters())
    assert figures["optimizer_state"] == optimizer.optimizer_state_bytes() == 12 * elements  # master + 2 moments
    assert figures["parameters"] == 2 * elements
    assert figures["gradients"] >= 4 * elements
    parallel = types.SimpleNamespace(use_torch_fsdp2=False, use_distributed_optimizer=use_distributed_optimizer)
    text = memory_report(types.SimpleNamespace(parallel=parallel), [chunk], optimizer, groups)
    assert "optimizer state" in text and "GiB" in text
