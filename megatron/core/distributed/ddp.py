"""Data parallelism: gradients accumulate into contiguous buffers, reduced over data ranks by bucket.

Every parameter that trains gets `param.main_grad`, a view into a gradient buffer (fp32, or bf16
with `--grad-reduce-in-bf16`; see `param_and_grad_buffer`). A hook run after autograd accumulates
`param.grad` adds it to `main_grad` and frees `param.grad`, so micro-batches accumulate straight
into the buffer whatever the parameter dtype. Layers that fuse the accumulation
(`--gradient-accumulation-fusion`: the parallel linears and the embedding write into `main_grad`
themselves and produce no `param.grad`) call the same hook, as `param.main_grad_hook`, once their
contribution is in, so bucket readiness is recorded for every parameter either way.

The reduction averages over the data-parallel x context-parallel group, by bucket:
- without `--overlap-grad-reduce`, every bucket is reduced in `finish_grad_sync`, after backward;
- with it, the same hook marks the parameter ready during the backward of the last micro-batch
  (outside `no_sync`), and a bucket's asynchronous reduction starts as soon as its last gradient
  is in; `finish_grad_sync` then starts what is left and waits only for what is in flight.
With `--use-distributed-optimizer` the reduction is a reduce-scatter (each rank keeps the reduced
shard it updates) and parameters live in a buffer too, re-assembled by an all-gather after the
step; with `--overlap-param-gather` each module waits for its own parameters' gather in a forward
pre-hook, so the gather overlaps the next forward.
"""
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.distributed import comm
from megatron.core.distributed.param_and_grad_buffer import DEFAULT_BUCKET_SIZE, ParamAndGradBuffer
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.layers import all_reduce_partial_replica_grads


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_bf16: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: Optional[int] = None      # elements; None: 40M with overlap, else one bucket
    average_in_collective: bool = False

    def __post_init__(self):
        validate_data_parallel(ddp_bucket_size=self.bucket_size,
                               use_distributed_optimizer=self.use_distributed_optimizer,
                               overlap_param_gather=self.overlap_param_gather)


