"""Pipeline schedules keep their memory promises and run Megatron-Core's order of steps.

Our schedules run here in one process, one pipeline rank at a time, with the point-to-point
transport (`comm.batch_send_recv`, through which every pipeline message goes) replaced by one that
completes at once: the order of a rank's steps depends only on the schedule, not on its peers. The
stages are instrumented: a model chunk records a forward when the schedule runs it and a backward
when autograd reaches that micro-batch's graph (a marker in it), so the record is what ran.

- Memory: the peak number of micro-batches whose forward has run and whose backward has not
  (chunk-micro-batches when interleaved), per rank. 1F1B keeps min(P - r, N) (its docstring's
  promise); interleaved keeps Megatron's warm-up count + 1, the warm-up count being
  w = 2 (P - r - 1) + (V - 1) G for micro-batch groups of G, or all N V when w >= N V
  (Megatron-Core's `get_pp_rank_microbatches`). For P 2..4, V 1..3, several N and G, every p2p
  mode (overlapped, the training default; blocking; overlapped with warm-up flush).
- Order: every rank's sequence of (forward or backward, chunk, micro-batch) equals that of
  Megatron-Core's own schedule functions, run in a subprocess with their step functions and
  transport replaced the same way (tests/unit/megatron_core_schedules.py): ours overlapped and
  blocking 1F1B against its 1F1B (which has no overlapped variant), our interleaved against its
  interleaved in the same p2p mode. Skipped, with the install command, without Megatron-Core.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron.core.pipeline_parallel import p2p
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from tests.optional import require_megatron_core, skip_unless_importable_by_megatron_core

SHAPE = (4, 1, 8)
MODES = {"overlap": dict(overlap_p2p_comm=True), "blocking": dict(overlap_p2p_comm=False),
         "flush": dict(overlap_p2p_comm=True, overlap_p2p_comm_warmup_flush=True)}

# (P, V, N, G): V = 1 is 1F1B (G unused); G None means Megatron's default, P.
ONE_F_ONE_B = [(p, 1, n, None) for p in (2, 3, 4) for n in (1, 2, 3, 5, 8)]
INTERLEAVED = [(2, 2, 2, None), (2, 2, 4, None), (2, 2, 6, 3), (2, 2, 5, 3), (2, 3, 4, None), (3, 2, 6, None),
               (3, 3, 3, None), (4, 2, 4, None), (4, 2, 8, None), (4, 2, 8, 8), (4, 3, 8, 4)]
LAYOUTS = ONE_F_ONE_B + INTERLEAVED


class _Mark(torch.autograd.Function):
    """Identity whose backward records that the micro-batch's backward reached this chunk."""

    @staticmethod
    def forward(ctx, x, record, step):
        ctx.record, ctx.step = record, step
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.record.append(ctx.step)
        return grad, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor


def _recording_step(record: list):
    def forward_step(data_iterator, model):
        microbatch = next(data_iterator)
        record.append(("F", model.index, microbatch))
        x = model.input_tensor if model.input_tensor is not None else torch.ones(SHAPE)
        output = _Mark.apply(x * model.weight, record, ("B", model.index, microbatch))
        return output, lambda out: (out.sum(), {})

    return forward_step


def our_steps(pp: int, rank: int, virtual: int, n: int, group, mode: str, monkeypatch) -> list:
    """One rank's (kind, chunk, micro-batch) steps in our schedule."""
    monkeypatch.setattr(p2p.comm, "batch_send_recv", lambda ops: [])
    groups = SimpleNamespace(pp_size=pp, pp_rank=rank, is_first_stage=rank == 0, is_last_stage=rank == pp - 1,
                             pp_next_rank=(rank + 1) % pp, pp_prev_rank=(rank - 1) % pp, pp=None, cp_size=1,
                             device=torch.device("cpu"))
    record = []
    common = dict(forward_step_func=_recording_step(record), data_iterator=iter(range(n)),
                  model_chunks=[_Chunk(index) for index in range(virtual)], num_microbatches=n, groups=groups,
                  tensor_shape=SHAPE, dtype=torch.float32, **MODES[mode])
    if virtual == 1:
        forward_backward_pipelining_without_interleaving(**common)
    else:
        forward_backward_pipelining_with_interleaving(microbatch_group_size=group, **common)
    return record


