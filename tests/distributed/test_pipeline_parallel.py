"""Pipeline parallelism, alone and combined, against the single-process model: same losses, gradient
norms and gradients, fp32, gloo.

Every scenario trains 3 optimizer steps (AdamW, gradient clipping active) from the same seed as the
single-process reference and compares, step by step, the per-micro-batch losses (last stage), the
gradient norm, and every gradient after `finalize_model_grads`, gathered over TP (and DP for FSDP2)
and named by global layer number, with relative tolerance 1e-5 (norm of the difference over norm of
the reference). Both copies of a tied embedding are checked. A forward-only pass after training
checks the evaluation path. Scenarios cover both point-to-point modes (overlapped, the training
default, and blocking), one data iterator per rank and one per chunk, micro-batch groups, the
embedding/loss-aware split, and the data-parallel wrappers: DDP, the distributed optimizer with all
its overlaps, and FSDP2. Scenarios sharing a world size run in one spawn to keep process start-up
cost down; the 4-rank spawn also runs the fp16 skip and the memory measurements.
"""
import dataclasses

import torch

from megatron.core.distributed import comm
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.pipeline_parallel.layout import stage_layer_numbers, validate_pipeline
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import build_tracker
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig
from tests.distributed.harness import run_distributed
from tests.distributed.parity import assert_norm_is_the_full_gradients_norm

SEED, SEQ, MICRO_BATCH, HIDDEN, VOCAB, STEPS, RTOL, CLIP = 1234, 16, 2, 32, 128, 3, 1e-5, 0.05


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    pp: int
    layers: int = 4
    n: int = 4
    tp: int = 1
    dp: int = 1
    virtual: int = 1
    first: int = None
    last: int = None
    tied: bool = True
    sp: bool = False
    recompute: tuple = ()
    p2p: str = "overlap"            # "overlap" (the training default), "blocking" or "flush" (also warm-up/cool-down)
    shared_data: bool = True        # one data iterator per rank, else one per chunk
    group: int = None               # --microbatch-group-size-per-virtual-pipeline-stage
    account: tuple = (False, False)  # --account-for-embedding/loss-in-pipeline-split
    vocab: int = VOCAB
    wrapper: str = "ddp"            # "ddp", "ddp overlap", "distopt", "distopt all overlaps" or "fsdp"
    dtype: torch.dtype = torch.float32


