"""Data parallelism with gradient buckets: parity with one process running the same global batch.

The reference is one process doing gradient accumulation over all DP x micro-batches of the global
batch (per-micro-batch loss = mean over tokens, step loss = mean over micro-batches). Each DP run
gives rank r its contiguous share of those micro-batches; averaging over DP must reproduce the
reference's losses, gradient norms and weights after 3 Adam steps with clipping active, in fp32.
The helpers here are shared by the distributed-optimizer and FSDP tests.
"""
import contextlib
import functools

import torch

from megatron.core.distributed import comm
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.transformer.config import TransformerConfig
from tests.distributed.harness import run_distributed
from tests.distributed.parity import split_overrides

SEED = 1234
STEPS = 3
MICRO_BATCH = 2
SEQ = 16
VOCAB = 128
CLIP = 0.05  # below the gradient norms of this model, so clipping is active on every step
RTOL = 1e-5


def model_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB, ffn_hidden_size=64,
                  max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    values.update(overrides, group_query_attention="num_query_groups" in overrides)
    return TransformerConfig(**values)


def optimizer_config(**overrides) -> OptimizerConfig:
    # eps 1e-4 (well below the typical gradient element here) keeps Adam from amplifying rounding
    # noise in near-zero gradient elements to full-size updates, which would defeat a 1e-5 comparison.
    values = dict(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=CLIP, adam_eps=1e-4)
    values.update(overrides)
    return OptimizerConfig(**values)


