"""Shared pieces that both sides of a parity test run (a bug in them cannot fail a parity test),
checked against references outside the framework:

- RoPE: inverse frequencies (plain and Llama 3.1 scaled) against `transformers`' RoPE initializers,
  and the rotation of queries and keys against `transformers`' `apply_rotary_pos_emb`;
- learning-rate schedules against their closed forms, written out here from Megatron-LM's
  definitions (`OptimizerParamScheduler.get_lr`), at every step including past the decay;
- weight-decay groups: which parameters decay, listed by name (Megatron's rule: not biases, not
  norms), and what the optimizer does with them: with a zero gradient AdamW moves a decayed weight
  by exactly w * lr * wd and leaves the others alone, with the plain and the distributed optimizer;
- loss masking: the masked mean of `pretrain_gpt.loss_func`, its gradients, and the token-weighted
  average the log line reports over micro-batches, against `torch.nn.functional.cross_entropy`
  with ignored positions.

(The gradient-norm replication weights are checked against the norm of the gathered gradients,
computed by hand, in every multi-rank parity test: tests/distributed/parity.py.)
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.lr_scheduler import LRScheduleConfig, learning_rate
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.fusions import rotary as apply_rotary
from megatron.core.transformer.rope import RotaryEmbedding, inverse_frequencies
from tests.optional import require_module

# ---------------------------------------------------------------------------------------------
# RoPE against transformers


def _transformers_llama(head_dim: int, theta: float, scaling: dict = None):
    transformers = require_module("transformers")
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": theta, **scaling}
    return transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4,
                                    max_position_embeddings=131072, rope_parameters=rope)


def _ours(head_dim: int, theta: float, scaling: dict = None) -> TransformerConfig:
    values = dict(num_layers=1, hidden_size=head_dim * 4, num_attention_heads=4, padded_vocab_size=8,
                  position_embedding_type="rope", rotary_base=theta)
    if scaling is not None:
        values.update(use_rope_scaling=True, rope_scaling_factor=scaling["factor"],
                      rope_low_freq_factor=scaling["low_freq_factor"],
                      rope_high_freq_factor=scaling["high_freq_factor"],
                      rope_original_max_position_embeddings=scaling["original_max_position_embeddings"])
    return derive(TransformerConfig(**values))


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_CASES = {
    "llama2 (head 128, theta 1e4)": (128, 10000.0, None),
    "llama3 (head 128, theta 5e5)": (128, 500000.0, None),
    "llama3.1 scaling (Llama 3.1 8B)": (128, 500000.0, LLAMA31),
    "llama3.1 scaling, other factors": (64, 500000.0, {"factor": 32.0, "low_freq_factor": 2.0,
                                                       "high_freq_factor": 8.0,
                                                       "original_max_position_embeddings": 512}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inverse_frequencies_equal_transformers(case):
    require_module("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, scaling = ROPE_CASES[case]
    config = _transformers_llama(head_dim, theta, scaling)
    if scaling is None:
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = inverse_frequencies(_ours(head_dim, theta, scaling))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    if scaling is not None:  # the case reaches all three bands: kept, divided by the factor, blended
        plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(_transformers_llama(head_dim, theta))
        ratio = (theirs / plain).tolist()
        assert min(ratio) == pytest.approx(1 / scaling["factor"]) and max(ratio) == pytest.approx(1.0)
        assert any(1 / scaling["factor"] * 1.01 < r < 0.99 for r in ratio)


def test_rotated_queries_and_keys_equal_transformers():
    require_module("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 500000.0
    # [b, s]. Small positions: both sides round the angle position x frequency in fp32, from
    # frequencies that agree to 1e-6 (the test above), so far positions would differ by that much
    # times the position.
    positions = torch.stack((torch.arange(12), torch.arange(12) + 37))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, head_dim, generator=generator)  # [b, heads, s, d], transformers' layout
    k = torch.randn(2, 4, 12, head_dim, generator=generator)
    scaling = dict(LLAMA31, original_max_position_embeddings=4096)
    cos, sin = LlamaRotaryEmbedding(_transformers_llama(head_dim, theta, scaling))(q, positions)
    q_theirs, k_theirs = apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = RotaryEmbedding(_ours(head_dim, theta, scaling), None)(positions)  # [s, b, 1, d]
    for x, theirs in ((q, q_theirs), (k, k_theirs)):
        ours = apply_rotary(x.permute(2, 0, 1, 3), our_cos, our_sin).permute(1, 2, 0, 3)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules against closed forms


def _closed_form(style: str, step: int, *, max_lr=3e-4, min_lr=3e-5, warmup=10, decay=100, tail=30,
                 tail_style="exponential") -> float:
    """Megatron-LM's schedule written out: linear warm-up from 0; then constant, or (past the decay
    steps: min_lr) linear / cosine from max_lr to min_lr over the decay span, max_lr sqrt(warmup /
    step) floored at min_lr, or WSD: max_lr until the last `tail` decay steps, then the tail shape."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1) / max(step, 1)))
    fraction = (step - warmup) / (decay - warmup)
    shapes = {"linear": lambda f: 1 - f, "cosine": lambda f: (1 + math.cos(math.pi * f)) / 2,
              "exponential": lambda f: 2 * 0.5 ** f - 1}
    if style == "WSD":
        if step <= decay - tail:
            return max_lr
        return min_lr + shapes[tail_style]((step - (decay - tail)) / tail) * (max_lr - min_lr)
    return min_lr + shapes[style](fraction) * (max_lr - min_lr)


