"""The distributed optimizer (ZeRO-1) against one process with the same global batch, fp32, 3 steps,
gradient clipping active: DP=2 and DP=4 with and without --overlap-param-gather, DP=2 x TP=2 (with
sequence parallelism and replicated key/value heads, so the sharded norm and the TP partial
sums are exercised), an fp16 step skipped alike on every rank by an injected inf, the 1/DP
optimizer-state memory, and the layout-independent state round trip."""
import torch

from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer
from megatron.core.parallel_state import single_process
from tests.distributed.test_data_parallel import (
    SEED,
    TP2_OVERRIDES,
    assert_matches_reference,
    build_parallel,
    global_batches,
    model_config,
    my_micro_batches,
    optimizer_config,
    parallel_run,
    reference_run,
    scenario,
    train_step,
)


def _dist_opt_run(groups_tp, per_rank, overlap, model_overrides):
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap, bucket_size=3000)
    groups, model, chunk, optimizer = build_parallel(groups_tp, ddp_config, dict(model_overrides))
    assert isinstance(optimizer, DistributedOptimizer)
    result = parallel_run(groups, model, chunk, optimizer, per_rank)
    result["state_bytes"] = optimizer.optimizer_state_bytes()
    result["padding"] = sum(b.numel - sum(p.numel() for p in b.params) for buf in chunk.buffers for b in buf.buckets)
    # Layout-independent state: the gathered masters equal the model's weights, and loading the
    # gathered state into a fresh optimizer reproduces this rank's shards exactly.
    full = optimizer.full_state()
    result["full_masters"] = {name: entry["param"] for name, entry in full["params"].items()}
    fresh = DistributedOptimizer(optimizer_config(), [chunk], groups)
    fresh.load_full_state(full)
    result["reload_exact"] = all(
        torch.equal(old.master, new.master) and all(
            torch.equal(optimizer.optimizer.state[old.master][key], fresh.optimizer.state[new.master][key])
            for key in ("exp_avg", "exp_avg_sq"))
        for old, new in zip(optimizer.pieces, fresh.pieces))
    return result


def _unsharded_state_bytes() -> int:
    groups = single_process()
    model = GPTModel(model_config(), groups, device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    chunk = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(optimizer_config(), [chunk], groups)
    assert train_step(chunk, optimizer, groups, list(global_batches(1)[0]))[1]
    return optimizer.optimizer_state_bytes()


def _check(world_size, name, per_rank, model_overrides=()):
    results = scenario(world_size, name)
    reference = reference_run(per_rank * world_size // (2 if model_overrides else 1), model_overrides)
    for result in results:
        assert_matches_reference(result, reference)
        assert result["reload_exact"]
        for param_name, parts in result["full_masters"].items():
            for part, value in parts.items():
                torch.testing.assert_close(value, result["params"][param_name][part], rtol=0, atol=0)
    return results


def test_dp2_distributed_optimizer():
    _check(2, "distopt", 2)


def test_dp2_distributed_optimizer_overlap_param_gather():
    _check(2, "distopt overlap", 2)


def test_dp4_distributed_optimizer():
    _check(4, "distopt", 1)


def test_dp4_distributed_optimizer_overlap_param_gather():
    _check(4, "distopt overlap", 1)


def test_dp4_optimizer_state_is_one_over_dp():
    """Adam state per rank is 1/DP of the unsharded optimizer's, plus at most the bucket padding."""
    results = _check(4, "distopt", 1)
    unsharded = _unsharded_state_bytes()
    per_rank = [r["state_bytes"] for r in results]
    assert sum(per_rank) == unsharded
    bytes_per_element = 8  # fp32 exp_avg + exp_avg_sq (fp32 model: masters are the parameters)
    for result in results:
        assert result["state_bytes"] <= unsharded / 4 + result["padding"] * bytes_per_element


def test_dp2_tp2_distributed_optimizer():
    _check(4, "distopt tp2", 2, TP2_OVERRIDES)


# ---------------------------------------------------------------------------------------------
def _fp16_inf_run(use_distributed_optimizer):
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               overlap_grad_reduce=True, bucket_size=3000)
    groups, model, chunk, optimizer = build_parallel(1, ddp_config, fp16=True, initial_loss_scale=2.0 ** 16,
                                                     hysteresis=1)
    batches = global_batches(2 * groups.dp_size)
    outcomes = []
    for step in range(3):
        inject = step == 1 and groups.dp_rank == 1

        def poison(grad):  # an overflow in one rank's backward, before any bucket is reduced
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        # A norm weight: its gradient comes through autograd (the linears and the embedding
        # accumulate theirs into main_grad directly, with no gradient tensor to hook).
        norm_weight = next(p for p in chunk.params if p.ndim == 1)
        handle = norm_weight.register_hook(poison) if inject else None
        before = [p.detach().clone() for p in model.parameters()]
        scale_before = optimizer.loss_scale()
        _, applied, _ = train_step(chunk, optimizer, groups, my_micro_batches(batches[step], groups, 2))
        if handle is not None:
            handle.remove()
        chunk.finish_param_sync()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        outcomes.append((applied, unchanged, scale_before, optimizer.loss_scale()))
    return outcomes


def test_fp16_injected_inf_skips_step_on_every_rank():
    for name in ("fp16 inf distopt", "fp16 inf ddp"):
        outcomes_per_rank = scenario(2, name)
        for outcomes in outcomes_per_rank:
            assert [o[0] for o in outcomes] == [True, False, True], name
            assert [o[1] for o in outcomes] == [False, True, False], name
            assert outcomes[1][3] == outcomes[1][2] / 2  # the dynamic scale backs off
        assert outcomes_per_rank[0] == outcomes_per_rank[1]
