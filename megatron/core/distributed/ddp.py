"""Data parallelism: gradients accumulate into contiguous buffers, reduced over data ranks by bucket.

Every parameter that trains gets `param.main_grad`, a view into a gradient buffer (fp32, or bf16
with `--grad-reduce-in-bf16`; see `param_and_grad_buffer`). A hook run after autograd accumulates
`param.grad` adds it to `main_grad` and frees `param.grad`, so micro-batches accumulate straight
into the buffer whatever the parameter dtype. Layers that fuse the accumulation
(`--gradient-accumulation-fusion`: the parallel linears and the embedding write into `main_grad`
themselves and produce no `param.grad`) call the same hook, as `param.main_grad_hook`, once their
contribution is in, so bucket readiness is recorded for every parameter either way.

The buffers hold parameters in the reverse of the order the forward pass uses them
(`params_in_forward_order`), which is the order backward produces their gradients: on the last
stage the output layer's gradient, ready first, sits in the first bucket.

The reduction averages over the data-parallel x context-parallel group, by bucket:
- without `--overlap-grad-reduce`, every bucket is reduced in `finish_grad_sync`, after backward;
- with it, the same hook marks the parameter ready during the backward of the last micro-batch
  (outside `no_sync`), and a bucket's asynchronous reduction starts as soon as its last gradient
  is in; `finish_grad_sync` then starts what is left and waits only for what is in flight.
With `--use-distributed-optimizer` the reduction is a reduce-scatter (each rank keeps the reduced
shard it updates) and parameters live in a buffer too, re-assembled by an all-gather after the
step. With `--overlap-param-gather` the gathers are dispatched one bucket at a time in forward
order (`ParamGatherChain`, Megatron's scheme): the forward hook of the first module using a bucket
waits for that bucket's gather and dispatches the next one, so each gather overlaps the forward of
the layers before it; the chain runs across the model chunks of interleaved pipelining.
"""
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.distributed import comm
from megatron.core.distributed.chunk import ModelChunk
from megatron.core.distributed.param_and_grad_buffer import DEFAULT_BUCKET_SIZE, ParamAndGradBuffer
from megatron.core.distributed.replica_grads import all_reduce_partial_replica_grads
from megatron.core.parallel_state import ParallelGroups


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_bf16: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: Optional[int] = None      # elements; None: 40M with overlap, else one bucket
    average_in_collective: bool = False    # --ddp-average-in-collective
    # The first chunk's gathers start during the rest of the optimizer step (read by the
    # distributed optimizer; needs overlap_param_gather and model chunks, as in Megatron).
    overlap_param_gather_with_optimizer_step: bool = False

    def __post_init__(self):
        validate_data_parallel(ddp_bucket_size=self.bucket_size,
                               use_distributed_optimizer=self.use_distributed_optimizer,
                               overlap_param_gather=self.overlap_param_gather)
        if self.overlap_param_gather_with_optimizer_step and not self.overlap_param_gather:
            raise ValueError("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather")


def validate_data_parallel(*, ddp_bucket_size: Optional[int] = None, use_distributed_optimizer: bool = False,
                           overlap_param_gather: bool = False, use_torch_fsdp2: bool = False,
                           overlap_param_gather_with_optimizer_step: bool = False,
                           virtual_pipeline_size: int = 1) -> None:
    """Raises ValueError, naming the flags, for data-parallel settings that cannot work together."""
    if ddp_bucket_size is not None and ddp_bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be a positive number of elements, got {ddp_bucket_size}")
    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (only the distributed "
                         "optimizer gathers parameters); add it or drop --overlap-param-gather")
    if overlap_param_gather_with_optimizer_step and not overlap_param_gather:
        raise ValueError("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather (and "
                         "--use-distributed-optimizer); add them or drop it")
    if overlap_param_gather_with_optimizer_step and virtual_pipeline_size == 1:
        raise ValueError("--overlap-param-gather-with-optimizer-step needs interleaved pipeline parallelism "
                         "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank), "
                         "as in Megatron: it overlaps the first model chunk's gather with the others' step")
    if use_torch_fsdp2 and use_distributed_optimizer:
        raise ValueError("--use-torch-fsdp2 and --use-distributed-optimizer cannot be used together: FSDP2 "
                         "already shards the optimizer state; drop one of them")


