"""The plan's memory against short CPU training runs of pretrain_gpt.py, over a grid of layouts
(one process; TP 2 with SP; PP 2 at seq 512; DP 2 with the distributed optimizer and full
recomputation; and a mixture of experts of the same shape: one process, EP 2 with the alltoall
dispatcher and the distributed optimizer, EP 2 with allgather, shared experts and
--moe-layer-recompute).

- Tensors: on every rank, the peak of the bytes held by live tensors over the whole run (start-up,
  two iterations, the optimizer's state created in the first) is the plan's total for that rank's
  pipeline stage within 5%.
- The log line: its peak memory (on CPU the process's peak resident set), less that of a minimal
  run of the same layout (the interpreter, PyTorch, gloo's groups), is within 10% of the plan's
  total (recorded: 0.98-1.03 over the grid; the allocator's slack over the tensors stays inside
  that; on a GPU the verdict's margin also covers the CUDA context and communication buffers,
  which a CPU run does not have).

The runs fix glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_). Left to itself, glibc raises the
threshold each time a large block is freed, after which blocks of up to 32 MiB come from the heap,
whose freed pages it keeps: the resident set then measures the heap's fragmentation rather than
the tensors (TP 2 with SP logged 1.17 of the plan in 4 runs of 5 while its live tensors were 1.01
of it; with the threshold fixed, 1.03 in every run). A fixed threshold sends every block of 128 KiB
or more to its own mapping, returned to the system when freed, as a GPU allocator's segments are.

The model (45M parameters, 32k vocabulary, fp32) is large enough that its memory dwarfs the
variation of the process's own.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.planning.hardware import cluster
from megatron.training.planning.plan import plan_for_flags
from tests.functional.test_pretrain_gpt import pretrain_command, pretrain_env

HERE = Path(__file__).resolve().parent
COMMON = ("--tokenizer-type NullTokenizer --mock-data --lr 1e-4 --train-iters 2 --log-interval 1 --eval-iters 0 "
          "--distributed-backend gloo --micro-batch-size 2 --global-batch-size 4").split()
MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 1536 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 "
         "--seq-length 256").split() + COMMON
# Four experts of 1024 (top-2) with the first layer dense: the experts hold most of the parameters.
# The minimal runs of the MoE layouts have two experts of 32.
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "1024", "--moe-router-topk", "2", "--moe-layer-freq",
       "[0]*1+[1]*3"]
MINIMAL_MOE = ["--num-experts", "2", "--moe-ffn-hidden-size", "32"]
MINIMAL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 256 --seq-length 32".split() + COMMON
GRID = {
    "one process": (1, []),
    "TP2 SP": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # longer sequences: the first stage's two micro-batches in flight outweigh the optimizer's step
    "PP2": (2, ["--pipeline-model-parallel-size", "2", "--seq-length", "512"]),
    "DP2 dist-opt full-recompute": (2, ["--use-distributed-optimizer", "--recompute-granularity", "full",
                                        "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "MoE one process": (1, []),
    "MoE EP2 alltoall dist-opt": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                      "--use-distributed-optimizer"]),
    "MoE EP2 allgather shared moe-recompute": (2, ["--expert-model-parallel-size", "2", "--moe-layer-recompute",
                                                   "--moe-shared-expert-intermediate-size", "512"]),
}


def plan_of(flags: list, world_size: int):
    return plan_for_flags(parse_args(flags), 32000, world_size, cluster("h100-80gb"), on_cpu=True)


def run(nproc: int, flags: list) -> tuple:
    """({rank: live tensor peak bytes}, the last log line's peak memory in bytes)."""
    if nproc == 1:
        command = [sys.executable, str(HERE / "live_peak.py")]
    else:
        command = pretrain_command(nproc)[:-1] + [str(HERE / "live_peak.py")]
    env = dict(pretrain_env(), MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    result = subprocess.run(command + flags, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    live = {int(rank): int(peak) for rank, peak in re.findall(r"live tensor peak \(rank (\d+)\): (\d+) bytes",
                                                              result.stdout)}
    logged = float(re.findall(r"peak memory \(GB\): ([0-9.]+)", result.stdout)[-1]) * 1e9
    return live, logged


@pytest.mark.parametrize("layout", sorted(GRID))
def test_peak_memory_of_short_runs_is_the_plan(layout):
    nproc, extra = GRID[layout]
    moe = layout.startswith("MoE")
    model = MODEL + (MOE if moe else [])
    plan = plan_of(model + extra, nproc)
    live, logged = run(nproc, model + extra)
    ranks_per_stage = nproc // plan.layout.pp
    for rank, peak in live.items():
        planned = plan.stages[rank // ranks_per_stage].total
        assert abs(peak / planned - 1) <= 0.05, (rank, peak, planned)
    _, baseline = run(nproc, MINIMAL + (MINIMAL_MOE if moe else []) + extra)
    planned = plan.stages[-1].total  # the log line is printed by the last stage
    assert abs((logged - baseline) / planned - 1) <= 0.10, (logged, baseline, planned)
