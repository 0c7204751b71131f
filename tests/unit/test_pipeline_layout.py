"""Stage split (even, uneven, virtual) and the validation of the pipeline flags."""
import pytest

from megatron.core.pipeline_parallel.layout import stage_layer_numbers, validate_pipeline
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    schedule_table,
)


def _all_chunks(num_layers, pp, virtual=1, **uneven):
    return [stage_layer_numbers(num_layers, pp, rank, virtual_size=virtual, **uneven) for rank in range(pp)]


def test_even_split():
    assert _all_chunks(8, 4) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert _all_chunks(3, 1) == [[[0, 1, 2]]]


def test_interleaved_split_goes_round_the_ring():
    # 8 layers, 2 ranks, 2 virtual stages: (chunk 0: rank0 0-1, rank1 2-3), (chunk 1: rank0 4-5, rank1 6-7)
    assert _all_chunks(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert _all_chunks(8, 4, 2) == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]


def test_uneven_split():
    assert _all_chunks(8, 4, first_stage_layers=1, last_stage_layers=1) == [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7]]]
    assert _all_chunks(5, 2, first_stage_layers=2) == [[[0, 1]], [[2, 3, 4]]]
    assert _all_chunks(7, 3, last_stage_layers=3) == [[[0, 1]], [[2, 3]], [[4, 5, 6]]]
    # Uneven and interleaved: each rank's layers split evenly over its chunks.
    assert _all_chunks(12, 2, 2, first_stage_layers=4) == [[[0, 1], [6, 7]], [[2, 3, 4, 5], [8, 9, 10, 11]]]


def test_every_layer_exactly_once():
    for num_layers, pp, virtual, uneven in [(24, 4, 3, {}), (10, 4, 1, dict(first_stage_layers=1, last_stage_layers=3)),
                                           (16, 3, 2, dict(first_stage_layers=4, last_stage_layers=6))]:
        layers = [n for rank in _all_chunks(num_layers, pp, virtual, **uneven) for chunk in rank for n in chunk]
        assert sorted(layers) == list(range(num_layers))


def test_validate_returns_virtual_size():
    assert validate_pipeline(8, 2) == 1
    assert validate_pipeline(8, 2, num_layers_per_virtual_stage=2, num_microbatches=4) == 2
    assert validate_pipeline(8, 2, num_virtual_stages_per_rank=4, num_microbatches=2) == 4
    assert validate_pipeline(8, 2, num_layers_per_virtual_stage=4, num_microbatches=3) == 1  # V=1: plain 1F1B
    assert validate_pipeline(12, 2, num_virtual_stages_per_rank=2, first_stage_layers=4, num_microbatches=4) == 2


@pytest.mark.parametrize("args, kwargs, message", [
    ((10, 4), {}, r"--num-layers \(10\) is not divisible by --pipeline-model-parallel-size \(4\)"),
    ((8, 2), dict(num_layers_per_virtual_stage=2, num_microbatches=3),
     r"micro-batches \(3 .*multiple of --pipeline-model-parallel-size \(2\)"),
    ((8, 4), dict(num_virtual_stages_per_rank=2, num_microbatches=2),
     r"micro-batches \(2 .*multiple of --pipeline-model-parallel-size \(4\)"),
    ((8, 1), dict(num_layers_per_virtual_stage=2), r"--num-layers-per-virtual-pipeline-stage \(2\) needs pipeline"
     r" parallelism: set --pipeline-model-parallel-size > 1 \(got 1\)"),
    ((8, 1), dict(num_virtual_stages_per_rank=2), r"--num-virtual-stages-per-pipeline-rank \(2\) needs pipeline"),
    ((8, 2), dict(num_layers_per_virtual_stage=3),
     r"rank 0 holds 4 layers.*--num-layers-per-virtual-pipeline-stage \(3\)"),
    ((8, 2), dict(num_virtual_stages_per_rank=3),
     r"rank 0 holds 4 layers.*--num-virtual-stages-per-pipeline-rank \(3\)"),
    ((8, 2), dict(num_layers_per_virtual_stage=2, num_virtual_stages_per_rank=2), r"mutually exclusive"),
    ((8, 4), dict(first_stage_layers=1, last_stage_layers=2),
     r"--num-layers \(8\) - --decoder-first-pipeline-num-layers \(1\) \+ --decoder-last-pipeline-num-layers \(2\) "
     r"leaves 5 layers.*2 pipeline stages"),
    ((8, 2), dict(first_stage_layers=3, last_stage_layers=3), r"must equal --num-layers \(8\)"),
    ((8, 1), dict(first_stage_layers=3), r"need --pipeline-model-parallel-size > 1 \(got 1\)"),
    ((8, 2), dict(first_stage_layers=0), r"--decoder-first-pipeline-num-layers must be >= 1, got 0"),
    ((12, 2), dict(num_layers_per_virtual_stage=2, first_stage_layers=4),
     r"use --num-virtual-stages-per-pipeline-rank"),
])
def test_bad_flags_name_flags_and_numbers(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_pipeline(*args, **kwargs)


def test_schedule_choice():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1"):
        get_forward_backward_func(1, 2)


def test_interleaved_chunk_order():
    # P=2, V=2: forwards visit chunks 0,0,1,1 per group of P micro-batches (backwards the reverse chunks).
    assert schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # Groups of 3 with 5 micro-batches: the last group takes the remaining 2 (Megatron's table).
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