def peak_pending(steps: list) -> int:
    pending = peak = 0
    for kind, _, _ in steps:
        pending += 1 if kind == "F" else -1
        peak = max(peak, pending)
    return peak


def promised_peak(pp: int, rank: int, virtual: int, n: int, group) -> int:
    """1F1B: min(P - r, N). Interleaved: Megatron's warm-up count + 1, or everything when the
    warm-up covers every chunk-micro-batch."""
    if virtual == 1:
        return min(pp - rank, n)
    warmup = 2 * (pp - rank - 1) + (virtual - 1) * (group or pp)
    return n * virtual if warmup >= n * virtual else warmup + 1


def _modes(virtual: int) -> tuple:
    return ("overlap", "blocking") if virtual == 1 else tuple(MODES)


@pytest.mark.parametrize("pp, virtual, n, group", LAYOUTS)
def test_peak_pending_backwards_per_rank_is_the_promised_bound(pp, virtual, n, group, monkeypatch):
    for mode in _modes(virtual):
        for rank in range(pp):
            steps = our_steps(pp, rank, virtual, n, group, mode, monkeypatch)
            assert sorted(steps) == sorted((kind, c, m) for kind in "BF" for c in range(virtual) for m in range(n))
            assert peak_pending(steps) == promised_peak(pp, rank, virtual, n, group), (mode, rank, steps)


# ---------------------------------------------------------------------------------------------
def _specs() -> list:
    """Megatron-Core's 1F1B runs blocking only; its interleaved schedule in each of our modes."""
    specs = []
    for pp, virtual, n, group in LAYOUTS:
        for mode in ("blocking",) if virtual == 1 else tuple(MODES):
            options = MODES[mode]
            specs.extend(dict(pp=pp, rank=rank, virtual=virtual, microbatches=n, group=group,
                              overlap=options["overlap_p2p_comm"], flush=options.get("overlap_p2p_comm_warmup_flush",
                                                                                     False))
                         for rank in range(pp))
    return specs


@pytest.fixture(scope="module")
def megatron_core_orders(tmp_path_factory) -> dict:
    """{(P, rank, V, N, G, mode): steps} from Megatron-Core's schedules (mode "megatron" for its 1F1B)."""
    reference_dir = require_megatron_core("megatron/core/pipeline_parallel/schedules.py")
    directory = tmp_path_factory.mktemp("schedules")
    specs = _specs()
    json.dump(specs, open(directory / "spec.json", "w"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=reference_dir, OMP_NUM_THREADS="1")
    script = os.path.join(os.path.dirname(__file__), "megatron_core_schedules.py")
    result = subprocess.run([sys.executable, script, str(directory / "spec.json"), str(directory / "out.json")],
                            env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        skip_unless_importable_by_megatron_core(result.stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    orders = {}
    for spec, steps in zip(specs, json.load(open(directory / "out.json"))):
        mode = "flush" if spec["flush"] else ("overlap" if spec["overlap"] else "blocking")
        key = (spec["pp"], spec["rank"], spec["virtual"], spec["microbatches"], spec["group"],
               "megatron" if spec["virtual"] == 1 else mode)
        orders[key] = [tuple(step) for step in steps]
    return orders


@pytest.mark.parametrize("pp, virtual, n, group", LAYOUTS)
def test_order_of_steps_is_megatron_cores(pp, virtual, n, group, megatron_core_orders, monkeypatch):
    for mode in _modes(virtual):
        for rank in range(pp):
            theirs = megatron_core_orders[(pp, rank, virtual, n, group, "megatron" if virtual == 1 else mode)]
            assert peak_pending(theirs) == promised_peak(pp, rank, virtual, n, group), (mode, rank, theirs)
            assert our_steps(pp, rank, virtual, n, group, mode, monkeypatch) == theirs, (mode, rank)
