"""Pipeline parallelism against the single-process model: same losses and gradients, fp32, gloo.

Every scenario trains 3 optimizer steps (AdamW, gradient clipping) from the same seed as the
single-process reference and compares, step by step, the per-micro-batch losses (last stage) and
every gradient after `finalize_model_grads`, gathered over TP and named by global layer number,
with relative tolerance 1e-5 (norm of the difference over norm of the reference). Both copies of a
tied embedding are checked. A forward-only pass after training checks the evaluation path.
Scenarios sharing a world size run in one spawn to keep process start-up cost down.
"""
import torch

from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.pipeline_parallel.layout import stage_layer_numbers, validate_pipeline
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import build_tracker
from megatron.core.transformer.config import TransformerConfig
from tests.distributed.harness import run_distributed

SEED, SEQ, MICRO_BATCH, HIDDEN, VOCAB, STEPS, RTOL = 1234, 16, 2, 32, 128, 3, 1e-5


def _scenario(name, *, pp, layers=4, n=4, tp=1, dp=1, virtual=1, first=None, last=None, tied=True, sp=False,
              recompute=None, overlap=False):
    return dict(name=name, pp=pp, layers=layers, n=n, tp=tp, dp=dp, virtual=virtual, first=first, last=last,
                tied=tied, sp=sp, recompute=recompute or {}, overlap=overlap)


TWO_RANKS = [
    _scenario("pp2", pp=2),
    _scenario("pp2 untied", pp=2, tied=False, n=3),
    _scenario("pp2 single micro-batch", pp=2, n=1),
    _scenario("pp2 uneven first=1", pp=2, first=1),
    _scenario("pp2 x vpp2", pp=2, virtual=2),
    _scenario("pp2 x vpp2 untied, N=P (all warm-up)", pp=2, virtual=2, n=2, tied=False),
    _scenario("pp2 x vpp2, 8 layers, N=6", pp=2, virtual=2, layers=8, n=6),
    _scenario("pp2 recompute full uniform", pp=2, recompute=dict(recompute_granularity="full",
                                                                 recompute_method="uniform", recompute_num_layers=1)),
    _scenario("pp2 x vpp2 recompute full block", pp=2, virtual=2, layers=8,
              recompute=dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)),
    _scenario("pp2 recompute selective", pp=2, tied=False, recompute=dict(recompute_granularity="selective")),
]

FOUR_RANKS = [
    _scenario("pp4", pp=4, n=6),
    _scenario("pp4 uneven first=1 last=1 untied", pp=4, layers=8, first=1, last=1, tied=False),
    _scenario("pp4 x vpp2", pp=4, virtual=2, layers=8, n=8),
    _scenario("pp4 x vpp2 N=P untied", pp=4, virtual=2, layers=8, n=4, tied=False),
    _scenario("pp2 x tp2 sequence parallel", pp=2, tp=2, sp=True),
    _scenario("pp2 x tp2 untied, recompute full", pp=2, tp=2, tied=False, n=3,
              recompute=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)),
    _scenario("pp2 x dp2", pp=2, dp=2, n=3),
    # Overlapped bucket reduction: correct only if the schedule keeps every backward of a chunk but
    # its last inside no_sync().
    _scenario("pp2 x dp2 overlapped grad reduce", pp=2, dp=2, n=3, overlap=True),
    _scenario("pp2 x vpp2 x dp2 untied, overlapped grad reduce", pp=2, virtual=2, dp=2, n=2, tied=False,
              overlap=True),
]


def _model_config(scenario) -> TransformerConfig:
    return TransformerConfig(
        num_layers=scenario["layers"], hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, normalization="RMSNorm", gated_linear_unit=True,
        activation="silu", add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=not scenario["tied"], hidden_dropout=0.0, attention_dropout=0.0,
        sequence_parallel=scenario["sp"], **scenario["recompute"])


def _micro_batches(step: int, dp_rank: int, n: int) -> list:
    batches = []
    for index in range(n):
        generator = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + index)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            positions=torch.arange(SEQ).expand(MICRO_BATCH, SEQ)))
    return batches


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["positions"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _optimizer(chunks, groups):
    return get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0), chunks, groups)


def _gathered_grads(chunks, groups) -> dict:
    """{global name[.part]: full gradient} of every parameter on this rank (collective over TP)."""
    grads = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            full = param.tp_layout.local_to_full(param.main_grad, groups.tp)
            for part, tensor in full.items():
                key = chunk.module.global_param_name(name) + (f".{part}" if part else "")
                grads[key] = tensor.clone()
    return grads


