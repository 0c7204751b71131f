"""Counting the work a piece of code does on CPU: bytes it allocates and the code inductor generates.

The GPU paths' speed is a matter of how many bytes they allocate and how many passes they make over
memory; both are the same on CPU, so the tests that guard them count here:

- `peak_bytes_allocated(function)`: the peak, above what existed before the call, of the bytes
  allocated while `function` runs (the profiler's memory timeline: every CPU allocation, those in
  inductor's generated code included).
- `generated_code(function, *args)`: inductor's generated wrapper and kernels, as text.
"""
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile


def peak_bytes_allocated(function) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        function()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        name = str(action)
        if "CREATE" in name or "INCREMENT" in name:
            live += size
        elif "DESTROY" in name or "DECREMENT" in name:
            live -= size
        peak = max(peak, live)
    return peak


def generated_code(function, *args) -> str:
    """Runs the torch.compile'd `function` once on `args` (compiling it), returning its code."""
    _, codes = run_and_get_code(function, *args)
    return "\n".join(codes)
