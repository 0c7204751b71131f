"""Which decoder layers each pipeline stage (and each virtual stage) holds.

The decoder is cut into `pp_size * virtual_size` consecutive pieces, ordered virtual stage first:

    piece (v, r) = model chunk v of pipeline rank r,  ordered (0,0) (0,1) ... (0,P-1) (1,0) ... (V-1,P-1)

so activations go round the ring of pipeline ranks V times. Rank r holds `count[r]` layers in all:
the same number everywhere (`num_layers / P`), or, with an uneven split, the first and/or last rank
hold the numbers given by `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`
and the other ranks share the rest evenly. Each rank's layers are divided evenly among its V chunks,
as Megatron-Core does.

With `--account-for-embedding-in-pipeline-split` (`--account-for-loss-in-pipeline-split`) the
embedding (the output layer and loss) counts as one more layer: the split is made as if the model
had that many more layers, and the first piece (the last piece) builds one decoder layer fewer,
possibly none. So with 30 layers, P = 4 and both flags, the 32 "layers" split 8 per stage and the
stages build 7, 8, 8 and 7 decoder layers.
"""
from typing import Optional

from megatron.core.parallel_layout import PipelineSplit

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
PP_FLAG = "--pipeline-model-parallel-size"
LAYERS_PER_VS_FLAG = "--num-layers-per-virtual-pipeline-stage"
VS_PER_RANK_FLAG = "--num-virtual-stages-per-pipeline-rank"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def _split_units(num_layers: int, first_stage_layers, last_stage_layers, account_for_embedding: bool,
                 account_for_loss: bool) -> tuple:
    """(number of units the split divides: decoder layers plus the embedding/loss when counted, and
    a phrase naming them for messages). Raises if the counted embedding/loss meet an uneven split."""
    extra = [flag for flag, on in ((EMBEDDING_FLAG, account_for_embedding), (LOSS_FLAG, account_for_loss)) if on]
    if extra and (first_stage_layers is not None or last_stage_layers is not None):
        raise ValueError(f"{' and '.join(extra)} cannot be combined with {FIRST_FLAG} / {LAST_FLAG}; "
                         "use one way of balancing the stages")
    if not extra:
        return num_layers, f"--num-layers ({num_layers})"
    units = num_layers + len(extra)
    return units, f"--num-layers ({num_layers}) + {len(extra)} ({' and '.join(extra)}) = {units}"


