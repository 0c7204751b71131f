"""FSDP2 (`--use-torch-fsdp2`): parity with one process running the same global batch (fp32, 3 Adam
steps, clipping active) at DP=2 and at DP=2 x TP=2 with sequence parallelism and replicated
key/value heads, each built on the meta device and starting from exactly the single-process
weights; bf16 parameters (fp32 shards, bf16 compute) against the single-process bf16 run, with the
gradient reduce-scatter in fp32 or, with --grad-reduce-in-bf16, in bf16; the start-up peak on rank 0
against sharding a model built whole; and the settings it refuses. PyTorch's `fully_shard` runs on
a CPU device mesh over gloo with torch 2.13, so this runs on CPU. (FSDP2 with pipeline parallelism:
tests/distributed/test_pipeline_parallel.py and the functional test.)"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.ddp import validate_data_parallel
from megatron.core.distributed.fsdp import FullyShardedDataParallel, shard_row_start
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distributed_optimizer import FSDPOptimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.parity import split_overrides
from tests.distributed.test_data_parallel import (
    SEED,
    TP2_OVERRIDES,
    assert_matches_reference,
    full_params,
    global_batches,
    micro_batch_loss,
    model_config,
    optimizer_config,
    parallel_run,
    reference_run,
    scenario,
)


def _fsdp_run(tp, per_rank, model_overrides, reduce_dtype=torch.float32):
    """Built on the meta device as training builds it; returns the parallel run plus the weights it
    started from and the dtypes of its gradient reduce-scatters."""
    groups = initialize_model_parallel(tp, 1)
    overrides, execution = split_overrides(dict(model_overrides))
    model = GPTModel(model_config(**overrides), groups, execution=execution, rng_tracker=None,
                     device=torch.device("meta"))
    chunk = FullyShardedDataParallel(model, groups, init_seed=SEED, reduce_dtype=reduce_dtype)
    initial = full_params(model, groups)
    # Inside no_sync a micro-batch's gradient is already reduce-scattered into the shards: nothing
    # unsharded is carried to the next micro-batch.
    with chunk.no_sync():
        micro_batch_loss(chunk, global_batches(1)[0, 0]).backward()
    sharded_after_no_sync = all(p.grad is not None and p.grad.to_local().shape == p.to_local().shape
                                for p in chunk.params)
    chunk.zero_grad_buffer()
    bf16 = dict(model_overrides).get("params_dtype") == torch.bfloat16
    optimizer = get_megatron_optimizer(optimizer_config(bf16=bf16), [chunk], groups)
    assert isinstance(optimizer, FSDPOptimizer)
    reduce_scatter, reduced_dtypes = dist.reduce_scatter_single, set()

    def recording_reduce_scatter(output, input, *args, **kwargs):
        reduced_dtypes.add(input.dtype)
        return reduce_scatter(output, input, *args, **kwargs)

    dist.reduce_scatter_single = recording_reduce_scatter
    try:
        result = parallel_run(groups, model, chunk, optimizer, per_rank)
    finally:
        dist.reduce_scatter_single = reduce_scatter
    result["sharded"] = all(p.to_local().numel() < p.numel() for p in chunk.params if p.shape[0] >= groups.dp_size)
    result["initial"] = initial
    result["sharded_after_no_sync"] = sharded_after_no_sync
    result["reduced_dtypes"] = reduced_dtypes
    result["shard_dtypes"] = {p.to_local().dtype for p in chunk.params}
    return result


def _fsdp_startup_peak(layers):
    """Peak bytes held on this rank while a bf16 model is built and sharded: built whole on the
    device, initialized, then sharded (as before), against built on the meta device and
    initialized shard by shard (as now); and whether both start from the same weights."""
    from megatron.training.memory import LiveTensorBytes

    groups = initialize_model_parallel(1, 1)
    config = model_config(num_layers=layers)
    peaks, weights = {}, {}
    for on_meta in (False, True):
        with LiveTensorBytes() as counter:
            model = GPTModel(config, groups, execution=ExecutionConfig(params_dtype=torch.bfloat16), rng_tracker=None,
                             device=torch.device("meta") if on_meta else torch.device("cpu"))
            if not on_meta:
                model.initialize_parameters(SEED)
            chunk = FullyShardedDataParallel(model, groups, init_seed=SEED)
        peaks[on_meta] = counter.peak
        weights[on_meta] = full_params(chunk.module, groups)
        del model, chunk
    same = all(torch.equal(weights[True][name][part], value)
               for name, parts in weights[False].items() for part, value in parts.items())
    sizes = [v.numel() for parts in weights[True].values() for v in parts.values()]
    return dict(built_whole=peaks[False], built_sharded=peaks[True], same_weights=same, parameters=sum(sizes),
                largest=max(sizes))


def _initial_weights(model_overrides=()) -> dict:
    groups = single_process()
    overrides, execution = split_overrides(dict(model_overrides))
    model = GPTModel(model_config(**overrides), groups, execution=execution, rng_tracker=None,
                     device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    return full_params(model, groups)


def _assert_starts_from(result, expected) -> None:
    for name, parts in expected.items():
        for part, value in parts.items():
            assert torch.equal(result["initial"][name][part], value.float()), name


def test_fsdp2_dp2_matches_single_process():
    for result in scenario(2, "fsdp"):
        assert result["sharded"] and result["sharded_after_no_sync"]
        assert result["reduced_dtypes"] == {torch.float32}
        _assert_starts_from(result, _initial_weights())
        assert_matches_reference(result, reference_run(4))


def test_fsdp2_dp2_tp2_matches_single_process():
    for result in scenario(4, "fsdp tp2"):
        assert result["sharded"]
        _assert_starts_from(result, _initial_weights(TP2_OVERRIDES))
        assert_matches_reference(result, reference_run(4, TP2_OVERRIDES))


def test_fsdp2_bf16_parameters_match_the_single_process_bf16_run():
    """bf16 compute on fp32 shards against one process with bf16 weights, fp32 gradient buffers and
    fp32 masters. Both start from the same bf16 weights and run the same bf16 micro-batches; only the
    order of the fp32 gradient sums differs, so the first loss is equal and later steps agree to
    bf16 precision (losses and gradient norms rtol 1e-3, weights within 1e-2 of their bf16 scale).
    With --grad-reduce-in-bf16 the reduce-scatter runs in bf16 (the shards stay fp32)."""
    bf16 = (("params_dtype", torch.bfloat16),)
    reference = reference_run(4, bf16)
    for name, expected_reduce in (("fsdp bf16", torch.float32), ("fsdp bf16 reduce in bf16", torch.bfloat16)):
        for result in scenario(2, name):
            assert result["reduced_dtypes"] == {expected_reduce}, name
            assert result["shard_dtypes"] == {torch.float32}, name
            _assert_starts_from(result, _initial_weights(bf16))
            assert result["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6), name
            assert result["losses"] == pytest.approx(reference["losses"], rel=1e-3), name
            assert result["norms"] == pytest.approx(reference["norms"], rel=1e-3), name
            for param, parts in reference["params"].items():
                for part, expected in parts.items():
                    torch.testing.assert_close(result["params"][param][part], expected, rtol=1e-2, atol=1e-3,
                                               msg=lambda m: f"{name} {param}[{part}]: {m}")


def test_fsdp2_startup_holds_one_over_dp_of_the_model():
    """DP=4, bf16: building the model whole and then sharding it held at least its whole fp32 copy
    (4 bytes per parameter); building it on the meta device holds this rank's fp32 shards (1/4 of
    that) plus, while one parameter is initialized, its full generated fp32 value and the bf16
    rounding of this rank's rows (at most 5 bytes per element of the largest parameter)."""
    results = scenario(4, "fsdp start-up")
    for result in results:
        assert result["same_weights"]
    rank0 = results[0]
    assert rank0["built_whole"] >= 4 * rank0["parameters"], rank0
    assert rank0["built_sharded"] <= 4 * rank0["parameters"] / 4 + 5 * rank0["largest"], rank0


def test_fsdp2_refuses_the_distributed_optimizer():
    with pytest.raises(ValueError, match="--use-torch-fsdp2 and --use-distributed-optimizer"):
        validate_data_parallel(use_torch_fsdp2=True, use_distributed_optimizer=True)


def test_shard_rows_follow_torch_chunk_when_data_ranks_do_not_divide_the_rows():
    """FSDP2 shards dim 0 like torch.chunk (ceil(rows / ranks) per rank, the last ones shorter or
    empty); initialization, checkpoints and partial-replica sums find a rank's rows with
    shard_row_start. The model tests' dimensions divide evenly, so the uneven cases are here."""
    for rows in range(1, 12):
        for ranks in range(1, 6):
            chunks = torch.arange(rows).chunk(ranks)
            for rank in range(ranks):
                groups = SimpleNamespace(dp_cp_size=ranks, dp_cp_rank=rank)
                start = shard_row_start(torch.empty(rows, 2), groups)
                expected = int(chunks[rank][0]) if rank < len(chunks) else rows
                assert start == expected, (rows, ranks, rank)
