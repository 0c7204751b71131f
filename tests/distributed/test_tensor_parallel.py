"""Tensor and sequence parallelism match the single-process model: losses, gradient norms and
gathered gradients over 3 optimizer steps, then the weights (fp32, relative tolerance 1e-5)."""
import pytest

from megatron.core.parallel_state import TensorParallel
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.harness import run_distributed
from tests.distributed.parity import (
    assert_runs_match,
    global_batches,
    gpt2_config,
    llama_config,
    reference_steps,
    train_steps,
)

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 3, 4, 2, 16


def _compare(rank, world_size, tp, dp, cases):
    groups = initialize_model_parallel(tp, 1)
    assert groups.dp_size == dp
    for name, config, sequence_parallel in cases:
        batches = global_batches(STEPS, GLOBAL_BATCH, SEQ, config.padded_vocab_size)
        run = train_steps(config, groups, batches, MICRO_BATCH, sequence_parallel=sequence_parallel)
        reference = reference_steps(config, batches, MICRO_BATCH)
        try:
            assert_runs_match(run, reference)
        except AssertionError as error:
            raise AssertionError(f"case {name} (tp={tp}, dp={dp}, sp={sequence_parallel}): {error}") from None
    return True


def _cases():
    return [
        ("llama-gqa", llama_config(), False),
        ("llama-gqa-sp", llama_config(), True),
        ("gpt2-tied-biases", gpt2_config(), False),
        ("gpt2-tied-biases-sp", gpt2_config(), True),
    ]


def test_tp2_with_and_without_sequence_parallel():
    # 8 heads, 2 query groups: each TP rank owns one key/value group.
    assert all(run_distributed(2, _compare, 2, 1, _cases()))


def test_tp4_replicated_kv_heads_with_and_without_sequence_parallel():
    # 8 heads, 2 query groups, TP=4: each key/value group is replicated on two ranks.
    cases = [c for c in _cases() if c[0].startswith("llama")] + [
        ("llama-mha-sp", llama_config(num_query_groups=8, num_attention_heads=8), True)]
    assert all(run_distributed(4, _compare, 4, 1, cases))


def test_tp2_batch_first_attention_output():
    """Hidden 16 < 2 x 16 tokens: attention runs batch-first at micro-batch 2 (the output projection
    on [b*s, nq*d], its weight gradient per sample, into main_grad); sequence parallelism keeps the
    sequence-first layout its reduce-scatter needs."""
    from megatron.core.transformer.attention import SelfAttention

    config = llama_config(hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                          ffn_hidden_size=32)
    attention = SelfAttention(config, tp=TensorParallel(), rng_tracker=None, device="cpu")
    assert attention._batch_first(SEQ, MICRO_BATCH)
    gpt2 = gpt2_config(hidden_size=16, num_attention_heads=4, kv_channels=8, ffn_hidden_size=32)
    cases = [("llama-batch-first", config, False), ("llama-batch-first-sp", config, True),
             ("gpt2-batch-first", gpt2, False)]
    assert all(run_distributed(2, _compare, 2, 1, cases))
    assert all(run_distributed(2, _compare, 1, 2, cases[:1]))  # DP2: main_grad per sample, then averaged


def test_dp2_equals_gradient_accumulation():
    cases = [("llama-gqa", llama_config(), False), ("gpt2", gpt2_config(), False)]
    assert all(run_distributed(2, _compare, 1, 2, cases))


def test_tp2_dp2():
    assert all(run_distributed(4, _compare, 2, 2, [("llama-gqa-sp", llama_config(), True)]))


@pytest.mark.parametrize("heads, groups, tp, message", [
    (6, 6, 4, r"--num-attention-heads by --tensor-model-parallel-size"),
    (12, 3, 2, r"--num-query-groups by --tensor-model-parallel-size"),
])
def test_bad_head_split_names_flags(heads, groups, tp, message):
    config = llama_config(num_attention_heads=heads, num_query_groups=groups, hidden_size=heads * 8)
    with pytest.raises(ValueError, match=message):
        config.check_tensor_parallel(tp)


def _dropout_check(rank, world_size):
    """Hidden dropout (on replicated activations) draws from the default stream, seeded alike on
    every TP rank, so TP=2 reproduces the single-process masks exactly; attention dropout (on
    sharded heads) draws from the per-rank model-parallel stream, so the two ranks' masks differ."""
    import torch

    from megatron.core.distributed import comm
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from megatron.core.tensor_parallel.random import build_tracker

    config = llama_config(hidden_dropout=0.2, attention_dropout=0.0)
    tokens, labels = global_batches(1, 2, SEQ, config.padded_vocab_size)[0]
    positions = torch.arange(SEQ).expand_as(tokens)

    def loss_of(groups):
        tracker = build_tracker(7, groups.tp_rank, 0, torch.device("cpu"))
        model = GPTModel(config, groups, rng_tracker=tracker)
        model.initialize_parameters(7)
        model.train()
        return model(tokens, positions, labels=labels).mean().item()

    groups = initialize_model_parallel(2, 1)
    sharded, reference = loss_of(groups), loss_of(single_process())
    without_dropout = GPTModel(llama_config(), single_process())
    without_dropout.initialize_parameters(7)
    plain = without_dropout(tokens, positions, labels=labels).mean().item()
    assert abs(sharded - reference) <= 1e-5 * abs(reference), (sharded, reference)
    assert abs(reference - plain) > 1e-3  # dropout did act

    tracker = build_tracker(7, groups.tp_rank, 0, torch.device("cpu"))
    with tracker.fork():
        mask = (torch.rand(64) < 0.5).float()
    masks = torch.zeros(2, 64)
    masks[groups.tp_rank] = mask
    comm.all_reduce(masks, groups.tp)
    assert not torch.equal(masks[0], masks[1])
    return True


def test_dropout_streams_inside_and_outside_tensor_parallel_regions():
    assert all(run_distributed(2, _dropout_check))