@pytest.mark.parametrize("style, tail_style", [("constant", None), ("linear", None), ("cosine", None),
                                               ("inverse-square-root", None), ("WSD", "exponential"),
                                               ("WSD", "linear"), ("WSD", "cosine")])
def test_learning_rate_is_the_closed_form_at_every_step(style, tail_style):
    config = LRScheduleConfig(max_lr=3e-4, min_lr=3e-5, warmup_steps=10, decay_steps=100, decay_style=style,
                              wsd_decay_steps=30, wsd_decay_style=tail_style or "exponential")
    for step in range(0, 131):  # warm-up, decay, and 30 steps past it
        expected = _closed_form(style, step, tail_style=tail_style or "exponential")
        assert learning_rate(config, step) == pytest.approx(expected, rel=1e-12, abs=1e-15), step
    # Landmarks, by hand: half way through the warm-up, the end of the decay, past it.
    assert learning_rate(config, 5) == pytest.approx(1.5e-4, rel=1e-12)
    assert learning_rate(config, 100) == pytest.approx(3e-5 if style not in ("constant", "inverse-square-root")
                                                       else _closed_form(style, 100), rel=1e-12)
    assert learning_rate(config, 101) == pytest.approx(3e-4 if style == "constant" else 3e-5, rel=1e-12)


def test_inverse_square_root_values_by_hand():
    config = LRScheduleConfig(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=1000,
                              decay_style="inverse-square-root")
    assert [learning_rate(config, s) for s in (2, 4, 16, 64, 400)] == pytest.approx([0.5, 1.0, 0.5, 0.25, 0.1])


# ---------------------------------------------------------------------------------------------
# Weight decay

def _gpt2_like() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, padded_vocab_size=32, ffn_hidden_size=32,
                             max_position_embeddings=8, normalization="LayerNorm", add_bias_linear=True,
                             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)


def _decays(name: str) -> bool:
    """Megatron's rule, by name: biases and norm parameters are not decayed; every other weight is
    (embeddings and the output layer included)."""
    return not (name.endswith(".bias") or "layernorm" in name or "final_norm" in name)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed optimizer"])
def test_weight_decay_groups_by_name_and_their_effect(distributed):
    groups = single_process()
    model = GPTModel(_gpt2_like(), groups)
    model.initialize_parameters(5)
    chunk = DistributedDataParallel(model, groups,
                                    ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distributed))
    lr, wd = 0.1, 0.25
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=lr, weight_decay=wd, clip_grad=0.0), [chunk], groups)
    names = dict(model.named_parameters())
    decayed = {name for name in names if _decays(name)}
    assert {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer"} <= decayed
    assert any("layernorm" in name for name in set(names) - decayed)
    assert any(name.endswith(".bias") for name in set(names) - decayed)
    before = {name: param.detach().clone() for name, param in names.items()}
    chunk.zero_grad_buffer()  # zero gradients: AdamW's step is then the decay alone
    applied, _ = optimizer.step()
    assert applied
    for name, param in names.items():
        expected = before[name] * (1 - lr * wd) if name in decayed else before[name]
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Loss masking

def test_masked_loss_gradients_and_reported_average_equal_cross_entropy_with_ignored_tokens():
    import pretrain_gpt
    from megatron.training.training import local_sums, reduce_reported

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=32,
                               ffn_hidden_size=32, max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, single_process(), execution=ExecutionConfig(gradient_accumulation_fusion=False))
    model.initialize_parameters(11)
    generator = torch.Generator().manual_seed(3)
    micro_batches = []
    for kept in (0.3, 0.9):  # different numbers of counted tokens per micro-batch
        tokens = torch.randint(0, 32, (2, 9), generator=generator)
        mask = (torch.rand(2, 8, generator=generator) < kept).float()
        mask[0, 0] = 1.0
        micro_batches.append((tokens[:, :-1], tokens[:, 1:], mask))
    positions = torch.arange(8).expand(2, 8)

    reported = []
    for tokens, labels, mask in micro_batches:
        model.zero_grad()
        loss, values = pretrain_gpt.loss_func(mask, None, False, model(tokens, positions, labels=labels))
        loss.backward()
        ours = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        logits = model(tokens, positions).transpose(0, 1).float()  # [b, s, V]
        ignored = labels.masked_fill(mask == 0, -100)
        expected = F.cross_entropy(logits.reshape(-1, 32), ignored.reshape(-1), ignore_index=-100)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        reported.append(values)

    # The log line's loss: every counted token of the step weighs the same.
    logits = torch.cat([model(t, positions).transpose(0, 1) for t, _, _ in micro_batches]).float()
    ignored = torch.cat([lab.masked_fill(m == 0, -100) for _, lab, m in micro_batches])
    token_mean = F.cross_entropy(logits.reshape(-1, 32), ignored.reshape(-1), ignore_index=-100).item()
    groups = SimpleNamespace(dp_cp=None)
    logged = reduce_reported(groups, [local_sums(reported)])["lm loss"]
    assert logged == pytest.approx(token_mean, rel=1e-6)
    per_micro_batch_mean = sum(v["lm loss"][0] / v["lm loss"][1] for v in reported).item() / 2
    assert abs(per_micro_batch_mean - token_mean) > 1e-3  # the two averages differ here: the test can tell
