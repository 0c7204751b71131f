"""Process groups for tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism.

Ranks are laid out in the order tp-cp-dp-pp, tp fastest:

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a tensor-parallel group is a run of neighbouring ranks (one node's fast links) and pipeline
stages are furthest apart. `build_parallel_groups(layout)` (a `ParallelLayout`; or
`initialize_model_parallel` for sizes alone) returns a frozen `ParallelGroups`; layers take the group
they need from it as an argument (tensor parallelism as one `TensorParallel` value). There is no
module-level group state.

Mixture-of-experts layers fold their own layout from the same ranks, as Megatron-Core does: within a
pipeline stage, the tp x cp x dp ranks (index i in tp-cp-dp order) are re-read as expert-tensor (etp),
expert (ep) and expert-data-parallel (edp) coordinates, etp fastest:

    i = etp_rank + etp * (ep_rank + ep * edp_rank),   edp = tp * cp * dp / (etp * ep)

so experts are split over ranks that are tensor-, context- or data-parallel for the dense layers.

A group of one rank is stored as `None` (see `distributed.comm`), so single-process code paths
issue no collectives at all.
"""
import datetime
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.parallel_layout import ParallelLayout, check_expert_sizes, check_sizes  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class TensorParallel:
    """What a layer needs of tensor (or expert-tensor) parallelism, as one value: the group, its
    size and this rank's place in it. The default is one rank (no group, no collectives)."""

    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of the parallel layout: sizes, ranks and process groups."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    tp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None      # gradients are averaged over data and context ranks
    mp: Optional[dist.ProcessGroup] = None         # tp x pp: everything one model replica spans
    embedding: Optional[dist.ProcessGroup] = None  # first and last pipeline stage (tied embeddings)
    world: Optional[dist.ProcessGroup] = None      # every rank (decisions all ranks must agree on)
    tp_cp: Optional[dist.ProcessGroup] = None      # ranks holding parts of the same sequences (MoE token counts)
    tp_dp_cp: Optional[dist.ProcessGroup] = None   # every rank of this pipeline stage
    ep_size: int = 1                               # expert parallelism: ranks that split the experts
    etp_size: int = 1                              # expert tensor parallelism: ranks that split each expert
    ep_rank: int = 0
    etp_rank: int = 0
    ep: Optional[dist.ProcessGroup] = None
    etp: Optional[dist.ProcessGroup] = None
    etp_ep: Optional[dist.ProcessGroup] = None     # etp x ep: the ranks that exchange tokens in a MoE layer
    edp: Optional[dist.ProcessGroup] = None        # expert-data-parallel: expert gradients are summed here
    expert_mp: Optional[dist.ProcessGroup] = None  # etp x ep x pp: every expert of one model replica
    pp_global_ranks: tuple = (0,)                  # global rank of every stage of this rank's pipeline
    embedding_global_ranks: tuple = ()
    world_size: int = 1
    global_rank: int = 0
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layout: ParallelLayout = ParallelLayout()      # the sizes and pipeline split these groups were built for

    @property
    def tensor_parallel(self) -> TensorParallel:
        return TensorParallel(self.tp, self.tp_size, self.tp_rank)

    @property
    def expert_tensor_parallel(self) -> TensorParallel:
        return TensorParallel(self.etp, self.etp_size, self.etp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def edp_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size // (self.etp_size * self.ep_size)

    @property
    def pp_next_rank(self) -> int:
        return self.pp_global_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def pp_prev_rank(self) -> int:
        return self.pp_global_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints the iteration log: the last pipeline stage of the first replica."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0 and self.is_last_stage


def single_process(device: Optional[torch.device] = None) -> ParallelGroups:
    """The layout of one process: every size 1, no groups, no torch.distributed needed."""
    return ParallelGroups(device=device or torch.device("cpu"))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, *,
                              expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                              device: Optional[torch.device] = None,
                              timeout: Optional[datetime.timedelta] = None) -> ParallelGroups:
    """`build_parallel_groups` for a layout given by its sizes alone (an even pipeline split) on
    this job's world. The expert-tensor-parallel size defaults to the tensor-parallel size."""
    layout = ParallelLayout(
        world_size=dist.get_world_size() if dist.is_initialized() else 1, tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size, cp=context_parallel_size, ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size)
    return build_parallel_groups(layout, device=device, timeout=timeout)


