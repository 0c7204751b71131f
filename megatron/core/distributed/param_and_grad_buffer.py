"""Contiguous gradient (and, for the distributed optimizer, parameter) buffers cut into buckets.

Parameters are laid out in the reverse of the order the forward pass uses them (see
`ddp.params_in_forward_order`), which is the order backward produces their gradients, so the first
bucket fills first (on the last stage: the output layer, whose gradient is ready first) and its
reduction starts while backward still runs through earlier layers:

    buffer: | bucket 0: params N-1 .. k | pad | bucket 1: params k-1 .. j | pad | ... |

With the distributed optimizer every parameter starts at a multiple of `PARAM_ALIGNMENT` elements
(aligned addresses for the kernels that read it), and each bucket is padded to a multiple of
`pad_multiple` (a multiple of the data-parallel size) and split into equal contiguous shards, one
per data-parallel rank: the gradient reduction is a reduce-scatter into this rank's shard, and the
parameter update an all-gather of every rank's shard. Sharding is relative to the bucket, so two
buffers holding the same parameter alone in a bucket (the tied embedding on the first and last
pipeline stage) shard it the same way.

Parameter gathers run bucket by bucket in forward order (the reverse of the buffer order), each
bucket's gather `owed` after an optimizer step until it is dispatched (`in_flight`) and waited for
(`done`); `ddp.DistributedDataParallel` decides when.
"""
import math
from typing import Optional

import torch

from megatron.core.distributed import comm

DEFAULT_BUCKET_SIZE = 40_000_000
SHARD_ALIGNMENT = 128  # elements; keeps every shard start aligned for fast collectives
PARAM_ALIGNMENT = 64   # elements; with the distributed optimizer every parameter starts at a multiple


class Bucket:
    """A contiguous range [start, end) of a buffer and the parameters stored in it."""

    def __init__(self, index: int, params: list, start: int, end: int, param_ranges: dict):
        self.index = index
        self.params = params
        self.start = start
        self.end = end
        self.param_ranges = param_ranges  # param -> (start, end) in buffer coordinates
        self.grad_data: Optional[torch.Tensor] = None
        self.param_data: Optional[torch.Tensor] = None
        self.ready = set()
        self.grad_handle = None
        self.grad_sync_started = False
        self.param_handle = None
        self.param_gather = "done"     # "owed" after an optimizer step, then "in_flight", then "done"
        self.buffer = None             # the ParamAndGradBuffer that holds this bucket
        self.next_gather = None        # the bucket whose gather follows this one's (forward order)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, shard_rank: int, num_shards: int) -> tuple[int, int]:
        """Buffer range [start, end) of shard `shard_rank` of this bucket."""
        length = self.numel // num_shards
        start = self.start + shard_rank * length
        return start, start + length


def _round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def plan_buckets(params: list, bucket_size: Optional[int], pad_multiple: int = 1,
                 own_bucket: frozenset = frozenset(), param_alignment: int = 1) -> tuple[list, int]:
    """Assigns `params` (in the given order) to buckets of at least `bucket_size` elements
    (None: one bucket). Parameters in `own_bucket` get a bucket of their own. Every parameter starts
    at a multiple of `param_alignment` and every bucket's size is padded to a multiple of
    `pad_multiple`. Returns (buckets, total buffer size)."""
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be > 0, got {bucket_size}")
    buckets, current, ranges = [], [], {}
    offset = bucket_start = 0

    def close():
        nonlocal offset, bucket_start, current, ranges
        if not current:
            return
        end = bucket_start + _round_up(offset - bucket_start, pad_multiple)
        buckets.append(Bucket(len(buckets), current, bucket_start, end, ranges))
        offset = bucket_start = end
        current, ranges = [], {}

    for param in params:
        if param in own_bucket:
            close()
        offset = _round_up(offset, param_alignment)
        ranges[param] = (offset, offset + param.numel())
        current.append(param)
        offset += param.numel()
        if param in own_bucket or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close()
    close()
    return buckets, offset


