"""--log-straggler: per-rank forward-backward time at each log interval, slowest ranks named.

Each rank times its forward and backward pass of every step (CUDA events on a GPU, read at the log
interval, when the device is synchronized anyway; the host clock on CPU), the interval before the
gradient reduction makes the data-parallel ranks wait for one another. At each log interval one
all-gather of one number per rank gives rank 0 the spread, which it prints with the
--straggler-minmax-count slowest and fastest ranks. Ranks of one tensor- or pipeline-parallel group
wait for each other inside the pass, so a slow GPU shows up with the ranks of its model-parallel
group; the data-parallel replicas around it show the normal time.
"""
from typing import Optional

import torch

from megatron.core.distributed import comm
from megatron.core.utils import IntervalTimer


class StragglerReport:
    def __init__(self, logging_config, groups):
        self.count = logging_config.straggler_minmax_count
        self.groups = groups
        self.timer = IntervalTimer(groups.device)
        self.steps = 0

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
        self.steps += 1

    def report(self, iteration: int) -> Optional[str]:
        """Collective over all ranks. The report (on global rank 0; None elsewhere)."""
        mean_ms = 1000.0 * self.timer.total_seconds() / max(1, self.steps)
        self.steps = 0
        mine = torch.tensor([mean_ms], dtype=torch.float32, device=self.groups.device)
        every = torch.zeros(self.groups.world_size, dtype=torch.float32, device=self.groups.device)
        comm.all_gather_into_tensor(every, mine, self.groups.world)
        if self.groups.global_rank != 0:
            return None
        times = every.tolist()
        order = sorted(range(len(times)), key=lambda r: times[r])
        slowest = ", ".join(f"rank {r} {times[r]:.1f} ms" for r in reversed(order[-self.count:]))
        fastest = ", ".join(f"rank {r} {times[r]:.1f} ms" for r in order[:self.count])
        median = times[order[len(order) // 2]]
        spread = times[order[-1]] / times[order[0]] if times[order[0]] > 0 else float("inf")
        return (f"straggler report at iteration {iteration} (forward-backward time per rank, mean of the last "
                f"interval): slowest {slowest} | fastest {fastest} | median {median:.1f} ms | slowest / fastest "
                f"{spread:.2f}")
