"""Multi-latent attention under tensor parallelism (heads split over 2 ranks), with and without
sequence parallelism (down projections and latent norms on each rank's tokens, their gradients
summed over the group), with the latents' norms (--qk-layernorm) and without, and with YaRN (--rope-type yarn), matches the
single-process model: losses, gradient norms and gathered gradients over 3 optimizer steps, then
the weights (fp32, relative tolerance 1e-5; absolute 2e-6 as tests/distributed/test_model_features.py
says why)."""
from tests.distributed.harness import run_distributed
from tests.distributed.parity import compare_tp_cases_with_one_process, llama_config

MLA = dict(multi_latent_attention=True, group_query_attention=False, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=12)


def test_tp2_multi_latent_attention_matches_one_process():
    q_latent = llama_config(q_lora_rank=24, rotary_interleaved=True, qk_layernorm=True, **MLA)
    direct = llama_config(q_lora_rank=None, **MLA)
    # YaRN with unequal mscales: the rotated channels and the attention scale both change
    yarn = llama_config(q_lora_rank=24, rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=0.5,
                        yarn_original_max_position_embeddings=16, **MLA)
    cases = [("q-latent", q_latent, False), ("q-latent-sp", q_latent, True), ("direct-sp", direct, True),
             ("yarn-sp", yarn, True)]
    assert all(run_distributed(2, compare_tp_cases_with_one_process, 2, cases))
