"""--profile: capture iterations [--profile-step-start, --profile-step-end) on --profile-ranks.

With --use-pytorch-profiler the PyTorch profiler records CPU and accelerator activity and writes a
Chrome trace (open in chrome://tracing or Perfetto) per profiled rank; otherwise the range is
marked for an external profiler (`nsys profile --capture-range=cudaProfilerApi`), which needs a GPU.
"""
import os
from typing import Optional

import torch


class StepProfiler:
    def __init__(self, logging_config, global_rank: int, device: torch.device):
        self.enabled = logging_config.profile and str(global_rank) in {str(r) for r in logging_config.profile_ranks}
        self.start_step = logging_config.profile_step_start
        self.end_step = logging_config.profile_step_end
        self.pytorch = logging_config.use_pytorch_profiler
        self.device = device
        self.directory = logging_config.profile_dir or logging_config.tensorboard_dir or "profiles"
        self.global_rank = global_rank
        self.profiler: Optional[torch.profiler.profile] = None
        self.trace_path: Optional[str] = None

    def before_step(self, iteration: int) -> None:
        """`iteration`: completed iterations so far; the step about to run is number iteration + 1."""
        if not self.enabled or iteration != self.start_step:
            return
        if self.pytorch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        else:
            torch.cuda.profiler.start()

    def after_step(self, iteration: int) -> None:
        """`iteration`: completed iterations including the step just run."""
        if not self.enabled or iteration != self.end_step:
            return
        if self.pytorch and self.profiler is not None:
            self.profiler.stop()
            os.makedirs(self.directory, exist_ok=True)
            self.trace_path = os.path.join(
                self.directory, f"trace_rank{self.global_rank}_iters{self.start_step + 1}-{self.end_step}.json")
            self.profiler.export_chrome_trace(self.trace_path)
            print(f"> profiler trace written to {self.trace_path}", flush=True)
            self.profiler = None
        elif not self.pytorch:
            torch.cuda.profiler.stop()