def validate_data_parallel(*, ddp_bucket_size: Optional[int] = None, use_distributed_optimizer: bool = False,
                           overlap_param_gather: bool = False, use_torch_fsdp2: bool = False,
                           pipeline_model_parallel_size: int = 1) -> None:
    """Raises ValueError, naming the flags, for data-parallel settings that cannot work together."""
    if ddp_bucket_size is not None and ddp_bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be a positive number of elements, got {ddp_bucket_size}")
    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (only the distributed "
                         "optimizer gathers parameters); add it or drop --overlap-param-gather")
    if use_torch_fsdp2 and pipeline_model_parallel_size > 1:
        raise ValueError(f"--use-torch-fsdp2 does not support pipeline parallelism "
                         f"(--pipeline-model-parallel-size {pipeline_model_parallel_size}); use "
                         "--pipeline-model-parallel-size 1 or drop --use-torch-fsdp2")
    if use_torch_fsdp2 and use_distributed_optimizer:
        raise ValueError("--use-torch-fsdp2 and --use-distributed-optimizer cannot be used together: FSDP2 "
                         "already shards the optimizer state; drop one of them")


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, groups: ParallelGroups, *,
                 ddp_config: Optional[DistributedDataParallelConfig] = None, grad_dtype=None):
        super().__init__()
        self.module = module
        self.groups = groups
        self.ddp_config = ddp_config or DistributedDataParallelConfig()
        cfg = self.ddp_config
        if grad_dtype is None:
            grad_dtype = torch.bfloat16 if cfg.grad_reduce_in_bf16 else torch.float32
        bucket_size = cfg.bucket_size
        if bucket_size is None and cfg.overlap_grad_reduce:
            bucket_size = max(DEFAULT_BUCKET_SIZE, 1_000_000 * groups.dp_cp_size)
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Reverse order: roughly the order in which backward produces the gradients.
        own_bucket = frozenset(shared_embedding_params(module)) if cfg.use_distributed_optimizer else frozenset()
        self.buffers = []
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            params = [p for p in reversed(self.params) if p.dtype == dtype]
            self.buffers.append(ParamAndGradBuffer(
                params, grad_dtype=grad_dtype, bucket_size=bucket_size, dp_group=groups.dp_cp,
                shard_over_dp=cfg.use_distributed_optimizer, average_in_collective=cfg.average_in_collective,
                own_bucket=own_bucket))
        self._param_to_buffer = {p: buffer for buffer in self.buffers for p in buffer.params}
        self._sync_enabled = True
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
            param.main_grad_hook = self._on_grad_ready
        if cfg.overlap_param_gather:
            self._register_param_gather_hooks()

    # -- the contract the training loop and schedules use -----------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside this block only accumulate; no bucket reduction starts."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.reset()

    def start_grad_sync(self) -> None:
        """Starts the reduction of every bucket not yet started."""
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                if not bucket.grad_sync_started:
                    buffer.start_grad_sync(bucket)

    def finish_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.finish_grad_sync()

    def start_param_sync(self, *, overlap: bool) -> None:
        """After a distributed-optimizer step: all-gathers the updated parameter shards. With
        `overlap` the gather is left in flight and each module waits for its own parameters in a
        forward pre-hook; otherwise this waits for it."""
        for buffer in self.buffers:
            buffer.start_param_sync()
        if not overlap:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Waits for every parameter gather still in flight (before reading parameters outside a
        forward: evaluation with hooks removed, checkpointing)."""
        for buffer in self.buffers:
            buffer.finish_param_sync()

    # -- internals ---------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if param.grad is not None:  # None when the layer accumulated into main_grad itself
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.ddp_config.overlap_grad_reduce and self._sync_enabled:
            self._param_to_buffer[param].mark_ready(param)

    def _register_param_gather_hooks(self) -> None:
        for submodule in self.module.modules():
            owned = [p for p in submodule.parameters(recurse=False) if p in self._param_to_buffer]
            if owned:
                submodule.register_forward_pre_hook(self._make_gather_wait_hook(owned))

    def _make_gather_wait_hook(self, params: list):
        def wait_for_params(_module, _inputs):
            for param in params:
                buffer = self._param_to_buffer[param]
                buffer.wait_param_sync(buffer.param_to_bucket[param])
        return wait_for_params


def finalize_model_grads(model_chunks: list, groups: ParallelGroups) -> None:
    """After the last backward of a step: data-parallel reduction, then the tensor-parallel sums of
    partial replica gradients (sequence-parallel norms, replicated key/value heads; one flattened
    all-reduce for all of them), then the tied
    embedding copies across the first and last pipeline stages.

    All three are sums, so their order does not change the result. With the distributed optimizer
    the reduce-scatter leaves only this rank's shard of each bucket reduced; the later sums are
    applied to the whole buffer and are exact on that shard because tensor-parallel peers share the
    bucket layout and the tied embedding sits alone in a bucket (sharded alike on both stages)."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if groups.tp_size > 1:
        all_reduce_partial_replica_grads(
            [(param.tp_layout, param.main_grad) for chunk in model_chunks for param in chunk.module.parameters()
             if param.requires_grad and hasattr(param, "main_grad")], groups.tp)
    _sync_tied_embeddings(model_chunks, groups)


def _sync_tied_embeddings(model_chunks: list, groups: ParallelGroups) -> None:
    if groups.embedding is None:
        return
    for chunk in model_chunks:
        for param in shared_embedding_params(chunk.module):
            comm.all_reduce(param.main_grad, groups.embedding)


def shared_embedding_params(module: torch.nn.Module) -> list:
    """The tied word-embedding parameter(s) held by this stage, first or last (empty if untied)."""
    model = module
    found = []
    if getattr(model, "share_embeddings", False):
        if getattr(model, "pre_process", False):
            found.append(model.embedding.word_embeddings.weight)
        elif getattr(model, "post_process", False):
            found.append(model.output_layer)
    return found
