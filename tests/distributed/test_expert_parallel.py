"""Expert parallelism: parity with one process running the same global batch (gloo, fp32, no token
dropping). A tiny MoE model (both layers mixtures of 4 experts, top-2, load-balancing and z losses
on) trains 3 AdamW steps with clipping active; losses and gradient norms must equal the
single-process run at rtol 1e-5, for EP2 and EP4 (both dispatchers), EP1 x ETP2 and EP2 x TP2 with
sequence parallelism (expert-tensor-parallel sizes 1 and 2), EP2 with the distributed optimizer,
EP2 with --overlap-grad-reduce, and --moe-grouped-wgrad per-expert at EP2 and EP2 x TP2 (against
the reference's grouped weight gradients); then the options that change what is summed over ranks (biases,
shared experts) crossed with the layouts where that sum happens (OPTIONS). The reference is
gradient accumulation over all micro-batches; each parallel rank takes its data-parallel share of
them. tests/unit/test_expert_layouts_in_threads.py checks one MoE layer at these layouts in seconds.
"""
import contextlib
import functools

import pytest
import torch

from megatron.core.distributed import comm
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.pipeline_parallel.schedules import set_moe_aux_loss_scale
from megatron.core.transformer.config import DEFAULT_EXECUTION, ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.moe.router import finish_moe_step
from tests.distributed.harness import run_distributed

SEED, STEPS, MICRO_BATCH, SEQ, VOCAB, PER_RANK = 1234, 3, 2, 16, 128, 2
CLIP, RTOL = 0.05, 1e-5


def model_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB, ffn_hidden_size=64,
                  max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                  normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                  moe_z_loss_coeff=0.001, init_method_std=0.1)
    values.update(overrides)
    return derive(TransformerConfig(**values))


def global_batches(num_microbatches: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB, (STEPS, num_microbatches, MICRO_BATCH, SEQ + 1), generator=generator)