def _train(chunks, groups, optimizer, *, n, virtual, tensor_shape) -> dict:
    """STEPS optimizer steps, then a forward-only pass; returns per-step losses and gradients."""
    schedule = get_forward_backward_func(groups.pp_size, virtual)
    common = dict(forward_step_func=_forward_step, model_chunks=chunks, num_microbatches=n, groups=groups,
                  scale_loss=optimizer.scale_loss, tensor_shape=tensor_shape, dtype=torch.float32)
    losses, grads = [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        iterators = [iter(_micro_batches(step, groups.dp_rank, n)) for _ in chunks]
        reported = schedule(data_iterator=iterators, forward_only=False, **common)
        finalize_model_grads(chunks, groups)
        losses.append([r["lm loss"].item() for r in reported])
        grads.append(_gathered_grads(chunks, groups))
        optimizer.step()
    iterators = [iter(_micro_batches(STEPS, groups.dp_rank, n)) for _ in chunks]
    with torch.no_grad():
        evaluated = [r["lm loss"].item() for r in schedule(data_iterator=iterators, forward_only=True, **common)]
    return dict(losses=losses, grads=grads, eval=evaluated)


def _run_scenario(scenario) -> dict:
    tp, pp = scenario["tp"], scenario["pp"]
    groups = initialize_model_parallel(tp, pp)
    config = _model_config(scenario)
    virtual = validate_pipeline(scenario["layers"], pp, num_virtual_stages_per_rank=scenario["virtual"],
                                first_stage_layers=scenario["first"], last_stage_layers=scenario["last"],
                                num_microbatches=scenario["n"])
    layer_lists = stage_layer_numbers(scenario["layers"], pp, groups.pp_rank, virtual_size=virtual,
                                      first_stage_layers=scenario["first"], last_stage_layers=scenario["last"])
    tracker = build_tracker(SEED, groups.tp_rank, groups.pp_rank, groups.device)
    chunks = []
    for index, layers in enumerate(layer_lists):
        model = GPTModel(config, groups, rng_tracker=tracker, pre_process=groups.is_first_stage and index == 0,
                         post_process=groups.is_last_stage and index == virtual - 1, layer_numbers=layers,
                         device=groups.device)
        model.initialize_parameters(SEED)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=scenario["overlap"],
                                                   bucket_size=2000 if scenario["overlap"] else None)
        chunks.append(DistributedDataParallel(model, groups, ddp_config=ddp_config))
    seq = SEQ // tp if scenario["sp"] else SEQ
    result = _train(chunks, groups, _optimizer(chunks, groups), n=scenario["n"], virtual=virtual,
                    tensor_shape=(seq, MICRO_BATCH, HIDDEN))
    return dict(result, tp_rank=groups.tp_rank, dp_rank=groups.dp_rank, pp_rank=groups.pp_rank,
                layers=layer_lists, last_stage=groups.is_last_stage)


def _run_all(rank, world_size, scenarios):
    """Every scenario on every rank; rank 0 also computes the single-process references (here, in a
    one-thread worker, rather than in the test process, whose threads compete for the cores)."""
    results = [_run_scenario(scenario) for scenario in scenarios]
    references = {}
    if rank == 0:
        for scenario in scenarios:
            key = _reference_key(scenario)
            if key not in references:
                references[key] = _reference(scenario)
    return results, references


def _reference_key(scenario) -> tuple:
    return scenario["layers"], scenario["tied"], scenario["dp"], scenario["n"]


def _reference(scenario) -> dict:
    """The single-process model on all dp x n micro-batches of each step, from the same seed."""
    groups = single_process()
    config = _model_config(dict(scenario, sp=False, recompute={}))
    model = GPTModel(config, groups, rng_tracker=build_tracker(SEED, 0, 0, groups.device))
    model.initialize_parameters(SEED)
    chunks = [DistributedDataParallel(model, groups)]
    dp, n = scenario["dp"], scenario["n"]

    class _AllRanks:
        """Serves the micro-batches of every data-parallel rank, rank by rank."""
        def __init__(self, step):
            self.batches = iter([b for d in range(dp) for b in _micro_batches(step, d, n)])

        def __next__(self):
            return next(self.batches)

    schedule = get_forward_backward_func(1)
    optimizer = _optimizer(chunks, groups)
    common = dict(forward_step_func=_forward_step, model_chunks=chunks, num_microbatches=dp * n, groups=groups,
                  scale_loss=optimizer.scale_loss)
    losses, grads = [], []
    for step in range(STEPS):
        chunks[0].zero_grad_buffer()
        reported = schedule(data_iterator=[_AllRanks(step)], forward_only=False, **common)
        finalize_model_grads(chunks, groups)
        losses.append([r["lm loss"].item() for r in reported])
        grads.append(_gathered_grads(chunks, groups))
        optimizer.step()
    with torch.no_grad():
        evaluated = [r["lm loss"].item() for r in schedule(data_iterator=[_AllRanks(STEPS)], forward_only=True,
                                                           **common)]
    return dict(losses=losses, grads=grads, eval=evaluated)


def _close(actual: float, expected: float) -> bool:
    return abs(actual - expected) <= RTOL * abs(expected)


def _check(scenario, ranks: list, reference: dict) -> None:
    name, n = scenario["name"], scenario["n"]
    seen = set()
    for result in ranks:
        d = result["dp_rank"]
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


def _run_and_check(world_size: int, scenarios: list) -> None:
    per_rank = run_distributed(world_size, _run_all, scenarios)
    references = per_rank[0][1]
    for index, scenario in enumerate(scenarios):
        assert world_size == scenario["tp"] * scenario["pp"] * scenario["dp"]
        _check(scenario, [results[index] for results, _ in per_rank], references[_reference_key(scenario)])


def test_pipeline_parity_two_ranks():
    _run_and_check(2, TWO_RANKS)


def test_pipeline_parity_four_ranks():
    _run_and_check(4, FOUR_RANKS)

