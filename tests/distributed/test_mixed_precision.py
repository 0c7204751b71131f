"""bf16, and fp16 with dynamic loss scaling, across ranks: each 2-rank layout against the
single-process run in the same precision, plus exact checks that need no tolerance.

Layouts (one spawn of 2 ranks runs them all, in both precisions): DP2 with the plain optimizer, DP2
with the distributed optimizer (overlapped reduce-scatter and parameter gathers), TP2 with sequence
parallelism, PP2 (1F1B), FSDP2 over 2 data ranks. Every run trains the same 4-layer Llama-style
model from the same seed for STEPS optimizer steps on the same global batch of 4 micro-batches (a DP
rank takes 2), AdamW with clipping active, weights in the low precision, gradients and master
weights in fp32; fp16 runs scale the loss by a dynamic scale of 2^12.

Exact checks. Each step's gradient norm is the norm of the gathered fp32 gradients (computed here,
each logical tensor once). After every step, on every rank and every shard: each low-precision weight the model
computes with equals its fp32 master rounded to that precision. The masters are gathered by the
test (each rank's pieces, all-gathered over the data-parallel group, must cover every element once),
not by the optimizer's own code. FSDP2 holds only fp32 shards, so its bf16 weights are read where
they are used: a forward pre-hook on every FSDP unit compares the gathered parameters with the fp32
shards gathered and rounded before the step.

Tolerances, from the format's unit roundoff u (2^-8 for bf16, 2^-11 for fp16): a value rounded to
the format moves by at most u of itself. The layouts compute the same function with the same weights
and differ only in where roundings happen: the order of the fp32 gradient sums (DP, PP), the two
rounded partial products a row-parallel linear sums (TP), the weight gradient rounded per
micro-batch before its fp32 reduction (FSDP2), and, after the first step, weights whose fp32
masters differ in the last bits and so may round one step apart. Hence:
- each loss and gradient norm within u relative: the loss and the norm are fp32 sums over many
  elements each of which carries a few roundings of its own, so their relative error is below one
  rounding;
- each parameter's gradient within 8u in norm (|g - g_ref| / |g_ref|): on any path through the 4
  layers, at most 8 row-parallel linears (TP) or weight-gradient products (FSDP2) each add one
  rounding;
- each final weight within 2u in norm: the two runs' masters agree far below u (Adam normalizes
  each update, so a gradient error of a few u moves a master by a few u of lr), and each side's
  rounding adds at most u.
Largest deviations measured on 2026-11-23 (2-core CPU, torch 2.13), in units of u: losses 0.011,
norms 0.10, gradients 3.3 (TP2), weights 0.59 (TP2); DP2 and PP2 in bf16 were bit-identical to the
reference. A weight that stops training (a master not copied back) is off by about lr per step,
some 50u in norm after STEPS steps, besides failing the exact check.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.ddp import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from tests.distributed.harness import run_distributed
from tests.distributed.parity import assert_norm_is_the_full_gradients_norm
from tests.distributed.test_pipeline_parallel import (
    CLIP,
    HIDDEN,
    MICRO_BATCH,
    SEQ,
    VOCAB,
    Scenario,
    _forward_step,
    build_chunks,
    gathered_grads,
    optimizer_config,
)

STEPS = 4
NUM_MICROBATCHES = 4  # of the global batch; a DP rank takes NUM_MICROBATCHES / dp of them
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

LAYOUTS = {
    "dp2": dict(pp=1, dp=2),
    "dp2 distributed optimizer": dict(pp=1, dp=2, wrapper="distopt all overlaps"),
    "tp2 sequence parallel": dict(pp=1, tp=2, sp=True),
    "pp2": dict(pp=2),
    "fsdp2": dict(pp=1, dp=2, wrapper="fsdp"),
}
# The dynamic scaler multiplies the loss by 2^12, which this model's gradients take without
# overflow in every layout. (Where a layout overflows it differs from the reference by design: a DP
# rank scales loss / 2 micro-batches, the reference loss / 4. Skipping alike on every rank is tested
# with an injected inf in test_distributed_optimizer.py and test_pipeline_parallel.py.)
FP16_OPTIONS = dict(fp16=True, initial_loss_scale=2.0 ** 12, hysteresis=1)


def _scenario(name: str, dtype: torch.dtype) -> Scenario:
    return Scenario(f"{name} {dtype}", n=NUM_MICROBATCHES // LAYOUTS[name].get("dp", 1), dtype=dtype,
                    **LAYOUTS[name])


def _global_batch(step: int) -> list:
    generator = torch.Generator().manual_seed(10_000 + step)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            positions=torch.arange(SEQ).expand(MICRO_BATCH, SEQ)))
    return batches


# ---------------------------------------------------------------------------------------------
# Exact checks: the weights the model computes with are its fp32 masters rounded. Each checker's
# `after_step()` returns the mismatches it found and counts the elements it compared.

def _global_names(chunks) -> dict:
    return {param: chunk.module.global_param_name(name) for chunk in chunks
            for name, param in chunk.module.named_parameters()}


class _ReplicatedMasters:
    """Plain optimizer: every rank holds every master apart from the model's weight."""

    def __init__(self, chunks, optimizer, groups):
        self.optimizer = optimizer
        self.names = _global_names(chunks)
        self.checked = 0

    def after_step(self) -> list:
        mismatches = []
        for param, master in zip(self.optimizer.model_params, self.optimizer.master_params):
            if master is param or not torch.equal(param.detach(), master.detach().to(param.dtype)):
                mismatches.append(self.names[param])
            self.checked += param.numel()
        return mismatches