FULL_UNIFORM = (("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1))
TWO_RANKS = [
    Scenario("pp2, blocking p2p, one iterator per chunk", pp=2, p2p="blocking", shared_data=False),
    Scenario("pp2 untied", pp=2, tied=False, n=3),
    Scenario("pp2 single micro-batch", pp=2, n=1),
    Scenario("pp2 uneven first=1", pp=2, first=1),
    Scenario("pp2 x vpp2, blocking p2p", pp=2, virtual=2, p2p="blocking"),
    Scenario("pp2 x vpp2 untied, N=P (all warm-up), one iterator per chunk", pp=2, virtual=2, n=2, tied=False,
             shared_data=False),
    Scenario("pp2 x vpp2, 8 layers, N=6, groups of 3, warm-up flush", pp=2, virtual=2, layers=8, n=6, group=3,
             p2p="flush"),
    Scenario("pp2 x vpp2, embedding and loss counted in the split (6 layers)", pp=2, virtual=2, layers=6,
             account=(True, True)),
    Scenario("pp2, embedding counted in the split (3 layers)", pp=2, layers=3, account=(True, False)),
    Scenario("pp2 recompute full uniform", pp=2, recompute=FULL_UNIFORM),
    Scenario("pp2 x vpp2 recompute full block", pp=2, virtual=2, layers=8,
             recompute=(("recompute_granularity", "full"), ("recompute_method", "block"), ("recompute_num_layers", 1))),
    Scenario("pp2 recompute selective", pp=2, tied=False, recompute=(("recompute_granularity", "selective"),)),
]

FOUR_RANKS = [
    Scenario("pp4", pp=4, n=6),
    Scenario("pp4 uneven first=1 last=1 untied, blocking p2p", pp=4, layers=8, first=1, last=1, tied=False,
             p2p="blocking"),
    Scenario("pp4 x vpp2", pp=4, virtual=2, layers=8, n=8),
    Scenario("pp4 x vpp2 N=P untied, blocking p2p", pp=4, virtual=2, layers=8, n=4, tied=False, p2p="blocking"),
    Scenario("pp2 x tp2 sequence parallel", pp=2, tp=2, sp=True),
    Scenario("pp2 x tp2 untied, recompute full", pp=2, tp=2, tied=False, n=3,
             recompute=(("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 2))),
    Scenario("pp2 x dp2", pp=2, dp=2, n=3),
    # Overlapped bucket reduction: correct only if the schedule keeps every backward of a chunk but
    # its last inside no_sync().
    Scenario("pp2 x dp2 overlapped grad reduce", pp=2, dp=2, n=3, wrapper="ddp overlap"),
    Scenario("pp2 x vpp2 x dp2 untied, overlapped grad reduce", pp=2, virtual=2, dp=2, n=2, tied=False,
             wrapper="ddp overlap"),
    # The distributed optimizer with tied embeddings on uneven stages and a vocabulary large against
    # the layers (the embedding dominates the gradient norm, which must count its two copies once).
    Scenario("pp2 x dp2 distributed optimizer, tied, uneven, large vocabulary", pp=2, dp=2, layers=3, first=1,
             vocab=1024, wrapper="distopt"),
    Scenario("fsdp2 x pp2 (x dp2), tied", pp=2, dp=2, n=3, wrapper="fsdp"),
]

EIGHT_RANKS = [
    Scenario("pp2 x vpp2 x tp2 x dp2 distributed optimizer, every overlap", pp=2, virtual=2, tp=2, dp=2, sp=True,
             wrapper="distopt all overlaps"),
]


def _model_config(scenario: Scenario, **overrides) -> TransformerConfig:
    values = dict(num_layers=scenario.layers, hidden_size=HIDDEN, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, padded_vocab_size=scenario.vocab, max_position_embeddings=SEQ,
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=not scenario.tied, hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return TransformerConfig(**values)


def _execution(scenario: Scenario) -> ExecutionConfig:
    return ExecutionConfig(sequence_parallel=scenario.sp, params_dtype=scenario.dtype, **dict(scenario.recompute))


def _micro_batches(step: int, dp_rank: int, n: int, vocab: int) -> list:
    batches = []
    for index in range(n):
        generator = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + index)
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            positions=torch.arange(SEQ).expand(MICRO_BATCH, SEQ)))
    return batches


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["positions"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()  # fp32 mean also for the bf16/fp16 runs (test_mixed_precision)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def optimizer_config(**overrides) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=CLIP, adam_eps=1e-4, **overrides)


def _reduced_grads(chunk) -> dict:
    """{param: its data-parallel-reduced gradient}. With the distributed optimizer a rank holds only
    its shard of each bucket reduced: the shards are gathered (into a copy of the buffer)."""
    if isinstance(chunk, FullyShardedDataParallel):
        return {p: p.grad.full_tensor() for p in chunk.params}  # gathered over data-parallel ranks
    grads = {}
    for buffer in chunk.buffers:
        data = buffer.grad_data
        if buffer.shard_over_dp:
            data = data.clone()
            for bucket in buffer.buckets:
                whole = data[bucket.start:bucket.end]
                comm.all_gather_into_tensor(whole, buffer.shard(bucket, buffer.grad_data).clone(), buffer.dp_group)
        for param in buffer.params:
            start, end = buffer.param_to_bucket[param].param_ranges[param]
            grads[param] = data[start:end].view(param.shape)
    return grads


def gathered_grads(chunks, groups) -> dict:
    """{global name[.part]: full gradient} of every parameter on this rank (collective over TP, DP)."""
    grads = {}
    for chunk in chunks:
        reduced = _reduced_grads(chunk)
        for name, param in chunk.module.named_parameters():
            full = param.tp_layout.local_to_full(reduced[param], groups.tp)
            for part, tensor in full.items():
                key = chunk.module.global_param_name(name) + (f".{part}" if part else "")
                grads[key] = tensor.clone()
    return grads


def _iterators(scenario: Scenario, step: int, dp_rank: int, num_chunks: int):
    batches = _micro_batches(step, dp_rank, scenario.n, scenario.vocab)
    return iter(batches) if scenario.shared_data else [iter(batches) for _ in range(num_chunks)]


def _schedule_options(scenario: Scenario) -> dict:
    return dict(overlap_p2p_comm=scenario.p2p != "blocking", overlap_p2p_comm_warmup_flush=scenario.p2p == "flush",
                microbatch_group_size=scenario.group)


def _train(scenario: Scenario, chunks, groups, optimizer, *, virtual, tensor_shape) -> dict:
    """STEPS optimizer steps, then a forward-only pass; returns per-step losses, norms and gradients."""
    schedule = get_forward_backward_func(groups.pp_size, virtual)
    common = dict(forward_step_func=_forward_step, model_chunks=chunks, num_microbatches=scenario.n, groups=groups,
                  scale_loss=optimizer.scale_loss, tensor_shape=tensor_shape, dtype=torch.float32,
                  **_schedule_options(scenario))
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        reported = schedule(data_iterator=_iterators(scenario, step, groups.dp_rank, len(chunks)), forward_only=False,
                            **common)
        finalize_model_grads(chunks, groups)
        losses.append([r["lm loss"].item() for r in reported])
        grads.append(gathered_grads(chunks, groups))
        applied, norm = optimizer.step()
        assert applied
        norms.append(norm)
    with torch.no_grad():
        evaluated = [r["lm loss"].item() for r in schedule(
            data_iterator=_iterators(scenario, STEPS, groups.dp_rank, len(chunks)), forward_only=True, **common)]
    return dict(losses=losses, grads=grads, norms=norms, eval=evaluated)


def _layout(scenario: Scenario, groups) -> tuple:
    split = dict(first_stage_layers=scenario.first, last_stage_layers=scenario.last,
                 account_for_embedding=scenario.account[0], account_for_loss=scenario.account[1])
    virtual = validate_pipeline(scenario.layers, scenario.pp,
                                num_virtual_stages_per_rank=scenario.virtual if scenario.pp > 1 else None,
                                num_microbatches=scenario.n, microbatch_group_size=scenario.group, **split)
    return virtual, stage_layer_numbers(scenario.layers, scenario.pp, groups.pp_rank, virtual_size=virtual, **split)


def _wrap(scenario: Scenario, model: GPTModel, groups, virtual: int):
    if scenario.wrapper == "fsdp":
        return FullyShardedDataParallel(model, groups, init_seed=SEED)
    model.initialize_parameters(SEED)
    overlap = scenario.wrapper in ("ddp overlap", "distopt all overlaps")
    all_overlaps = scenario.wrapper == "distopt all overlaps"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=scenario.wrapper.startswith("distopt"), overlap_grad_reduce=overlap,
        overlap_param_gather=all_overlaps, overlap_param_gather_with_optimizer_step=all_overlaps and virtual > 1,
        bucket_size=2000 if overlap else None)
    return DistributedDataParallel(model, groups, ddp_config=ddp_config)


def build_chunks(scenario: Scenario, groups) -> tuple:
    """This rank's wrapped model chunks, from the same seed as the single-process model."""
    virtual, layer_lists = _layout(scenario, groups)
    tracker = build_tracker(SEED, groups.tp_rank, groups.pp_rank, groups.device)
    device = torch.device("meta") if scenario.wrapper == "fsdp" else groups.device
    chunks = []
    for index, layers in enumerate(layer_lists):
        model = GPTModel(_model_config(scenario), groups, execution=_execution(scenario), rng_tracker=tracker,
                         pre_process=groups.is_first_stage and index == 0,
                         post_process=groups.is_last_stage and index == virtual - 1, layer_numbers=layers,
                         device=device)
        chunks.append(_wrap(scenario, model, groups, virtual))
    return virtual, layer_lists, chunks


def _activation_shape(scenario: Scenario) -> tuple:
    return (SEQ // scenario.tp if scenario.sp else SEQ, MICRO_BATCH, HIDDEN)


def _run_scenario(scenario: Scenario) -> dict:
    groups = initialize_model_parallel(scenario.tp, scenario.pp)
    virtual, layer_lists, chunks = build_chunks(scenario, groups)
    optimizer = get_megatron_optimizer(optimizer_config(), chunks, groups)
    result = _train(scenario, chunks, groups, optimizer, virtual=virtual, tensor_shape=_activation_shape(scenario))
    return dict(result, tp_rank=groups.tp_rank, dp_rank=groups.dp_rank, pp_rank=groups.pp_rank,
                layers=layer_lists, last_stage=groups.is_last_stage)


def _run_all(rank, world_size, scenarios, extras):
    """Every scenario on every rank, then the extra checks of this world size; rank 0 also computes
    the single-process references (here, in a one-thread worker, rather than in the test process,
    whose threads compete for the cores)."""
    results = [_run_scenario(scenario) for scenario in scenarios]
    extra_results = {name: function() for name, function in extras}
    references = {}
    if rank == 0:
        for scenario in scenarios:
            key = _reference_key(scenario)
            if key not in references:
                references[key] = _reference(scenario)
    return results, references, extra_results


def _reference_key(scenario: Scenario) -> tuple:
    return scenario.layers, scenario.tied, scenario.dp, scenario.n, scenario.vocab


def _reference(scenario: Scenario) -> dict:
    """The single-process model on all dp x n micro-batches of each step, from the same seed."""
    groups = single_process()
    reference = dataclasses.replace(scenario, sp=False, recompute=(), pp=1, tp=1, virtual=1, first=None, last=None,
                                    account=(False, False), wrapper="ddp", shared_data=True)
    config = _model_config(reference)
    model = GPTModel(config, groups, execution=_execution(reference), rng_tracker=build_tracker(SEED, 0, 0, groups.device))
    model.initialize_parameters(SEED)
    chunks = [DistributedDataParallel(model, groups)]
    schedule = get_forward_backward_func(1)
    optimizer = get_megatron_optimizer(optimizer_config(), chunks, groups)
    dp, n = scenario.dp, scenario.n

    def all_ranks(step):
        return iter([b for d in range(dp) for b in _micro_batches(step, d, n, scenario.vocab)])

    common = dict(forward_step_func=_forward_step, model_chunks=chunks, num_microbatches=dp * n, groups=groups,
                  scale_loss=optimizer.scale_loss)
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        chunks[0].zero_grad_buffer()
        reported = schedule(data_iterator=all_ranks(step), forward_only=False, **common)
        finalize_model_grads(chunks, groups)
        losses.append([r["lm loss"].item() for r in reported])
        grads.append(gathered_grads(chunks, groups))
        norms.append(optimizer.step()[1])
    with torch.no_grad():
        evaluated = [r["lm loss"].item() for r in schedule(data_iterator=all_ranks(STEPS), forward_only=True,
                                                            **common)]
    return dict(losses=losses, grads=grads, norms=norms, eval=evaluated)


def _close(actual: float, expected: float) -> bool:
    return abs(actual - expected) <= RTOL * abs(expected)


def _check(scenario: Scenario, ranks: list, reference: dict) -> None:
    name, n = scenario.name, scenario.n
    assert all(norm > CLIP for norm in reference["norms"]), (name, "clipping must be active")
    seen = set()
    for result in ranks:
        d = result["dp_rank"]
        assert all(map(_close, result["norms"], reference["norms"])), (name, result["norms"], reference["norms"])
        if result["last_stage"]:
            for step in range(STEPS):
                expected = reference["losses"][step][d * n:(d + 1) * n]
                assert len(result["losses"][step]) == n, (name, step)
                assert all(map(_close, result["losses"][step], expected)), (name, step, result["losses"][step],
                                                                            expected)
            assert all(map(_close, result["eval"], reference["eval"][d * n:(d + 1) * n])), (name, "forward only")
        else:
            assert result["losses"] == [[]] * STEPS and result["eval"] == [], (name, "losses off the last stage")
        for step in range(STEPS):
            for key, grad in result["grads"][step].items():
                expected = reference["grads"][step][key]
                error = (grad - expected).norm() / expected.norm()
                assert error <= RTOL, (name, step, key, result["pp_rank"], error.item())
                seen.add(key)
    assert seen == set(reference["grads"][0]), (name, "parameters not covered", set(reference["grads"][0]) ^ seen)
    for step in range(STEPS):
        for result in ranks:
            assert_norm_is_the_full_gradients_norm(result["norms"][step], [r["grads"][step] for r in ranks],
                                                   (name, step, result["pp_rank"]))


def run_and_check(world_size: int, scenarios: list, extras: tuple = ()) -> dict:
    """Runs the scenarios and extra checks in one spawn, checks the scenarios; returns each extra
    check's per-rank results."""
    per_rank = run_distributed(world_size, _run_all, scenarios, extras)
    references = per_rank[0][1]
    for index, scenario in enumerate(scenarios):
        assert world_size == scenario.tp * scenario.pp * scenario.dp
        _check(scenario, [results[index] for results, _, _ in per_rank], references[_reference_key(scenario)])
    return {name: [extra[name] for _, _, extra in per_rank] for name, _ in extras}


def test_pipeline_parity_two_ranks():
    run_and_check(2, TWO_RANKS)


# ---------------------------------------------------------------------------------------------
# Extra checks of the 4-rank spawn.

def fp16_inf_skips_on_every_stage() -> list:
    """PP2 x DP2, fp16, distributed optimizer with overlapped reduction and gathers, overlapped p2p:
    an inf in one rank's gradient (stage 0, data rank 1) at step 1 must skip that step on every rank
    of every stage, leave every parameter unchanged, and halve the loss scale everywhere."""
    scenario = Scenario("fp16", pp=2, dp=2, n=2, wrapper="distopt all overlaps", dtype=torch.float16)
    groups = initialize_model_parallel(1, 2)
    virtual, _, chunks = build_chunks(scenario, groups)
    optimizer = get_megatron_optimizer(optimizer_config(fp16=True, initial_loss_scale=2.0 ** 16, hysteresis=1),
                                       chunks, groups)
    schedule = get_forward_backward_func(groups.pp_size, virtual)
    outcomes = []
    for step in range(STEPS):
        handle = None
        if step == 1 and groups.pp_rank == 0 and groups.dp_rank == 1:
            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad
            # A norm weight: its gradient comes through autograd (the linears and the embedding
            # accumulate straight into main_grad with gradient-accumulation fusion).
            handle = next(p for p in chunks[0].params if p.ndim == 1).register_hook(poison)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        schedule(forward_step_func=_forward_step, data_iterator=_iterators(scenario, step, groups.dp_rank, 1),
                 model_chunks=chunks, num_microbatches=scenario.n, groups=groups, scale_loss=optimizer.scale_loss,
                 tensor_shape=_activation_shape(scenario), dtype=torch.float16, overlap_p2p_comm=True)
        finalize_model_grads(chunks, groups)
        before = [p.detach().clone() for c in chunks for p in c.module.parameters()]
        scale = optimizer.loss_scale()
        applied, _ = optimizer.step()
        for chunk in chunks:
            chunk.finish_param_sync()
        if handle is not None:
            handle.remove()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, (p for c in chunks for p in c.module.parameters())))
        outcomes.append((applied, unchanged, scale, optimizer.loss_scale()))
    return outcomes


def pipeline_live_bytes() -> dict:
    """Peak bytes the schedule holds on each rank during one step's forward and backward (1F1B at
    PP4, interleaved at PP4 x VPP2, N=8), keeping sent outputs against freeing them, and whether
    the gradients are identical either way."""
    from megatron.training.memory import LiveTensorBytes

    measured = {}
    for scenario in (Scenario("pp4", pp=4, n=8), Scenario("pp4 x vpp2", pp=4, virtual=2, layers=8, n=8)):
        groups = initialize_model_parallel(1, 4)
        virtual, _, chunks = build_chunks(scenario, groups)
        schedule = get_forward_backward_func(groups.pp_size, virtual)
        peaks, grads = {}, {}
        for deallocate in (False, True):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            with LiveTensorBytes() as counter:
                schedule(forward_step_func=_forward_step, data_iterator=_iterators(scenario, 0, 0, len(chunks)),
                         model_chunks=chunks, num_microbatches=scenario.n, groups=groups,
                         tensor_shape=_activation_shape(scenario), dtype=torch.float32, overlap_p2p_comm=True,
                         deallocate_pipeline_outputs=deallocate)
            peaks[deallocate] = counter.peak
            grads[deallocate] = [p.main_grad.clone() for c in chunks for p in c.params]
        measured[scenario.name] = dict(kept=peaks[False], freed=peaks[True],
                                       same_grads=all(map(torch.equal, grads[False], grads[True])))
    return measured


def test_pipeline_parity_four_ranks():
    extras = run_and_check(4, FOUR_RANKS, (("fp16", fp16_inf_skips_on_every_stage),
                                           ("memory", pipeline_live_bytes)))
    outcomes = extras["fp16"]
    for rank_outcomes in outcomes:
        assert [o[0] for o in rank_outcomes] == [True, False, True]
        assert [o[1] for o in rank_outcomes] == [False, True, False]
        assert rank_outcomes[1][3] == rank_outcomes[1][2] / 2  # the dynamic scale backs off
    assert all(rank_outcomes == outcomes[0] for rank_outcomes in outcomes)
    # Freeing sent outputs saves, at the peak (the end of the warm-up), every output then in flight:
    # the warm-up's P - r - 1 micro-batches in 1F1B, 2(P - r - 1) + (V - 1)P chunk-micro-batches
    # interleaved, less the one element each freed output keeps. Gradients are unchanged.
    output_bytes = SEQ * MICRO_BATCH * HIDDEN * 4
    for rank, measured in enumerate(extras["memory"]):
        for name, in_flight in (("pp4", 4 - rank - 1), ("pp4 x vpp2", 2 * (4 - rank - 1) + 4)):
            saved = measured[name]["kept"] - measured[name]["freed"]
            assert abs(saved - in_flight * output_bytes) <= 4 * (in_flight + 1), (rank, name, measured)
        assert all(m["same_grads"] for m in measured.values())


def test_pipeline_parity_eight_ranks_every_overlap():
    run_and_check(8, EIGHT_RANKS)