def train(groups, config, ddp_config=None, dp_size=1, dp_rank=0, execution=DEFAULT_EXECUTION) -> dict:
    model = GPTModel(config, groups, execution=execution)
    model.initialize_parameters(SEED)
    chunk = DistributedDataParallel(model, groups, ddp_config=ddp_config or DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=CLIP, adam_eps=1e-4),
                                       [chunk], groups)
    batches = global_batches(PER_RANK * dp_size)
    losses, norms = [], []
    for step in range(STEPS):
        micro_batches = batches[step][dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK] if dp_size > 1 else batches[step]
        chunk.zero_grad_buffer()
        total = torch.zeros(1, dtype=torch.float64)
        for index, tokens in enumerate(micro_batches):
            set_moe_aux_loss_scale(chunk, lambda loss: loss, groups.cp_size, len(micro_batches))
            positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)
            with contextlib.nullcontext() if index == len(micro_batches) - 1 else chunk.no_sync():
                loss = chunk(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean()
                (loss / len(micro_batches)).backward()
            total += loss.detach().double() / len(micro_batches)
        finalize_model_grads([chunk], groups)
        finish_moe_step([chunk], groups)
        applied, norm = optimizer.step()
        assert applied
        comm.all_reduce(total, groups.dp)
        losses.append(total.item() / groups.dp_size)
        norms.append(norm)
    return dict(losses=losses, norms=norms)


@functools.lru_cache(maxsize=None)
def reference(dp_size: int, overrides: tuple = ()) -> dict:
    """One process, all data-parallel shares of each step as gradient accumulation."""
    global PER_RANK
    result = train(single_process(), model_config(**dict(overrides)), dp_size=1) if dp_size == 1 else None
    if result is not None:
        return result
    saved, PER_RANK = PER_RANK, PER_RANK * dp_size
    try:
        return train(single_process(), model_config(**dict(overrides)))
    finally:
        PER_RANK = saved


EXECUTION_KEYS = ("moe_grouped_wgrad",)  # overrides of how the model runs (ExecutionConfig), not what it is


def _parallel(tp: int, ep: int, etp=None, overrides: tuple = (), distributed_optimizer=False, overlap=False) -> dict:
    groups = initialize_model_parallel(tp, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    config = model_config(**{key: value for key, value in overrides if key not in EXECUTION_KEYS})
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None)
    execution = {key: value for key, value in overrides if key in EXECUTION_KEYS}
    return train(groups, config, ddp_config, dp_size=groups.dp_size, dp_rank=groups.dp_rank,
                 execution=ExecutionConfig(sequence_parallel=tp > 1, **execution))


ALLGATHER = (("moe_token_dispatcher_type", "allgather"),)
ALLTOALL = (("moe_token_dispatcher_type", "alltoall"),)
# --moe-grouped-wgrad per-expert: each local expert's weight gradient its own GEMM into main_grad,
# the counts (after the exchange at EP > 1) copied to the host in forward
PER_EXPERT = (("moe_grouped_wgrad", "per-expert"),)
LAYOUTS = {
    2: {"ep2 alltoall": (1, 2, None, ALLTOALL, False, False),
        "ep2 allgather": (1, 2, None, ALLGATHER, False, False),
        "ep2 distributed optimizer": (1, 2, None, ALLTOALL, True, False),
        "ep2 overlap grad reduce": (1, 2, None, ALLTOALL, False, True),
        "ep1 dp2": (1, 1, None, ALLTOALL, False, False),
        "ep1 tp2 sp etp2 alltoall": (2, 1, 2, ALLTOALL, False, False),
        "ep1 tp2 sp etp2 allgather": (2, 1, 2, ALLGATHER, False, False),
        "ep2 alltoall per-expert wgrad": (1, 2, None, ALLTOALL + PER_EXPERT, False, False)},
    4: {"ep4 alltoall": (1, 4, None, ALLTOALL, False, False),
        "ep4 allgather": (1, 4, None, ALLGATHER, False, False),
        "ep2 tp2 sp etp1 alltoall": (2, 2, 1, ALLTOALL, False, False),
        "ep2 tp2 sp etp2 alltoall": (2, 2, 2, ALLTOALL, False, False),
        "ep2 tp2 sp etp2 allgather": (2, 2, 2, ALLGATHER, False, False),
        "ep2 tp2 sp etp1 distributed optimizer": (2, 2, 1, ALLGATHER, True, False),
        "ep2 tp2 sp etp2 allgather per-expert wgrad": (2, 2, 2, ALLGATHER + PER_EXPERT, False, False)},
}
# Options that change what is summed over the ranks, each crossed with the layouts where that sum
# happens: biases (fc2's bias is added on one expert-tensor-parallel rank only and its gradient summed
# over them) with every etp2 layout; shared experts (a tensor-parallel MLP beside the routed ones,
# independent of the expert layout) with the cheapest tp2 layouts, one per dispatcher. Token dropping
# is left out: the capacity is per rank's tokens, so it depends on the layout by definition
# (Megatron-Core's rule); tests/unit/test_moe_router.py checks it against Megatron-Core.
OPTIONS = {
    "biases": ((("add_bias_linear", True),), lambda world_size, tp, etp: etp == 2),
    "shared experts": ((("moe_shared_expert_intermediate_size", 32),), lambda world_size, tp, etp: tp == 2
                       and world_size == 2),
}


def _scenarios() -> dict:
    """{world size: {name: (tp, ep, etp, overrides, distributed optimizer, overlap)}}: the layouts,
    then each option of OPTIONS added to the layouts it applies to."""
    scenarios = {}
    for world_size, layouts in LAYOUTS.items():
        scenarios[world_size] = dict(layouts)
        for option, (overrides, applies) in OPTIONS.items():
            for name, (tp, ep, etp, dispatcher, distributed_optimizer, overlap) in layouts.items():
                if applies(world_size, tp, etp if etp is not None else tp) and not distributed_optimizer:
                    scenarios[world_size][f"{name} {option}"] = (tp, ep, etp, dispatcher + overrides,
                                                                 distributed_optimizer, overlap)
    return scenarios


SCENARIOS = _scenarios()


def _run_scenarios(rank, world_size):
    return {name: _parallel(*args) for name, args in SCENARIOS[world_size].items()}


@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> list:
    return run_distributed(world_size, _run_scenarios, timeout=600)


@pytest.mark.parametrize("world_size, name", [(w, n) for w, names in SCENARIOS.items() for n in names])
def test_expert_parallel_matches_one_process(world_size, name):
    tp, _, _, overrides, _, _ = SCENARIOS[world_size][name]
    dp = world_size // tp
    got = _results(world_size)[0][name]
    want = reference(dp, tuple(item for item in overrides
                               if item[0] != "moe_token_dispatcher_type" and item[0] not in EXECUTION_KEYS))
    assert all(norm > CLIP for norm in want["norms"]), "clipping must be active in the test"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=RTOL, atol=0)