class _ShardedMasters:
    """Distributed optimizer: the masters' pieces of all data ranks, gathered here, cover each
    parameter exactly once, and every rank's model weight is their rounding, element for element."""

    def __init__(self, chunks, optimizer: DistributedOptimizer, groups):
        self.optimizer = optimizer
        self.groups = groups
        self.names = _global_names(chunks)
        self.checked = 0

    def after_step(self) -> list:
        mine = [(self.names[piece.param], piece.start, piece.end, piece.master.detach().clone())
                for piece in self.optimizer.pieces]
        everyone = [None] * self.groups.dp_size
        dist.all_gather_object(everyone, mine, group=self.groups.dp)
        by_name = {}
        for pieces in everyone:
            for name, start, end, master in pieces:
                by_name.setdefault(name, []).append((start, end, master))
        mismatches = []
        for param, name in self.names.items():
            flat = torch.zeros(param.numel(), dtype=torch.float32)
            covered = torch.zeros(param.numel(), dtype=torch.int32)
            for start, end, master in by_name.get(name, []):
                flat[start:end] = master
                covered[start:end] += 1
            weight = param.detach().reshape(-1)
            if not torch.all(covered == 1):
                mismatches.append(f"{name}: the masters cover {int((covered == 1).sum())} of {param.numel()} "
                                  "elements once")
            elif not torch.equal(weight, flat.to(param.dtype)):
                wrong = int((weight != flat.to(param.dtype)).sum())
                mismatches.append(f"{name}: {wrong} of {param.numel()} elements are not their rounded master")
            self.checked += param.numel()
        return mismatches


class _FSDPComputeWeights:
    """FSDP2 keeps only fp32 shards; the low-precision weights exist while a unit computes. After
    each step the expected weights (the shards gathered and rounded) are taken; a forward pre-hook
    on every FSDP unit compares the parameters the unit is given. The check of a step's result runs
    in the next forward (`finish()` runs one more)."""

    def __init__(self, chunks, optimizer, groups, dtype: torch.dtype):
        chunk = chunks[0]
        self.chunk = chunk
        self.dtype = dtype
        self.units = list(chunk.module.decoder.layers) + [chunk.module]
        self.checked = 0
        self.found = []
        for unit in self.units:
            unit.register_forward_pre_hook(self._check)
        self._expect()

    def _expect(self) -> None:
        self.expected = {id(unit): {name: param.full_tensor().detach().to(self.dtype)
                                    for name, param in unit.named_parameters()} for unit in self.units}

    def _check(self, unit, _args) -> None:
        for name, param in unit.named_parameters():
            if isinstance(param, torch.distributed.tensor.DTensor):
                continue  # a parameter of another unit, not gathered for this one
            if not torch.equal(param.detach(), self.expected[id(unit)][name]):
                self.found.append(name)
            self.checked += param.numel()

    def after_step(self) -> list:
        found, self.found = self.found, []
        self._expect()
        return found

    def finish(self) -> list:
        with torch.no_grad():
            _forward_step(iter(_global_batch(0)), self.chunk)
        return self.found


def _masters_checker(scenario: Scenario, chunks, optimizer, groups):
    if scenario.wrapper == "fsdp":
        return _FSDPComputeWeights(chunks, optimizer, groups, scenario.dtype)
    if isinstance(optimizer, DistributedOptimizer):
        return _ShardedMasters(chunks, optimizer, groups)
    return _ReplicatedMasters(chunks, optimizer, groups)