def params_in_forward_order(module: torch.nn.Module) -> list:
    """Trainable parameters in the order the forward pass first uses them: submodules in registration
    order, and a module's own parameters after those of its submodules (a head applied to what its
    submodules computed, such as GPTModel's output layer after the decoder)."""
    order = {}

    def visit(submodule):
        for child in submodule.children():
            visit(child)
        for param in submodule.parameters(recurse=False):
            if param.requires_grad:
                order.setdefault(param, None)

    visit(module)
    return list(order)


class ParamGatherChain:
    """The buckets of one or more model chunks in forward order, and the state of their parameter
    gathers after an optimizer step. Gathers are dispatched in this order on every rank (so the
    data-parallel peers issue the same collectives in the same order): waiting for a bucket first
    dispatches any owed bucket before it, and after the wait the next bucket's gather is dispatched,
    to run while the layers using this bucket compute."""

    def __init__(self, buckets: list):
        self.buckets = buckets
        self.position = {bucket: index for index, bucket in enumerate(buckets)}
        self.cursor = len(buckets)  # every bucket before the cursor has been dispatched

    def owe(self, buckets: list) -> None:
        """After an optimizer step: these buckets' parameters changed and must be gathered."""
        for bucket in buckets:
            bucket.param_gather = "owed"
            self.cursor = min(self.cursor, self.position[bucket])

    def dispatch_through(self, bucket) -> None:
        """Dispatches every owed gather up to and including `bucket`'s, in chain order."""
        last = self.position[bucket]
        while self.cursor <= last:
            earlier = self.buckets[self.cursor]
            if earlier.param_gather == "owed":
                earlier.buffer.start_param_gather(earlier)
            self.cursor += 1

    def wait(self, bucket) -> None:
        """Before the forward uses `bucket`'s parameters: waits for its gather, then starts the next."""
        if bucket.param_gather == "done":
            return
        self.dispatch_through(bucket)
        bucket.buffer.wait_param_gather(bucket)
        following = self.position[bucket] + 1
        if following < len(self.buckets) and self.buckets[following].param_gather == "owed":
            self.dispatch_through(self.buckets[following])

    def finish(self) -> None:
        """Dispatches what is owed and waits for every gather."""
        if self.buckets:
            self.dispatch_through(self.buckets[-1])
        for bucket in self.buckets:
            bucket.buffer.wait_param_gather(bucket)


def chain_param_gathers(chunks: list) -> ParamGatherChain:
    """One gather chain through the model chunks of this rank, in the order their forwards start
    (chunk 0 first): the last bucket of chunk i hands over to the first of chunk i + 1."""
    chain = ParamGatherChain([bucket for chunk in chunks for bucket in chunk.gather_order])
    for chunk in chunks:
        chunk.gather_chain = chain
    return chain


