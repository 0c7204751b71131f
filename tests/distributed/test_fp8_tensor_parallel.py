"""FP8 linears over a real gloo tensor-parallel group (TP=2): with sequence parallelism the
column-parallel linears keep their local bf16 shard and cast the re-gathered input in backward;
without it they keep the FP8 transpose their forward cast. Both cast the same full input with the
same scale, so the two runs agree to fp32 summation order over 3 optimizer steps (losses,
gradient norms, gathered gradients, weights), for both one-scale-per-tensor recipes."""
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.harness import run_distributed
from tests.distributed.parity import assert_runs_match, global_batches, llama_config, train_steps

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 3, 4, 2, 16


def _compare(rank, world_size, recipe):
    groups = initialize_model_parallel(2, 1)
    config = llama_config()
    fp8 = ExecutionConfig(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=2, fp8_amax_compute_algo="max")
    batches = global_batches(STEPS, GLOBAL_BATCH, SEQ, config.padded_vocab_size)
    kept = train_steps(config, groups, batches, MICRO_BATCH, sequence_parallel=False, execution=fp8)
    regathered = train_steps(config, groups, batches, MICRO_BATCH, sequence_parallel=True, execution=fp8)
    assert_runs_match(regathered, kept)
    return kept[0]["loss"]


def test_fp8_tp2_keeps_the_cast_input_or_regathers_it_to_the_same_result():
    for recipe in ("tensorwise", "delayed"):
        losses = run_distributed(2, _compare, recipe)
        assert losses[0] == losses[1]