# ---------------------------------------------------------------------------------------------
def _train(scenario: Scenario, chunks, groups, optimizer, checker) -> dict:
    schedule = get_forward_backward_func(groups.pp_size, 1)
    shape = (SEQ // scenario.tp if scenario.sp else SEQ, MICRO_BATCH, HIDDEN)
    out = dict(losses=[], norms=[], grads=[], applied=[], loss_scales=[], mismatches=[])
    for step in range(STEPS):
        first = groups.dp_rank * scenario.n
        micro_batches = _global_batch(step)[first:first + scenario.n]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        reported = schedule(forward_step_func=_forward_step, data_iterator=iter(micro_batches), model_chunks=chunks,
                            num_microbatches=scenario.n, groups=groups, scale_loss=optimizer.scale_loss,
                            tensor_shape=shape, dtype=scenario.dtype, overlap_p2p_comm=True)
        finalize_model_grads(chunks, groups)
        out["losses"].append([r["lm loss"].item() for r in reported])
        out["grads"].append(gathered_grads(chunks, groups))
        out["loss_scales"].append(optimizer.loss_scale())
        applied, norm = optimizer.step()
        for chunk in chunks:
            chunk.finish_param_sync()
        out["applied"].append(applied)
        out["norms"].append(norm)
        out["mismatches"].append(checker.after_step())
    return out


def _full_weights(chunks, groups) -> dict:
    weights = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            local = param.full_tensor() if hasattr(param, "full_tensor") else param
            for part, tensor in param.tp_layout.local_to_full(local.detach().float(), groups.tp).items():
                weights[chunk.module.global_param_name(name) + (f".{part}" if part else "")] = tensor
    return weights


def _run(scenario: Scenario, groups) -> dict:
    _, _, chunks = build_chunks(scenario, groups)
    precision = dict(FP16_OPTIONS) if scenario.dtype == torch.float16 else dict(bf16=True)
    optimizer = get_megatron_optimizer(optimizer_config(**precision), chunks, groups)
    checker = _masters_checker(scenario, chunks, optimizer, groups)
    result = _train(scenario, chunks, groups, optimizer, checker)
    result["params"] = _full_weights(chunks, groups)
    if hasattr(checker, "finish"):
        result["mismatches"].append(checker.finish())
    return dict(result, checked=checker.checked, dp_rank=groups.dp_rank, last_stage=groups.is_last_stage)


def _run_all(rank, world_size, names, dtypes):
    """Every layout in every precision; rank 0 also runs the single-process references (in this
    one-thread worker rather than in the test process, whose threads compete for the cores)."""
    results = {}
    for dtype in dtypes:
        for name in names:
            scenario = _scenario(name, dtype)
            results[scenario.name] = _run(scenario, initialize_model_parallel(scenario.tp, scenario.pp))
    references = {}
    if rank == 0:
        for dtype in dtypes:
            scenario = Scenario(f"reference {dtype}", pp=1, n=NUM_MICROBATCHES, dtype=dtype)
            references[dtype] = _run(scenario, single_process())
    return results, references


@functools.lru_cache(maxsize=None)
def _results() -> tuple:
    per_rank = run_distributed(2, _run_all, list(LAYOUTS), list(UNIT_ROUNDOFF))
    return [results for results, _ in per_rank], per_rank[0][1]


def _relative(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def _normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF), ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_low_precision_layout_matches_the_single_process_run(name, dtype):
    per_rank, references = _results()
    reference, scenario, u = references[dtype], _scenario(name, dtype), UNIT_ROUNDOFF[dtype]
    assert all(norm > CLIP for norm in reference["norms"]), "clipping must be active"
    covered = set()
    for rank, results in enumerate(per_rank):
        result = results[scenario.name]
        assert result["applied"] == reference["applied"] == [True] * STEPS, (rank, result["applied"])
        assert result["loss_scales"] == reference["loss_scales"], rank
        for step, scale in enumerate(result["loss_scales"]):  # gathered before unscaling
            unscaled = [{key: grad / scale for key, grad in r[scenario.name]["grads"][step].items()} for r in per_rank]
            assert_norm_is_the_full_gradients_norm(result["norms"][step], unscaled, (rank, step))
        for step in range(STEPS):
            if result["last_stage"]:
                first = result["dp_rank"] * scenario.n
                expected = reference["losses"][step][first:first + scenario.n]
                assert len(result["losses"][step]) == scenario.n
                for got, want in zip(result["losses"][step], expected):
                    assert _relative(got, want) <= u, (rank, step, got, want)
            assert _relative(result["norms"][step], reference["norms"][step]) <= u, (rank, step)
            for key, grad in result["grads"][step].items():
                error = _normwise(grad, reference["grads"][step][key])
                assert error <= 8 * u, (rank, step, key, error / u)
        for key, weight in result["params"].items():  # a pipeline stage holds its layers' weights
            error = _normwise(weight, reference["params"][key])
            assert error <= 2 * u, (rank, key, error / u)
        covered |= result["params"].keys()
    assert covered == reference["params"].keys()


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF), ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_low_precision_weight_is_its_rounded_fp32_master(name, dtype):
    per_rank, _ = _results()
    for rank, results in enumerate(per_rank):
        result = results[_scenario(name, dtype).name]
        assert result["checked"] > 0, rank
        assert result["mismatches"] == [[]] * len(result["mismatches"]), (rank, result["mismatches"])
