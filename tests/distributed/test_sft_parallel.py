"""--sft packed sequences under tensor parallelism with sequence parallelism, pipeline parallelism
and context parallelism (gloo, 2 ranks each, one spawn): one step of pretrain_gpt.py's forward step with
--calculate-per-token-loss over packed sequences gives the summed loss and the full gradients of
the single-process run over the same conversations one per sequence (fp32, rtol 1e-5, both divided
by the same count of assistant tokens). Under CP 2 the conversations are padded to multiples of
4 tokens, as the dataset pads them for --context-parallel-size 2."""
import pytest

from megatron.core.parallel_state import initialize_model_parallel, single_process
from tests.distributed.harness import run_distributed
from tests.sft_data import assert_same_step, conversation_batches, sft_step, write_tokenizer

pytest.importorskip("transformers")

LAYOUTS = {"tp2 sp": dict(tp=2, pp=1, cp=1, sp=True), "pp2": dict(tp=1, pp=2, cp=1, sp=False),
           "cp2": dict(tp=1, pp=1, cp=2, sp=False)}


def _run(rank, world_size, packed, unpacked):
    results = {}
    for name, layout in LAYOUTS.items():
        groups = initialize_model_parallel(layout["tp"], layout["pp"], layout["cp"])
        results[name] = sft_step(groups, packed, sequence_parallel=layout["sp"])
    reference = sft_step(single_process(), unpacked) if rank == 0 else None
    return results, reference


def test_packed_sft_step_under_tp_sp_pp_and_cp_equals_unpacked_single_process(tmp_path):
    packed, unpacked = conversation_batches(write_tokenizer(str(tmp_path / "tok")), cp_size=2)
    results = run_distributed(2, _run, packed, unpacked)
    reference = results[0][1]
    for name in LAYOUTS:
        runs = [rank_results[name] for rank_results, _ in results]
        assert any(run["loss"] is not None for run in runs)  # the last stage reported the sums
        covered = set()
        for run in runs:
            assert_same_step(run, reference)
            covered.update(run["grads"])
        assert covered == set(reference["grads"]), name  # every parameter checked on some rank
