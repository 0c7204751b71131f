"""Small shared helpers. The only module in `megatron.core` that names a device type."""
import functools
import os
import time

import torch


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Exact integer division; raises with both numbers in the message when it does not divide."""
    if denominator == 0 or numerator % denominator != 0:
        label = f" ({what})" if what else ""
        raise ValueError(f"{numerator} is not divisible by {denominator}{label}")
    return numerator // denominator


def default_device() -> torch.device:
    """The device a rank computes on: the local CUDA/ROCm device when there is one, else the CPU.
    Independent of the communication backend (gloo on a GPU machine still computes on the GPU)."""
    if accelerator_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def set_accelerator_device(local_rank: int) -> None:
    torch.cuda.set_device(local_rank)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes since the last reset; on CPU the process's peak resident set size
    (VmHWM: that of this program only; getrusage's figure would carry over the peak of whatever
    process forked it, a test runner for instance)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_capacity_bytes(device: torch.device) -> int:
    """Total memory of `device` (on CPU, the machine's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rng_state(device: torch.device):
    """The RNG state of `device` (CUDA generator, or the CPU generator)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def manual_seed(device: torch.device, seed: int) -> None:
    """Seeds the default generator of `device` only (the CPU's, or the current CUDA device's)."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def empty_cache(device: torch.device) -> None:
    """Returns cached, unused device memory to the device (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_stats(device: torch.device) -> dict:
    """Megatron's memory scalars in bytes: allocated, reserved and peak allocated (on CPU the
    process's peak resident set size stands for all three)."""
    if device.type == "cuda":
        return {"mem-allocated-bytes": torch.cuda.memory_allocated(device),
                "mem-reserved-bytes": torch.cuda.memory_reserved(device),
                "mem-max-allocated-bytes": torch.cuda.max_memory_allocated(device)}
    peak = peak_memory_bytes(device)
    return {"mem-allocated-bytes": peak, "mem-reserved-bytes": peak, "mem-max-allocated-bytes": peak}


def available_memory(device: torch.device) -> float:
    """Bytes free for a new allocation: free memory of the GPU, or the host's available RAM."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    import os

    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class IntervalTimer:
    """Times intervals on `device` without synchronizing: CUDA events on a GPU (read later, once
    the device has caught up), the host clock on CPU. `start()` / `stop()` bracket an interval;
    `total_seconds()` (which waits for the device) sums the intervals since the last call."""

    def __init__(self, device: torch.device):
        self.on_device = device.type == "cuda"
        self.pairs = []
        self._start = None

    def start(self) -> None:
        if self.on_device:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.on_device:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.pairs.append((self._start, end))

    def total_seconds(self) -> float:
        if self.on_device:
            total = sum(start.elapsed_time(end) for start, end in self.pairs) / 1000.0  # waits for the end events
        else:
            total = sum(end - start for start, end in self.pairs)
        self.pairs = []
        return total


class HostCopy:
    """A tensor's values on their way to the host without the host waiting: from an accelerator,
    one non-blocking copy into pinned host memory and an event recorded after it; `tolist()` waits
    for that copy only (not for work queued after it). A CPU tensor is copied as it is."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach().clone()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def compiled(function, dynamic=False):
    """The torch.compile'd `function` (compiled lazily on first call, once per process). `dynamic`:
    False, one graph per set of shapes (fixed shapes); None, PyTorch's automatic dynamic shapes (a
    size seen to change is traced symbolically after its first recompilation: shapes that vary from
    step to step, such as the routed rows at expert-parallel size > 1)."""
    return _compiled(function, dynamic)


@functools.lru_cache(maxsize=None)
def _compiled(function, dynamic):
    return torch.compile(function, fullgraph=True, dynamic=dynamic)


def pick(function, fuse: bool):
    """`function`, or its torch.compile'd version when `fuse` (the fused elementwise kernels)."""
    return compiled(function) if fuse else function
