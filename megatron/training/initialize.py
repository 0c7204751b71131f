"""Start-up: torch.distributed, the device, the process groups and the RNG streams."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

from megatron.core import utils
from megatron.core.parallel_state import ParallelGroups, build_parallel_groups
from megatron.core.tensor_parallel.random import RNGStatesTracker, build_tracker
from megatron.training.builders import parallel_layout
from megatron.training.config import Config
from megatron.training.reliability.failures import attempt_store, enable_nccl_flight_recorder


def resolve_backend(config: Config) -> str:
    return config.parallel.distributed_backend or ("nccl" if utils.accelerator_available() else "gloo")


def initialize_distributed(config: Config) -> tuple[ParallelGroups, RNGStatesTracker]:
    """Joins the torchrun rendezvous (or runs as one process) and builds the layout."""
    backend = resolve_backend(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl" and not utils.accelerator_available():
        raise ValueError("--distributed-backend nccl needs a GPU; use --distributed-backend gloo on CPU")
    if utils.accelerator_available():  # the device follows the hardware, whatever the backend
        utils.set_accelerator_device(local_rank)
    limit_compile_threads()
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
    recorder_note = enable_nccl_flight_recorder(config.checkpoint.save) if backend == "nccl" else None
    if world_size > 1 and not dist.is_initialized():
        join_process_group(backend, world_size, timeout)
        if recorder_note and dist.get_rank() == 0:
            print(f"> {recorder_note}", flush=True)
    if backend == "gloo":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    device = utils.default_device()
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = build_parallel_groups(parallel_layout(config, world), device=device, timeout=timeout)
    tracker = build_tracker(config.training.seed, groups.tp_rank, groups.pp_rank, device)
    return groups, tracker


def limit_compile_threads() -> None:
    """torch.compile's worker pool defaults to every CPU of the node, per process: with N ranks per
    node compiling at once that is N x the cores. Each rank gets its share instead (unless
    TORCHINDUCTOR_COMPILE_THREADS is set)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, (os.cpu_count() or 1) // local_ranks)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)  # read when inductor is first imported
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:  # already imported: set it there too
        inductor_config.compile_threads = threads


def join_process_group(backend: str, world_size: int, timeout: datetime.timedelta) -> None:
    """init_process_group from torchrun's environment; under torchrun's agent store, on this restart
    attempt's own keys (see `failures.attempt_store`)."""
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=timeout)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
