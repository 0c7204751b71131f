"""Falcon's parallel attention and MLP (--parallel_attn, with one norm and with
--parallel_layernorm) under tensor parallelism, with and without sequence parallelism, match the
single-process model: losses, gradient norms and gathered gradients over 3 optimizer steps, then
the weights (fp32, relative tolerance 1e-5; absolute 2e-6 as tests/distributed/test_model_features.py
says why). Multi-query attention at TP 2 replicates the one key/value head on both ranks."""
from tests.distributed.harness import run_distributed
from tests.distributed.parity import compare_tp_cases_with_one_process, gpt2_config


def falcon_config(**overrides):
    """Falcon's layer choices: LayerNorm, exact GeLU, rotary, no biases, tied embeddings."""
    values = dict(openai_gelu=False, add_bias_linear=False, position_embedding_type="rope", parallel_attn=True,
                  num_attention_heads=4)
    return gpt2_config(**values, **overrides)


def test_tp2_parallel_attention_and_mlp_match_one_process():
    seven_b = falcon_config(group_query_attention=True, num_query_groups=1)
    forty_b = falcon_config(group_query_attention=True, num_query_groups=2, parallel_layernorm=True)
    cases = [("7b", seven_b, False), ("7b-sp", seven_b, True), ("40b-sp", forty_b, True)]
    assert all(run_distributed(2, compare_tp_cases_with_one_process, 2, cases))
