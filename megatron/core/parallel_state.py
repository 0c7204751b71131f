"""Process groups for tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism.

Ranks are laid out in the order tp-cp-dp-pp, tp fastest:

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a tensor-parallel group is a run of neighbouring ranks (one node's fast links) and pipeline
stages are furthest apart. `initialize_model_parallel` returns a frozen `ParallelGroups`; layers take
the group they need from it as an argument. There is no module-level group state.

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


def check_expert_sizes(tp_cp_dp: int, expert_model_parallel_size: int, expert_tensor_parallel_size: int) -> None:
    """Raises unless expert x expert-tensor parallel sizes divide the ranks of one pipeline stage."""
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if ep < 1 or etp < 1:
        raise ValueError(f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be >= 1")
    if tp_cp_dp % (ep * etp) != 0:
        raise ValueError(
            f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) = {ep * etp} must divide "
            f"the ranks of a pipeline stage (tensor x context x data parallel = {tp_cp_dp}); change the sizes "
            "or the number of processes")


def check_sizes(world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                context_parallel_size: int) -> int:
    """Validates the layout against the world size and returns the data-parallel size."""
    sizes = {
        "--tensor-model-parallel-size": tensor_model_parallel_size,
        "--pipeline-model-parallel-size": pipeline_model_parallel_size,
        "--context-parallel-size": context_parallel_size,
    }
    for flag, value in sizes.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by tensor ({tensor_model_parallel_size}) x "
            f"pipeline ({pipeline_model_parallel_size}) x context ({context_parallel_size}) parallel "
            f"sizes = {model_parallel}; change the sizes or the number of processes")
    return world_size // model_parallel


def _rank_of(tp_r, cp_r, dp_r, pp_r, tp, cp, dp) -> int:
    return tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, *,
                              expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                              device: Optional[torch.device] = None,
                              timeout: Optional[datetime.timedelta] = None) -> ParallelGroups:
    """Builds every process group for the layout. Must be called by all ranks, in the same order.
    `timeout` bounds every collective on these groups (PyTorch's default otherwise: 30 minutes on
    gloo, 10 on NCCL, whatever the default group was given). The expert-tensor-parallel size
    defaults to the tensor-parallel size (Megatron-LM's default)."""
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    if not dist.is_initialized():
        check_sizes(1, tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size)
        check_expert_sizes(1, expert_model_parallel_size, expert_tensor_parallel_size)
        if tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size != 1:
            raise ValueError("model parallelism needs torch.distributed: launch with torchrun")
        return single_process(device)
    world = dist.get_world_size()
    me = dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = check_sizes(world, tp, pp, cp)
    check_expert_sizes(tp * cp * dp, expert_model_parallel_size, expert_tensor_parallel_size)
    coords = {}
    for pp_r, dp_r, cp_r, tp_r in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        coords[_rank_of(tp_r, cp_r, dp_r, pp_r, tp, cp, dp)] = (tp_r, cp_r, dp_r, pp_r)
    my_tp, my_cp, my_dp, my_pp = coords[me]

    def build(varying) -> tuple[Optional[dist.ProcessGroup], tuple]:
        """Creates all groups whose members differ only in the `varying` coordinates; returns mine."""
        names = ("tp", "cp", "dp", "pp")
        extent = dict(tp=tp, cp=cp, dp=dp, pp=pp)
        fixed = [n for n in names if n not in varying]
        mine, my_ranks = None, (me,)
        for fixed_values in itertools.product(*(range(extent[n]) for n in fixed)):
            members = []
            for varying_values in itertools.product(*(range(extent[n]) for n in varying)):
                c = dict(zip(fixed, fixed_values)) | dict(zip(varying, varying_values))
                members.append(_rank_of(c["tp"], c["cp"], c["dp"], c["pp"], tp, cp, dp))
            members.sort()
            if len(members) == 1:
                continue
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                mine, my_ranks = group, tuple(members)
        if len(my_ranks) == 1:
            my_ranks = (me,)
        return mine, my_ranks

    tp_group, _ = build(("tp",))
    cp_group, _ = build(("cp",))
    dp_group, _ = build(("dp",))
    pp_group, pp_ranks = build(("pp",))
    dp_cp_group, _ = build(("cp", "dp"))
    mp_group, _ = build(("tp", "pp"))
    tp_cp_group, _ = build(("tp", "cp"))
    tp_dp_cp_group, _ = build(("tp", "cp", "dp"))
    experts = _expert_groups(me, tp * cp * dp, pp, expert_model_parallel_size, expert_tensor_parallel_size, timeout)

    embedding_group, embedding_ranks = None, ()
    if pp > 1:
        for tp_r, cp_r, dp_r in itertools.product(range(tp), range(cp), range(dp)):
            members = [_rank_of(tp_r, cp_r, dp_r, 0, tp, cp, dp), _rank_of(tp_r, cp_r, dp_r, pp - 1, tp, cp, dp)]
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                embedding_group, embedding_ranks = group, tuple(members)
    if pp == 1:
        pp_ranks = (me,)

    backend = dist.get_backend()
    return ParallelGroups(
        tp_size=tp, cp_size=cp, dp_size=dp, pp_size=pp,
        tp_rank=my_tp, cp_rank=my_cp, dp_rank=my_dp, pp_rank=my_pp,
        tp=tp_group, cp=cp_group, dp=dp_group, pp=pp_group, dp_cp=dp_cp_group, mp=mp_group,
        embedding=embedding_group, world=dist.group.WORLD if world > 1 else None, pp_global_ranks=tuple(pp_ranks),
        embedding_global_ranks=embedding_ranks, world_size=world, global_rank=me,
        backend=backend, device=device or torch.device("cpu"), tp_cp=tp_cp_group, tp_dp_cp=tp_dp_cp_group,
        **experts,
    )


def _expert_groups(me: int, stage_size: int, pp: int, ep: int, etp: int, timeout) -> dict:
    """The expert layout's groups (module docstring): ParallelGroups fields for this rank."""
    edp = stage_size // (ep * etp)
    extent = dict(etp=etp, ep=ep, edp=edp, pp=pp)
    names = ("etp", "ep", "edp", "pp")

    def rank_of(c):
        return c["pp"] * stage_size + c["etp"] + etp * (c["ep"] + ep * c["edp"])

    local = me % stage_size
    mine = dict(etp=local % etp, ep=(local // etp) % ep, edp=local // (etp * ep))
    result = dict(ep_size=ep, etp_size=etp, ep_rank=mine["ep"], etp_rank=mine["etp"])
    for field_name, varying in (("etp", ("etp",)), ("ep", ("ep",)), ("etp_ep", ("etp", "ep")), ("edp", ("edp",)),
                                ("expert_mp", ("etp", "ep", "pp"))):
        fixed = [n for n in names if n not in varying]
        result[field_name] = None
        for fixed_values in itertools.product(*(range(extent[n]) for n in fixed)):
            members = sorted(rank_of(dict(zip(fixed, fixed_values)) | dict(zip(varying, values)))
                             for values in itertools.product(*(range(extent[n]) for n in varying)))
            if len(members) == 1:
                continue
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                result[field_name] = group
    return result

