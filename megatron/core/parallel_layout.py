"""ParallelLayout: how a run is split over its ranks, as one frozen value checked once.

Sizes: tensor (tp), pipeline (pp), context (cp), expert (ep) and expert-tensor (etp) parallelism;
data parallelism (dp) is what the world size leaves. The pipeline split (uneven first/last
stages, the embedding and loss counted as layers, virtual stages) and sequence parallelism travel
with it, so validation, the model builders, the planner and `parallel_state` read one value
instead of re-spelling the flags. Building it raises ValueError, with the numbers, for sizes that
cannot make a layout. What the split means for a model of a given depth (the layers of each stage,
the virtual stages, its checks) is computed in `pipeline_parallel.layout`.
"""
from dataclasses import dataclass
from typing import Optional


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


@dataclass(frozen=True)
class PipelineSplit:
    """How the decoder is cut over pipeline stages (`pipeline_parallel.layout`): uneven first/last
    stages, or the embedding and the loss counted as one layer each; then the virtual stages each
    rank's layers form, and the interleaved schedule's micro-batch group."""

    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    num_layers_per_virtual_stage: Optional[int] = None
    num_virtual_stages_per_rank: Optional[int] = None
    microbatch_group_size: Optional[int] = None    # None: the pipeline size

    def keywords(self) -> dict:
        """The keyword arguments of `pipeline_parallel.layout` that say how the layers are cut."""
        return dict(first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                    account_for_embedding=self.account_for_embedding, account_for_loss=self.account_for_loss)


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of a run, its pipeline split and sequence parallelism (module docstring)."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1                                     # expert parallelism, folded from the tp x cp x dp ranks
    etp: Optional[int] = None                       # expert tensor parallelism; None: tp (Megatron-LM's default)
    sequence_parallel: bool = False                 # as asked; `sp` says whether it takes effect
    pipeline_split: PipelineSplit = PipelineSplit()

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        check_sizes(self.world_size, self.tp, self.pp, self.cp)
        check_expert_sizes(self.stage_ranks, self.ep, self.etp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage (tp x cp x dp), which the expert layout folds."""
        return self.world_size // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the copies of each expert."""
        return self.stage_ranks // (self.ep * self.etp)

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs more than one tensor-parallel rank)."""
        return self.sequence_parallel and self.tp > 1