def global_batches(num_microbatches_total: int) -> torch.Tensor:
    """[steps, micro-batches, micro-batch size, seq + 1] token ids, the same in every process."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB, (STEPS, num_microbatches_total, MICRO_BATCH, SEQ + 1), generator=generator)


def micro_batch_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    return model(inputs, positions, labels=labels).mean()


def train_step(chunk, optimizer, groups, micro_batches, *, before_finalize=None) -> tuple:
    """The training loop's contract: zero the buffer, no_sync on all but the last micro-batch,
    finalize_model_grads, optimizer.step. Returns (local mean loss, applied, grad norm)."""
    chunk.zero_grad_buffer()
    losses = []
    for index, tokens in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else chunk.no_sync():
            loss = micro_batch_loss(chunk, tokens)
            optimizer.scale_loss(loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    if before_finalize is not None:
        before_finalize()
    finalize_model_grads([chunk], groups)
    applied, grad_norm = optimizer.step()
    return torch.stack(losses).mean().item(), applied, grad_norm


def full_params(module, groups) -> dict:
    """{global name: {part: full tensor}}: the layout-independent weights (collective over TP)."""
    out = {}
    for name, param in module.named_parameters():
        local = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2: gather over DP
        out[module.global_param_name(name)] = param.tp_layout.local_to_full(local.detach().float(), groups.tp)
    return out


@functools.lru_cache(maxsize=None)
def reference_run(num_microbatches_total: int, model_overrides: tuple = ()) -> dict:
    """One process, the whole global batch as gradient accumulation."""
    groups = single_process()
    overrides, execution = split_overrides(dict(model_overrides))
    model = GPTModel(model_config(**overrides), groups, execution=execution, rng_tracker=None,
                     device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    chunk = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(optimizer_config(), [chunk], groups)
    batches = global_batches(num_microbatches_total)
    losses, norms = [], []
    for step in range(STEPS):
        loss, applied, norm = train_step(chunk, optimizer, groups, list(batches[step]))
        assert applied
        losses.append(loss)
        norms.append(norm)
    return dict(losses=losses, norms=norms, params=full_params(model, groups))


def build_parallel(tp: int, ddp_config: DistributedDataParallelConfig, model_overrides: dict = None, **opt):
    groups = initialize_model_parallel(tp, 1)
    overrides, execution = split_overrides(model_overrides or {})
    model = GPTModel(model_config(**overrides), groups, execution=execution, rng_tracker=None,
                     device=torch.device("cpu"))
    model.initialize_parameters(SEED)
    chunk = DistributedDataParallel(model, groups, ddp_config=ddp_config)
    optimizer = get_megatron_optimizer(optimizer_config(**opt), [chunk], groups)
    return groups, model, chunk, optimizer


def my_micro_batches(batches_of_step: torch.Tensor, groups, per_rank: int) -> list:
    start = groups.dp_rank * per_rank
    return list(batches_of_step[start:start + per_rank])


def dp_mean(value: float, groups) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(tensor, groups.dp)
    return tensor.item() / groups.dp_size


def parallel_run(groups, model, chunk, optimizer, per_rank: int, *, before_finalize=None) -> dict:
    batches = global_batches(per_rank * groups.dp_size)
    losses, norms = [], []
    for step in range(STEPS):
        loss, applied, norm = train_step(chunk, optimizer, groups, my_micro_batches(batches[step], groups, per_rank),
                                         before_finalize=before_finalize)
        assert applied
        losses.append(dp_mean(loss, groups))
        norms.append(norm)
    chunk.finish_param_sync()  # a gather left in flight by --overlap-param-gather
    return dict(losses=losses, norms=norms, params=full_params(model, groups))


def assert_matches_reference(result: dict, reference: dict) -> None:
    assert all(norm > CLIP for norm in reference["norms"]), "clipping must be active in the test"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=RTOL, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for name, parts in reference["params"].items():
        for part, expected in parts.items():
            torch.testing.assert_close(result["params"][name][part], expected, rtol=RTOL, atol=1e-7,
                                       msg=lambda m: f"{name}[{part}]: {m}")


# ---------------------------------------------------------------------------------------------
# Every multi-process scenario of the data-parallel test files runs in one spawn per world size
# (a spawn costs seconds of start-up on a small machine); each test asserts on its scenario.
TP2_OVERRIDES = (("sequence_parallel", True), ("num_query_groups", 1), ("normalization", "RMSNorm"))
_DP = "tests.distributed.test_data_parallel"
_DO = "tests.distributed.test_distributed_optimizer"
_FS = "tests.distributed.test_fsdp"
_CO = "tests.distributed.test_communication_order"
SCENARIOS = {
    2: [("communication order", _CO, "_ordering_trace", ()),
        ("ddp overlap", _DP, "_overlapped_ddp", (2, False)),
        ("distopt", _DO, "_dist_opt_run", (1, 2, False, ())),
        ("distopt overlap", _DO, "_dist_opt_run", (1, 2, True, ())),
        ("fp16 inf distopt", _DO, "_fp16_inf_run", (True,)),
        ("fp16 inf ddp", _DO, "_fp16_inf_run", (False,)),
        ("fsdp", _FS, "_fsdp_run", (1, 2, ())),
        ("fsdp bf16", _FS, "_fsdp_run", (1, 2, (("params_dtype", torch.bfloat16),))),
        ("fsdp bf16 reduce in bf16", _FS, "_fsdp_run", (1, 2, (("params_dtype", torch.bfloat16),),
                                                           torch.bfloat16))],
    4: [("ddp overlap average_in_collective", _DP, "_overlapped_ddp", (1, True)),
        ("distopt", _DO, "_dist_opt_run", (1, 1, False, ())),
        ("distopt overlap", _DO, "_dist_opt_run", (1, 1, True, ())),
        ("distopt tp2", _DO, "_dist_opt_run", (2, 2, True, TP2_OVERRIDES)),
        ("fsdp tp2", _FS, "_fsdp_run", (2, 2, TP2_OVERRIDES)),
        ("fsdp start-up", _FS, "_fsdp_startup_peak", (8,))],
}


def _run_scenarios(rank, world_size):
    import importlib

    return {name: getattr(importlib.import_module(module), fn)(*args)
            for name, module, fn, args in SCENARIOS[world_size]}


@functools.lru_cache(maxsize=None)
def _scenario_results(world_size: int) -> list:
    return run_distributed(world_size, _run_scenarios)


def scenario(world_size: int, name: str) -> list:
    """Every rank's result of one scenario."""
    return [by_name[name] for by_name in _scenario_results(world_size)]


def _overlapped_ddp(per_rank, average_in_collective):
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4000,
                                               average_in_collective=average_in_collective)
    groups, model, chunk, optimizer = build_parallel(1, ddp_config)
    buckets = [b for buffer in chunk.buffers for b in buffer.buckets]
    started_before_finalize = []

    def record():  # after the last backward, before finalize_model_grads
        started_before_finalize.append([b.grad_sync_started for b in buckets])

    result = parallel_run(groups, model, chunk, optimizer, per_rank, before_finalize=record)
    result["num_buckets"] = len(buckets)
    result["started_before_finalize"] = started_before_finalize
    return result


def _check_overlapped(world_size, name, per_rank):
    reference = reference_run(world_size * per_rank)
    for result in scenario(world_size, name):
        assert_matches_reference(result, reference)
        assert result["num_buckets"] > 2
        # Every bucket's reduction was issued by the backward hooks, none left for finalize.
        assert all(all(step) for step in result["started_before_finalize"])


def test_dp2_overlap_grad_reduce_matches_single_process():
    _check_overlapped(2, "ddp overlap", 2)


def test_dp4_overlap_grad_reduce_average_in_collective_matches_single_process():
    _check_overlapped(4, "ddp overlap average_in_collective", 1)
