"""Falcon's parallel attention and MLP (--parallel_attn, with one norm and with
--parallel_layernorm) under tensor parallelism, with and without sequence parallelism, match the
single-process model: losses, gradient norms and gathered gradients over 3 optimizer steps, then
the weights (fp32, relative tolerance 1e-5; absolute 2e-6 as tests/distributed/test_model_features.py
says why). Multi-query attention at TP 2 replicates the one key/value head on both ranks."""
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.harness import run_distributed
from tests.distributed.parity import assert_runs_match, global_batches, gpt2_config, reference_steps, train_steps

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 3, 4, 2, 16


def falcon_config(**overrides):
    """Falcon's layer choices: LayerNorm, exact GeLU, rotary, no biases, tied embeddings."""
    values = dict(openai_gelu=False, add_bias_linear=False, position_embedding_type="rope", parallel_attn=True,
                  num_attention_heads=4)
    return gpt2_config(**values, **overrides)


def _compare(rank, world_size, cases):
    groups = initialize_model_parallel(2, 1)
    for name, config, sequence_parallel in cases:
        batches = global_batches(STEPS, GLOBAL_BATCH, SEQ, config.padded_vocab_size)
        run = train_steps(config, groups, batches, MICRO_BATCH, sequence_parallel=sequence_parallel)
        reference = reference_steps(config, batches, MICRO_BATCH)
        try:
            assert_runs_match(run, reference, atol=2e-6)
        except AssertionError as error:
            raise AssertionError(f"case {name} (sp={sequence_parallel}): {error}") from None
    return True


def test_tp2_parallel_attention_and_mlp_match_one_process():
    seven_b = falcon_config(group_query_attention=True, num_query_groups=1)
    forty_b = falcon_config(group_query_attention=True, num_query_groups=2, parallel_layernorm=True)
    cases = [("7b", seven_b, False), ("7b-sp", seven_b, True), ("40b-sp", forty_b, True)]
    assert all(run_distributed(2, _compare, cases))