def build_parallel_groups(layout: ParallelLayout, *, device: Optional[torch.device] = None,
                          timeout: Optional[datetime.timedelta] = None) -> ParallelGroups:
    """Builds every process group of `layout`. Must be called by all ranks, in the same order.
    `timeout` bounds every collective on these groups (PyTorch's default otherwise: 30 minutes on
    gloo, 10 on NCCL, whatever the default group was given)."""
    device = device or torch.device("cpu")
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise ValueError("model parallelism needs torch.distributed: launch with torchrun")
        return ParallelGroups(device=device, layout=layout)
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"the layout is for {layout.world_size} ranks but torch.distributed has "
                         f"{dist.get_world_size()}")
    me = dist.get_rank()
    dense = _Grid(("tp", "cp", "dp", "pp"), (layout.tp, layout.cp, layout.dp, layout.pp), me, timeout)
    # The order of creation is part of the contract: every rank creates the same groups in turn.
    fields = _dense_groups(dense) | _expert_groups(layout, me, timeout) | _embedding_group(dense)
    return ParallelGroups(
        tp_size=layout.tp, cp_size=layout.cp, dp_size=layout.dp, pp_size=layout.pp,
        world=dist.group.WORLD if layout.world_size > 1 else None, world_size=layout.world_size, global_rank=me,
        backend=dist.get_backend(), device=device, layout=layout, **fields)


class _Grid:
    """Ranks as coordinates on named axes, the first axis fastest (mixed radix)."""

    def __init__(self, names: tuple, sizes: tuple, me: int, timeout):
        self.names, self.extent, self.me, self.timeout = names, dict(zip(names, sizes)), me, timeout

    def rank_of(self, coords: dict) -> int:
        rank, stride = 0, 1
        for name in self.names:
            rank, stride = rank + coords[name] * stride, stride * self.extent[name]
        return rank

    def coordinates(self) -> dict:
        """This rank's coordinate on each axis."""
        local, coords = self.me, {}
        for name in self.names:
            local, coords[name] = divmod(local, self.extent[name])
        return coords

    def groups_along(self, varying: tuple) -> tuple:
        """Creates every group whose members differ only on the `varying` axes (none of one
        rank: a group of one is `None`); returns (this rank's group, its members)."""
        fixed = [n for n in self.names if n not in varying]
        mine, my_ranks = None, (self.me,)
        for fixed_values in itertools.product(*(range(self.extent[n]) for n in fixed)):
            members = sorted(self.rank_of(dict(zip(fixed, fixed_values)) | dict(zip(varying, values)))
                             for values in itertools.product(*(range(self.extent[n]) for n in varying)))
            if len(members) == 1:
                continue
            group = dist.new_group(members, timeout=self.timeout)
            if self.me in members:
                mine, my_ranks = group, tuple(members)
        return mine, my_ranks


def _dense_groups(grid: _Grid) -> dict:
    """The tensor, context, data and pipeline groups and their unions: ParallelGroups fields."""
    coords = grid.coordinates()
    fields = {f"{name}_rank": coords[name] for name in ("tp", "cp", "dp", "pp")}
    for field_name, varying in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)),
                                ("dp_cp", ("cp", "dp")), ("mp", ("tp", "pp")), ("tp_cp", ("tp", "cp")),
                                ("tp_dp_cp", ("tp", "cp", "dp"))):
        fields[field_name], ranks = grid.groups_along(varying)
        if field_name == "pp":
            fields["pp_global_ranks"] = ranks
    return fields


def _expert_groups(layout: ParallelLayout, me: int, timeout) -> dict:
    """The expert layout's groups (module docstring): ParallelGroups fields for this rank."""
    grid = _Grid(("etp", "ep", "edp", "pp"), (layout.etp, layout.ep, layout.edp, layout.pp), me, timeout)
    coords = grid.coordinates()
    fields = dict(ep_size=layout.ep, etp_size=layout.etp, ep_rank=coords["ep"], etp_rank=coords["etp"])
    for field_name, varying in (("etp", ("etp",)), ("ep", ("ep",)), ("etp_ep", ("etp", "ep")), ("edp", ("edp",)),
                                ("expert_mp", ("etp", "ep", "pp"))):
        fields[field_name] = grid.groups_along(varying)[0]
    return fields


def _embedding_group(grid: _Grid) -> dict:
    """First and last pipeline stage of each pipeline (tied embeddings): ParallelGroups fields."""
    pp = grid.extent["pp"]
    fields = dict(embedding=None, embedding_global_ranks=())
    if pp == 1:
        return fields
    for tp_r, cp_r, dp_r in itertools.product(*(range(grid.extent[n]) for n in ("tp", "cp", "dp"))):
        ends = [grid.rank_of(dict(tp=tp_r, cp=cp_r, dp=dp_r, pp=stage)) for stage in (0, pp - 1)]
        group = dist.new_group(ends, timeout=grid.timeout)
        if grid.me in ends:
            fields.update(embedding=group, embedding_global_ranks=tuple(ends))
    return fields