def layers_per_rank(num_layers: int, pp_size: int, *, first_stage_layers: Optional[int] = None,
                    last_stage_layers: Optional[int] = None, account_for_embedding: bool = False,
                    account_for_loss: bool = False) -> list:
    """Number of layers on each pipeline rank (counting the embedding and loss as layers when they
    are accounted for in the split); raises ValueError naming the flags."""
    if pp_size < 1:
        raise ValueError(f"{PP_FLAG} must be >= 1, got {pp_size}")
    units, described = _split_units(num_layers, first_stage_layers, last_stage_layers, account_for_embedding,
                                    account_for_loss)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and pp_size == 1:
        raise ValueError(f"{FIRST_FLAG}/{LAST_FLAG} need {PP_FLAG} > 1 (got {pp_size})")
    if not uneven:
        if units % pp_size != 0:
            raise ValueError(
                f"{described} is not divisible by {PP_FLAG} ({pp_size}); change one of "
                f"them, or set {FIRST_FLAG} / {LAST_FLAG} for an uneven split")
        return [units // pp_size] * pp_size
    for flag, value in ((FIRST_FLAG, first_stage_layers), (LAST_FLAG, last_stage_layers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    fixed = (first_stage_layers or 0) + (last_stage_layers or 0)
    middle_stages = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    middle_layers = num_layers - fixed
    given = " + ".join(f"{flag} ({value})" for flag, value in
                       ((FIRST_FLAG, first_stage_layers), (LAST_FLAG, last_stage_layers)) if value is not None)
    if middle_stages == 0:
        if middle_layers != 0:
            raise ValueError(f"with {PP_FLAG} {pp_size}, {given} must equal --num-layers ({num_layers})")
        per_middle = 0
    else:
        if middle_layers < middle_stages or middle_layers % middle_stages != 0:
            raise ValueError(
                f"--num-layers ({num_layers}) - {given} leaves {middle_layers} layers, which cannot be split "
                f"evenly (at least one each) over the other {middle_stages} pipeline stages of {PP_FLAG} {pp_size}")
        per_middle = middle_layers // middle_stages
    counts = [per_middle] * pp_size
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    return counts


def virtual_pipeline_size(num_layers: int, pp_size: int, *, num_layers_per_virtual_stage: Optional[int] = None,
                          num_virtual_stages_per_rank: Optional[int] = None, first_stage_layers: Optional[int] = None,
                          last_stage_layers: Optional[int] = None, account_for_embedding: bool = False,
                          account_for_loss: bool = False) -> int:
    """V, the number of model chunks per pipeline rank (1 without interleaving)."""
    counts = layers_per_rank(num_layers, pp_size, first_stage_layers=first_stage_layers,
                             last_stage_layers=last_stage_layers, account_for_embedding=account_for_embedding,
                             account_for_loss=account_for_loss)
    if num_layers_per_virtual_stage is not None and num_virtual_stages_per_rank is not None:
        raise ValueError(f"{LAYERS_PER_VS_FLAG} ({num_layers_per_virtual_stage}) and {VS_PER_RANK_FLAG} "
                         f"({num_virtual_stages_per_rank}) are mutually exclusive; pass one of them")
    if num_layers_per_virtual_stage is None and num_virtual_stages_per_rank is None:
        return 1
    flag, value = ((LAYERS_PER_VS_FLAG, num_layers_per_virtual_stage) if num_layers_per_virtual_stage is not None
                   else (VS_PER_RANK_FLAG, num_virtual_stages_per_rank))
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    if pp_size == 1:
        raise ValueError(f"{flag} ({value}) needs pipeline parallelism: set {PP_FLAG} > 1 (got {pp_size})")
    if num_layers_per_virtual_stage is not None:
        bad = [(r, c) for r, c in enumerate(counts) if c % value != 0 or c // value != counts[0] // value]
        if bad:
            rank, count = bad[0]
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers, which is not a multiple of {flag} ({value}) giving the "
                f"same number of virtual stages on every rank (layers per rank: {counts}); use {VS_PER_RANK_FLAG} "
                f"with an uneven split")
        return counts[0] // value
    for rank, count in enumerate(counts):
        if count % value != 0:
            raise ValueError(f"pipeline rank {rank} holds {count} layers, which cannot be split into {flag} "
                             f"({value}) virtual stages (layers per rank: {counts})")
    return value


def validate_pipeline(num_layers: int, pp_size: int, *, num_layers_per_virtual_stage: Optional[int] = None,
                      num_virtual_stages_per_rank: Optional[int] = None, first_stage_layers: Optional[int] = None,
                      last_stage_layers: Optional[int] = None, num_microbatches: Optional[int] = None,
                      account_for_embedding: bool = False, account_for_loss: bool = False,
                      microbatch_group_size: Optional[int] = None) -> int:
    """Checks the pipeline flags against each other (and the micro-batch count, when given);
    returns the virtual pipeline size V. Raises ValueError naming the flags and numbers."""
    virtual_size = virtual_pipeline_size(
        num_layers, pp_size, num_layers_per_virtual_stage=num_layers_per_virtual_stage,
        num_virtual_stages_per_rank=num_virtual_stages_per_rank, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, account_for_embedding=account_for_embedding,
        account_for_loss=account_for_loss)
    if num_microbatches is not None:
        if num_microbatches < 1:
            raise ValueError(f"number of micro-batches ({num_microbatches}) must be >= 1")
        if virtual_size > 1:
            check_microbatch_groups(num_microbatches, pp_size, microbatch_group_size)
    return virtual_size


def check_microbatch_groups(num_microbatches: int, pp_size: int, group_size: Optional[int]) -> int:
    """The interleaved schedule's micro-batch group size G (default P), checked as Megatron does:
    P <= G <= N, and the last group (N mod G) empty or at least P micro-batches."""
    described = (f"the number of micro-batches ({num_microbatches} = --global-batch-size / (--micro-batch-size x "
                 f"data-parallel size))")
    if group_size is None:
        if num_microbatches % pp_size != 0:
            raise ValueError(f"the interleaved schedule needs {described} to be a multiple of {PP_FLAG} ({pp_size}) "
                             f"(or a larger {GROUP_FLAG})")
        return pp_size
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(f"{GROUP_FLAG} ({group_size}) must be between {PP_FLAG} ({pp_size}) and {described}")
    remainder = num_microbatches % group_size
    if 0 < remainder < pp_size:
        raise ValueError(f"{described} leaves a last group of {remainder} micro-batches with {GROUP_FLAG} "
                         f"({group_size}); it must be 0 or at least {PP_FLAG} ({pp_size})")
    return group_size


def stage_layer_numbers(num_layers: int, pp_size: int, pp_rank: int, *, virtual_size: int = 1,
                        first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                        account_for_embedding: bool = False, account_for_loss: bool = False) -> list:
    """Global decoder layer indices of each model chunk of pipeline rank `pp_rank` (V lists)."""
    counts = layers_per_rank(num_layers, pp_size, first_stage_layers=first_stage_layers,
                             last_stage_layers=last_stage_layers, account_for_embedding=account_for_embedding,
                             account_for_loss=account_for_loss)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside {PP_FLAG} {pp_size}")
    for rank, count in enumerate(counts):
        if count % virtual_size != 0:
            raise ValueError(f"pipeline rank {rank} holds {count} layers, which cannot be split into "
                             f"{virtual_size} virtual stages (layers per rank: {counts})")
    per_chunk = [count // virtual_size for count in counts]  # layers of each rank's chunks
    layers_per_round = sum(per_chunk)                        # one trip round the ring of ranks
    # Unit numbers; with the embedding counted, unit 0 is the embedding and unit u is layer u - 1.
    embedding = int(account_for_embedding)
    chunks = []
    for chunk in range(virtual_size):
        start = chunk * layers_per_round + sum(per_chunk[:pp_rank])
        units = range(start, start + per_chunk[pp_rank])
        chunks.append([unit - embedding for unit in units if embedding <= unit < num_layers + embedding])
    return chunks


# -- the same, for a `PipelineSplit` value (the form validation, the builders and the planner hold) --
def split_virtual_size(num_layers: int, pp_size: int, split: PipelineSplit) -> int:
    """V for the split: model chunks per pipeline rank."""
    return virtual_pipeline_size(num_layers, pp_size, **_virtual(split), **split.keywords())


def validate_split(num_layers: int, pp_size: int, split: PipelineSplit, num_microbatches: Optional[int] = None) -> int:
    """`validate_pipeline` for the split; returns V."""
    return validate_pipeline(num_layers, pp_size, num_microbatches=num_microbatches,
                             microbatch_group_size=split.microbatch_group_size, **_virtual(split), **split.keywords())


def split_layer_numbers(num_layers: int, pp_size: int, pp_rank: int, split: PipelineSplit) -> list:
    """Global decoder layer indices of each model chunk of pipeline rank `pp_rank`."""
    return stage_layer_numbers(num_layers, pp_size, pp_rank, virtual_size=split_virtual_size(num_layers, pp_size, split),
                               **split.keywords())


def decoder_layers_per_stage(num_layers: int, pp_size: int, split: PipelineSplit) -> list:
    """Decoder layers each pipeline stage builds (the embedding and loss, when counted in the split,
    take a layer's place on the first and last stage)."""
    return [sum(map(len, stage_layer_numbers(num_layers, pp_size, rank, **split.keywords())))
            for rank in range(pp_size)]


def _virtual(split: PipelineSplit) -> dict:
    return dict(num_layers_per_virtual_stage=split.num_layers_per_virtual_stage,
                num_virtual_stages_per_rank=split.num_virtual_stages_per_rank)
