"""ParallelLayout: one value for the sizes and the pipeline split, read by the process groups, the
model builders, validation and the planner.

The groups are checked against the rank formulas of `parallel_state`'s docstring for every rank of
several layouts, with `torch.distributed` replaced by a recorder (no processes): each group holds
exactly the ranks that differ only in its coordinates, and every rank creates the same groups in the
same order (the contract of `new_group`)."""
import itertools

import pytest
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.parallel_layout import ParallelLayout, PipelineSplit
from megatron.core.pipeline_parallel.layout import decoder_layers_per_stage, split_layer_numbers
from megatron.training.arguments import parse_args
from megatron.training.builders import parallel_layout

LAYOUTS = [  # world, tp, pp, cp, ep, etp
    (8, 2, 2, 1, 1, None), (16, 2, 2, 2, 2, 2), (12, 2, 3, 1, 2, 1), (8, 2, 1, 2, 4, 1), (8, 1, 2, 2, 2, 1)]


def _groups_of_every_rank(monkeypatch, layout: ParallelLayout) -> list:
    """(ParallelGroups, the member lists of the groups created, in order) for each rank."""
    results = []
    for me in range(layout.world_size):
        created = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: layout.world_size)
        monkeypatch.setattr(dist, "get_rank", lambda: me)
        monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
        monkeypatch.setattr(dist, "new_group", lambda members, timeout=None: created.append(tuple(members))
                            or frozenset(members))
        results.append((parallel_state.build_parallel_groups(layout), created))
    return results


def _dense(rank, layout):
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return dict(tp=rank % tp, cp=rank // tp % cp, dp=rank // (tp * cp) % dp, pp=rank // (tp * cp * dp))


def _expert(rank, layout):
    local = rank % layout.stage_ranks
    return dict(etp=local % layout.etp, ep=local // layout.etp % layout.ep, edp=local // (layout.etp * layout.ep),
                pp=rank // layout.stage_ranks)


# ParallelGroups field -> (coordinates of a rank, the axes its members differ on)
GROUPS = {"tp": (_dense, ("tp",)), "cp": (_dense, ("cp",)), "dp": (_dense, ("dp",)), "pp": (_dense, ("pp",)),
          "dp_cp": (_dense, ("dp", "cp")), "mp": (_dense, ("tp", "pp")), "tp_cp": (_dense, ("tp", "cp")),
          "tp_dp_cp": (_dense, ("tp", "cp", "dp")), "etp": (_expert, ("etp",)), "ep": (_expert, ("ep",)),
          "etp_ep": (_expert, ("etp", "ep")), "edp": (_expert, ("edp",)), "expert_mp": (_expert, ("etp", "ep", "pp"))}


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "world{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*s))
def test_groups_hold_the_ranks_the_formulas_give(monkeypatch, sizes):
    world, tp, pp, cp, ep, etp = sizes
    layout = ParallelLayout(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    per_rank = _groups_of_every_rank(monkeypatch, layout)
    assert all(created == per_rank[0][1] for _, created in per_rank)  # same groups, same order, on every rank
    for me, (groups, _) in enumerate(per_rank):
        for name, (coords_of, varying) in GROUPS.items():
            mine = coords_of(me, layout)
            members = {r for r in range(world)
                       if all(coords_of(r, layout)[k] == v for k, v in mine.items() if k not in varying)}
            assert (getattr(groups, name) or frozenset({me})) == members, (me, name)
        assert (groups.tp_rank, groups.cp_rank, groups.dp_rank, groups.pp_rank) == tuple(_dense(me, layout).values())
        assert (groups.etp_rank, groups.ep_rank) == (_expert(me, layout)["etp"], _expert(me, layout)["ep"])
        assert groups.pp_global_ranks == tuple(r for r in range(world) if r % layout.stage_ranks == me % layout.stage_ranks)
        if pp > 1:  # first and last stage of this rank's pipeline, when it is one of them
            ends = (groups.pp_global_ranks[0], groups.pp_global_ranks[-1])
            assert groups.embedding_global_ranks == (ends if me in ends else ())
        assert groups.layout is layout


def test_sizes_are_checked_once_with_their_numbers():
    assert ParallelLayout(world_size=16, tp=2, pp=2).dp == 4
    assert ParallelLayout(world_size=8, tp=2, ep=2).etp == 2  # expert tensor parallelism defaults to tp
    with pytest.raises(ValueError, match=r"world size \(6\) is not divisible by tensor \(4\)"):
        ParallelLayout(world_size=6, tp=4)
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size \(4\) x --expert-tensor-parallel-size "
                                         r"\(1\) = 4 must divide the ranks of a pipeline stage .* = 2\)"):
        ParallelLayout(world_size=4, pp=2, ep=4, etp=1)


FLAGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1",
         "--seq-length", "32", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def test_the_flags_make_one_layout():
    config = parse_args(FLAGS + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--decoder-first-pipeline-num-layers", "2", "--num-virtual-stages-per-pipeline-rank",
                                 "2", "--microbatch-group-size-per-virtual-pipeline-stage", "3",
                                 "--sequence-parallel"])
    layout = parallel_layout(config, 8)
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.ep, layout.etp, layout.sp) == (2, 2, 1, 2, 1, 2, True)
    assert layout.pipeline_split == PipelineSplit(first_stage_layers=2, num_virtual_stages_per_rank=2,
                                                  microbatch_group_size=3)
    assert split_layer_numbers(8, 2, 0, layout.pipeline_split) == [[0], [4]]  # round one: 0 | 1-3
    assert split_layer_numbers(8, 2, 1, layout.pipeline_split) == [[1, 2, 3], [5, 6, 7]]


def test_the_planner_counts_the_layers_each_stage_builds():
    counted = PipelineSplit(account_for_embedding=True, account_for_loss=True)
    assert decoder_layers_per_stage(30, 4, counted) == [7, 8, 8, 7]  # the example of pipeline_parallel/layout.py
    assert decoder_layers_per_stage(10, 4, PipelineSplit(first_stage_layers=1, last_stage_layers=3)) == [1, 3, 3, 3]
    assert list(itertools.chain(*split_layer_numbers(30, 4, 0, counted))) == list(range(7))