class DistributedDataParallel(ModelChunk):
    def __init__(self, module: torch.nn.Module, groups: ParallelGroups, *,
                 ddp_config: Optional[DistributedDataParallelConfig] = None, grad_dtype=None):
        super().__init__(module, groups)
        self.ddp_config = ddp_config or DistributedDataParallelConfig()
        cfg = self.ddp_config
        if grad_dtype is None:
            grad_dtype = torch.bfloat16 if cfg.grad_reduce_in_bf16 else torch.float32
        bucket_size = cfg.bucket_size
        if bucket_size is None and cfg.overlap_grad_reduce:
            bucket_size = max(DEFAULT_BUCKET_SIZE, 1_000_000 * groups.dp_cp_size)
        self.params = [p for p in module.parameters() if p.requires_grad]
        backward_order = params_in_forward_order(module)[::-1]  # the order gradients become ready
        own_bucket = frozenset(shared_embedding_params(module)) if cfg.use_distributed_optimizer else frozenset()
        self.buffers = []
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            for expert in (False, True):
                params = [p for p in backward_order if p.dtype == dtype and is_expert_param(p) == expert]
                if not params:
                    continue
                # Expert weights are summed over the expert-data-parallel group (the ranks holding the
                # same experts) and scaled by 1/(dp x cp), as Megatron-Core: each expert's gradient
                # already holds the tokens its expert-parallel peers sent it.
                self.buffers.append(ParamAndGradBuffer(
                    params, grad_dtype=grad_dtype, bucket_size=bucket_size,
                    dp_group=groups.edp if expert else groups.dp_cp,
                    shard_over_dp=cfg.use_distributed_optimizer, average_in_collective=cfg.average_in_collective,
                    own_bucket=own_bucket, gradient_scale=1.0 / groups.dp_cp_size if expert else None))
        self._param_to_buffer = {p: buffer for buffer in self.buffers for p in buffer.params}
        self._param_to_bucket = {p: buffer.param_to_bucket[p] for buffer in self.buffers for p in buffer.params}
        self.gather_order = [bucket for buffer in self.buffers for bucket in reversed(buffer.buckets)]
        self.gather_chain = ParamGatherChain(self.gather_order)  # shared across chunks by chain_param_gathers
        self._sync_enabled = True
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
            param.main_grad_hook = self._on_grad_ready
        if cfg.overlap_param_gather:
            self._register_param_gather_hooks()

    # -- the contract the training loop and schedules use (chunk.ModelChunk) ---------------------
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
        """After a distributed-optimizer step: this chunk's parameters must be all-gathered. With
        `overlap` the gathers are left to the forward hooks (one bucket at a time, in forward order);
        otherwise they are dispatched and waited for now."""
        self.gather_chain.owe(self.gather_order)
        if not overlap:
            self.finish_param_sync()

    def dispatch_param_gathers(self) -> None:
        """Dispatches this chunk's owed gathers now, without waiting (to overlap them with the rest of
        the optimizer step: --overlap-param-gather-with-optimizer-step)."""
        if self.gather_order:
            self.gather_chain.dispatch_through(self.gather_order[-1])

    def finish_param_sync(self) -> None:
        """Waits for every parameter gather still owed or in flight (before reading parameters outside
        a forward: evaluation with hooks removed, checkpointing)."""
        self.gather_chain.finish()

    # -- internals ---------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if param.grad is not None:  # None when the layer accumulated into main_grad itself
            param.main_grad.add_(param.grad)
            param.main_grad_empty = False
            param.grad = None
        if self.ddp_config.overlap_grad_reduce and self._sync_enabled:
            self._param_to_buffer[param].mark_ready(param)

    def _register_param_gather_hooks(self) -> None:
        """Each module waits for the buckets of its own parameters before it uses them: in a forward
        pre-hook, or, for a module that also has submodules with parameters (whose own parameters
        are applied after them: GPTModel's output layer), when its last such submodule returns."""
        for submodule in self.module.modules():
            owned = [p for p in submodule.parameters(recurse=False) if p in self._param_to_bucket]
            if not owned:
                continue
            buckets = list(dict.fromkeys(self._param_to_bucket[p] for p in owned))
            children = [c for c in submodule.children() if any(p.requires_grad for p in c.parameters())]
            if children:
                children[-1].register_forward_hook(self._make_gather_wait(buckets))
            else:
                submodule.register_forward_pre_hook(self._make_gather_wait(buckets))

    def _make_gather_wait(self, buckets: list):
        def wait(*_hook_arguments):
            for bucket in buckets:
                self.gather_chain.wait(bucket)
        return wait


def is_expert_param(param) -> bool:
    """A mixture-of-experts layer's routed-expert weight (its gradient reduces over expert data ranks)."""
    return hasattr(param, "expert_offset")


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
    """Sums the tied embedding's gradient over its two copies: the DDP buffer view, or, under FSDP2,
    this rank's gradient shard (both stages shard the [V/tp, h] matrix alike over data ranks)."""
    if groups.embedding is None:
        return
    for chunk in model_chunks:
        for param in shared_embedding_params(chunk.module):
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad.to_local()
            comm.all_reduce(grad, groups.embedding)


def shared_embedding_params(module: torch.nn.Module) -> list:
    """The word-embedding parameter(s) with a copy on another stage, held by this stage, first or
    last: the tied embedding, or with multi-token prediction the embedding whose copy the last
    stage's prediction modules read (empty if untied without one)."""
    model = module
    found = []
    mtp = getattr(getattr(model, "config", None), "mtp_num_layers", None) is not None
    if getattr(model, "share_embeddings", False) or mtp:
        if getattr(model, "pre_process", False):
            found.append(model.embedding.word_embeddings.weight)
        elif getattr(model, "post_process", False):  # the prediction modules' embedding, else the output layer
            found.append(model.embedding.word_embeddings.weight if hasattr(model, "embedding") else model.output_layer)
    return found
