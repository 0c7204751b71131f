"""Multi-latent attention against one process (fp32, gloo).

Tensor parallelism (heads split over 2 ranks), with and without sequence parallelism (down
projections and latent norms on each rank's tokens, their gradients summed over the group), with
the latents' norms (--qk-layernorm) and without, and with YaRN (--rope-type yarn): losses,
gradient norms and gathered gradients over 3 optimizer steps, then the weights (relative
tolerance 1e-5; absolute 2e-6 as tests/distributed/test_model_features.py says why).

Context parallelism (2 ranks; 2 x TP 2 with sequence parallelism at 4) with each --cp-comm-type,
and pipeline parallelism (2 stages): the scenarios of tests/distributed/test_context_parallel.py
(3 AdamW steps through `pretrain_gpt.forward_step` with random loss masks; loss, gradient norm,
every gathered gradient and the final weights within a relative 1e-5) on a model with multi-latent
attention whose values (12 channels) are narrower than its queries and keys (8 + 8). Before them,
the context-parallel attention core with unequal query/key and value head dims, narrower values
and wider ones, equals full causal attention on every rank at CP 2 and 4 (output and gradients).
"""
import torch

from megatron.core.context_parallel import ContextParallelAttention
from megatron.core.context_parallel.layout import slice_sequence
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.config import ExecutionConfig
from tests.distributed.harness import run_distributed
from tests.distributed.parity import compare_tp_cases_with_one_process, llama_config
from tests.distributed.test_context_parallel import Scenario, check_scenario, reference_run, run_scenario

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


# (field, value) overrides of test_context_parallel's model (hidden 32, 4 heads): values of 12
# channels against queries and keys of 8 + 8, so the context-parallel core pads them.
LATENT = (("multi_latent_attention", True), ("q_lora_rank", 24), ("kv_lora_rank", 16), ("qk_head_dim", 8),
          ("qk_pos_emb_head_dim", 8), ("v_head_dim", 12), ("qk_layernorm", True), ("rope_type", "rope"))
YARN = LATENT[:-1] + (("rope_type", "yarn"), ("rotary_scaling_factor", 4.0), ("mscale_all_dim", 0.5),
                      ("yarn_original_max_position_embeddings", 8))
DIRECT_INTERLEAVED = LATENT[:1] + LATENT[2:] + (("rotary_interleaved", True),)  # no query latent
TWO_RANKS = [
    Scenario("mla cp2 p2p", cp=2, model=LATENT),
    Scenario("mla cp2 all_gather, yarn", cp=2, comm_type="all_gather", model=YARN),
    Scenario("mla cp2 a2a, no query latent, interleaved rotary", cp=2, comm_type="a2a", model=DIRECT_INTERLEAVED),
    Scenario("mla pp2", cp=1, pp=2, model=LATENT),
]
FOUR_RANKS = [Scenario("mla cp2 x tp2 sequence parallel", cp=2, tp=2, sp=True, model=LATENT)]


def _full_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v, written out (v's head dim may differ from q's)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def _unequal_head_dims_check(cp_size: int) -> list:
    """ContextParallelAttention with each comm type, values narrower and wider than q/k, against
    full attention: this rank's rows of the output and of the q/k/v gradients."""
    groups = initialize_model_parallel(1, 1, cp_size)
    failures = []
    for comm_type in ("p2p", "all_gather", "a2a"):
        for qk_dim, v_dim in ((16, 12), (8, 12)):
            core = ContextParallelAttention(llama_config(), execution=ExecutionConfig(cp_comm_type=comm_type),
                                            cp_group=groups.cp, num_local_heads=4, num_local_groups=4)
            generator = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(2, 4, 16, dim, generator=generator, requires_grad=True)
                       for dim in (qk_dim, qk_dim, v_dim))
            dout = torch.randn(2, 4, 16, v_dim, generator=generator)
            full = _full_attention(q, k, v)
            expected = (full, *torch.autograd.grad(full, (q, k, v), dout))
            local = [slice_sequence(t.detach(), 2, cp_size, groups.cp_rank).requires_grad_() for t in (q, k, v)]
            out = core(*local)
            out.backward(slice_sequence(dout, 2, cp_size, groups.cp_rank))
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), expected):
                want = slice_sequence(want, 2, cp_size, groups.cp_rank)
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    failures.append(f"{comm_type} q/k {qk_dim}, v {v_dim}: {name}")
    return failures


def _run_all(rank, world_size, scenarios):
    results = {"attention": _unequal_head_dims_check(world_size)}
    for scenario in scenarios:
        results[scenario.name] = run_scenario(scenario)
    if rank == 0:
        results["references"] = {s.reference_key: reference_run(s) for s in scenarios}
    return results


def _run_and_check(world_size: int, scenarios: list) -> None:
    per_rank = run_distributed(world_size, _run_all, scenarios)
    failures = [failure for results in per_rank for failure in results["attention"]]
    assert not failures, failures
    for scenario in scenarios:
        check_scenario(scenario, [results[scenario.name] for results in per_rank],
                       per_rank[0]["references"][scenario.reference_key])


def test_cp2_and_pp2_multi_latent_attention_match_one_process():
    _run_and_check(2, TWO_RANKS)


def test_cp2_tp2_multi_latent_attention_matches_one_process():
    _run_and_check(4, FOUR_RANKS)
