"""Multi-token prediction under tensor parallelism (2 ranks, with and without sequence parallelism)
and pipeline parallelism (2 stages, the modules on the last one with its copy of the embedding;
also interleaved, the modules on the last virtual stage), and data parallelism with overlapped
gradient reduction, equals the single-process model: 3 optimizer steps through the real schedules and pretrain_gpt's
forward step and loss (lm loss + factor / D * the depths' losses), compared step by step: the lm and
mtp_k losses of every micro-batch, the gradient norm, and every gradient (both copies of the
embedding on the two stages) with relative tolerance 1e-5, as tests/distributed/test_pipeline_parallel.py
compares them."""
import torch

from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.pipeline_parallel.layout import stage_layer_numbers
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import build_tracker
from megatron.core.transformer.config import ExecutionConfig
from pretrain_gpt import forward_step
from tests.distributed.harness import run_distributed
from tests.distributed.parity import gather_full_grads, llama_config

SEED, SEQ, MICRO_BATCH, MICRO_BATCHES, STEPS, RTOL, DEPTHS = 1234, 16, 2, 3, 3, 1e-5, 2
CASES = [  # (name, tp, pp, sequence parallel, tied embeddings[, virtual stages]); the rest of the 2 ranks
    ("tp2 sp untied", 2, 1, True, False),            # are data-parallel
    ("tp2 tied", 2, 1, False, True),
    ("pp2 tied", 1, 2, False, True),
    ("pp2 untied", 1, 2, False, False),
    ("pp2 x vpp2 untied (the modules on the last virtual stage)", 1, 2, False, False, 2),
    # Overlapped reduction in small buckets: a bucket starts reducing when its gradients are marked
    # ready, so the embedding (looked up by every depth) and the output layer (used by every depth)
    # must be marked only after their last use in backward.
    ("dp2 overlapped grad reduce, tied", 1, 1, False, True),
]


def _config(tied: bool, virtual: int = 1):
    return llama_config(num_layers=2 * virtual, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.5,
                        untie_embeddings_and_output_weights=not tied)


def _micro_batches(step: int, dp_rank: int = 0, dp_size: int = 1) -> list:
    """This data-parallel rank's share of the step's 2 x MICRO_BATCHES micro-batches (all of them at dp 1)."""
    batches = []
    count = MICRO_BATCHES * (2 // dp_size)
    for index in range(dp_rank * count, (dp_rank + 1) * count):
        generator = torch.Generator().manual_seed(100 * step + index)
        tokens = torch.randint(0, 128, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            loss_mask=(torch.rand(MICRO_BATCH, SEQ, generator=generator) > 0.2).float(),
                            position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ)))
    return batches


def _train(groups, tied: bool, sequence_parallel: bool, virtual: int = 1) -> dict:
    """STEPS optimizer steps of this rank's model chunks (one per virtual stage)."""
    config = _config(tied, virtual)
    virtual = virtual if groups.pp_size > 1 else 1
    layer_lists = stage_layer_numbers(config.num_layers, groups.pp_size, groups.pp_rank, virtual_size=virtual)
    tracker = build_tracker(SEED, groups.tp_rank, groups.pp_rank, groups.device)
    overlap = groups.dp_size > 1
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=3000 if overlap else None)
    models, chunks = [], []
    for index, layers in enumerate(layer_lists):
        model = GPTModel(config, groups, execution=ExecutionConfig(sequence_parallel=sequence_parallel),
                         rng_tracker=tracker, pre_process=groups.is_first_stage and index == 0,
                         post_process=groups.is_last_stage and index == virtual - 1, layer_numbers=layers)
        model.initialize_parameters(SEED)
        models.append(model)
        chunks.append(DistributedDataParallel(model, groups, ddp_config=ddp_config))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=0.05, adam_eps=1e-4), chunks, groups)
    schedule = get_forward_backward_func(groups.pp_size, virtual)
    seq = SEQ // groups.tp_size if sequence_parallel and groups.tp_size > 1 else SEQ
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        batches = _micro_batches(step, groups.dp_rank, groups.dp_size)
        reported = schedule(forward_step_func=forward_step, data_iterator=iter(batches),
                            model_chunks=chunks, num_microbatches=len(batches), groups=groups, forward_only=False,
                            scale_loss=optimizer.scale_loss, tensor_shape=(seq, MICRO_BATCH, 64), dtype=torch.float32)
        finalize_model_grads(chunks, groups)
        losses.append([{name: value[0].item() / value[1].item() for name, value in r.items()} for r in reported])
        grads.append({f"{name}.{part}": grad for model in models
                      for name, parts in gather_full_grads(model, groups).items() for part, grad in parts.items()})
        applied, norm = optimizer.step()
        assert applied
        norms.append(norm)
    return dict(losses=losses, grads=grads, norms=norms, has_mtp=[model.mtp is not None for model in models],
                last_stage=groups.is_last_stage, dp_rank=groups.dp_rank)


def _check(name: str, run: dict, reference: dict) -> None:
    expected_mtp = [False] * (len(run["has_mtp"]) - 1) + [run["last_stage"]]
    assert run["has_mtp"] == expected_mtp, (name, "the prediction modules belong on the last (virtual) stage")
    for step in range(STEPS):
        assert abs(run["norms"][step] - reference["norms"][step]) <= RTOL * reference["norms"][step], (name, step)
        if run["last_stage"]:
            assert set(run["losses"][step][0]) == {"lm loss", "mtp_1 loss", "mtp_2 loss"}, name
            mine = reference["losses"][step][run["dp_rank"] * len(run["losses"][step]):]
            for got, want in zip(run["losses"][step], mine, strict=False):
                for key in want:
                    assert abs(got[key] - want[key]) <= RTOL * abs(want[key]), (name, step, key, got, want)
        for key, grad in run["grads"][step].items():
            expected = reference["grads"][step][key]
            error = ((grad - expected).norm() / expected.norm()).item()
            assert error <= RTOL, (name, step, key, error)


def _run_cases(rank, world_size):
    references = {}
    for name, tp, pp, sequence_parallel, tied, *virtual in CASES:
        virtual = virtual[0] if virtual else 1
        if (tied, virtual) not in references:
            references[(tied, virtual)] = _train(single_process(), tied, False, virtual)
        groups = initialize_model_parallel(tp, pp)
        run = _train(groups, tied, sequence_parallel, virtual)
        reference = references[(tied, virtual)]
        _check(name, run, reference)
        if groups.pp_size > 1:  # the two stages' gradients together cover every parameter
            covered = [None] * world_size
            torch.distributed.all_gather_object(covered, set(run["grads"][0]))
            assert set().union(*covered) == set(reference["grads"][0]), name
    return True


def test_mtp_tp2_sp_and_pp2_match_one_process():
    """One spawn for the four layouts (process start-up dominates)."""
    assert all(run_distributed(2, _run_cases))