class ParamAndGradBuffer:
    """One gradient buffer (dtype `grad_dtype`) for parameters of one dtype, its buckets, and, when
    `shard_over_dp`, a parameter buffer of the same layout that the parameters become views of."""

    def __init__(self, params: list, *, grad_dtype: torch.dtype, bucket_size: Optional[int],
                 dp_group, shard_over_dp: bool, average_in_collective: bool,
                 own_bucket: frozenset = frozenset(), gradient_scale: Optional[float] = None):
        self.params = params
        self.dp_group = dp_group
        self.dp_size = comm.size(dp_group)
        self.dp_rank = comm.rank(dp_group)
        # The factor the summed gradients need: 1/DP (an average), or for experts, reduced over the
        # expert-data-parallel group, 1/(data x context parallel size) (see ddp.py).
        self.gradient_scale = 1.0 / self.dp_size if gradient_scale is None else gradient_scale
        self.shard_over_dp = shard_over_dp
        self.average_in_collective = average_in_collective
        pad = math.lcm(self.dp_size, SHARD_ALIGNMENT) if shard_over_dp else 1
        self.buckets, total = plan_buckets(params, bucket_size, pad, own_bucket,
                                           param_alignment=PARAM_ALIGNMENT if shard_over_dp else 1)
        device = params[0].device
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = None
        if shard_over_dp:
            self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device)
        self.param_to_bucket = {}
        for bucket in self.buckets:
            bucket.buffer = self
            bucket.grad_data = self.grad_data[bucket.start:bucket.end]
            if self.param_data is not None:
                bucket.param_data = self.param_data[bucket.start:bucket.end]
            for param, (start, end) in bucket.param_ranges.items():
                self.param_to_bucket[param] = bucket
                param.main_grad = self.grad_data[start:end].view(param.shape)
                param.main_grad_empty = True  # until the first accumulation (layers.main_grad_empty)
                if self.param_data is not None:
                    view = self.param_data[start:end].view(param.shape)
                    view.copy_(param.data)
                    param.data = view

    # -- gradients ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.grad_data.zero_()
        for param in self.params:
            param.main_grad_empty = True
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.grad_handle = None
            bucket.grad_sync_started = False

    def mark_ready(self, param) -> None:
        """Records that `param`'s gradient is final; starts its bucket's reduction when it is the last."""
        bucket = self.param_to_bucket[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params) and not bucket.grad_sync_started:
            self.start_grad_sync(bucket)

    def start_grad_sync(self, bucket: Bucket) -> None:
        """Starts the (asynchronous) reduction of one bucket over the data-parallel group.
        Gradients are averaged: scaled by 1/DP before a sum, or averaged inside the collective."""
        bucket.grad_sync_started = True
        # Averaging inside the collective divides by DP itself: only the rest of the scale is applied.
        factor = self.gradient_scale * (self.dp_size if self.average_in_collective and self.dp_group else 1)
        if factor != 1.0:
            bucket.grad_data.mul_(factor)
        if self.dp_group is None:
            return
        if self.shard_over_dp:
            start, end = bucket.shard_range(self.dp_rank, self.dp_size)
            shard = self.grad_data[start:end]
            reduce = comm.reduce_scatter_mean if self.average_in_collective else comm.reduce_scatter_tensor
            bucket.grad_handle = reduce(shard, bucket.grad_data, self.dp_group, async_op=True)
        else:
            reduce = comm.all_reduce_mean if self.average_in_collective else comm.all_reduce
            bucket.grad_handle = reduce(bucket.grad_data, self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Starts any bucket not yet started (all of them without overlap), then waits for all."""
        for bucket in self.buckets:
            if not bucket.grad_sync_started:
                self.start_grad_sync(bucket)
        for bucket in self.buckets:
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
                bucket.grad_handle = None

    # -- parameters (distributed optimizer) --------------------------------------------------
    def shard(self, bucket: Bucket, data: torch.Tensor) -> torch.Tensor:
        start, end = bucket.shard_range(self.dp_rank, self.dp_size)
        return data[start:end]

    def start_param_gather(self, bucket: Bucket) -> None:
        """Dispatches the (asynchronous) all-gather of every rank's updated shard of one bucket."""
        bucket.param_gather = "in_flight"
        if self.dp_group is not None:
            bucket.param_handle = comm.all_gather_into_tensor(
                bucket.param_data, self.shard(bucket, self.param_data), self.dp_group, async_op=True)

    def wait_param_gather(self, bucket: Bucket) -> None:
        if bucket.param_handle is not None:
            bucket.param_handle.wait()
            bucket.param_handle = None
        bucket.param_gather = "done"
