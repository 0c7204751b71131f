"""Multi-latent attention under tensor parallelism (heads split over 2 ranks), with and without
sequence parallelism (down projections and latent norms on each rank's tokens, their gradients
summed over the group), with the latents' norms (--qk-layernorm) and without, matches the
single-process model: losses, gradient norms and gathered gradients over 3 optimizer steps, then
the weights (fp32, relative tolerance 1e-5; absolute 2e-6 as tests/distributed/test_model_features.py
says why)."""
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.harness import run_distributed
from tests.distributed.parity import assert_runs_match, global_batches, llama_config, reference_steps, train_steps

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 3, 4, 2, 16
MLA = dict(multi_latent_attention=True, group_query_attention=False, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=12)


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


def test_tp2_multi_latent_attention_matches_one_process():
    q_latent = llama_config(q_lora_rank=24, rotary_interleaved=True, qk_layernorm=True, **MLA)
    direct = llama_config(q_lora_rank=None, **MLA)
    cases = [("q-latent", q_latent, False), ("q-latent-sp", q_latent, True), ("direct-sp", direct, True)]
    assert all(run_distributed(2, _compare, cases))
