"""Activation recomputation: same gradients (dropout included) with fewer saved activations."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, build_tracker, checkpoint
from megatron.core.transformer.block import recompute_segments
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig

SEED = 1234


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, padded_vocab_size=128, max_position_embeddings=32,
                hidden_dropout=0.1, attention_dropout=0.1, position_embedding_type="rope",
                normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    base.update(overrides)
    return TransformerConfig(**base)


class _SavedBytes:
    """Counts bytes autograd keeps for backward (live now, and the peak), via saved_tensors_hooks."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def pack(self, tensor):
        return _Held(self, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, counter: _SavedBytes, tensor: torch.Tensor):
        self.counter, self.tensor = counter, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


def _train_step(config: TransformerConfig = None, execution: ExecutionConfig = ExecutionConfig()):
    """One forward/backward from fixed seeds; returns (loss, {name: grad}, peak saved bytes)."""
    tracker = build_tracker(SEED, 0, 0, torch.device("cpu"))  # also seeds the default generator
    model = GPTModel(config or _config(), single_process(), execution=execution, rng_tracker=tracker)
    model.initialize_parameters(SEED)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (2, 32), generator=generator)
    labels = torch.randint(0, 128, (2, 32), generator=generator)
    positions = torch.arange(32).expand(2, 32)
    counter = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, _SavedBytes.unpack):
        loss = model(tokens, positions, labels=labels).mean()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, counter.peak


def _assert_same(reference, other):
    loss_ref, grads_ref, _ = reference
    loss, grads, _ = other
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_recompute_matches_gradients_with_dropout_and_saves_memory():
    reference = _train_step(_config())
    full = dict(recompute_granularity="full")
    full_uniform = _train_step(execution=ExecutionConfig(**full, recompute_method="uniform", recompute_num_layers=1))
    full_block = _train_step(execution=ExecutionConfig(**full, recompute_method="block", recompute_num_layers=3))
    full_uniform_pairs = _train_step(execution=ExecutionConfig(**full, recompute_method="uniform",
                                                               recompute_num_layers=2))
    selective = _train_step(execution=ExecutionConfig(recompute_granularity="selective"))
    for run in (full_uniform, full_block, full_uniform_pairs, selective):
        _assert_same(reference, run)
    no_recompute_peak = reference[2]
    # Peak bytes held for backward, recomputation in backward included: one layer's activations
    # plus the 4 layer inputs, against all 4 layers' activations.
    assert full_uniform[2] < 0.3 * no_recompute_peak, (full_uniform[2], no_recompute_peak)
    assert full_block[2] < 0.5 * no_recompute_peak, (full_block[2], no_recompute_peak)
    assert selective[2] < 0.9 * no_recompute_peak, (selective[2], no_recompute_peak)
    # Dropout really was active (else the RNG restoration would not be tested): with other masks the
    # loss differs.
    assert _train_step(_config(hidden_dropout=0.0, attention_dropout=0.0))[0] != pytest.approx(reference[0])


def test_checkpoint_restores_default_and_tracker_rng():
    tracker = build_tracker(SEED, 0, 0, torch.device("cpu"))

    def noisy(x, weight):
        y = F.dropout(x @ weight, 0.5, training=True)             # default stream
        with tracker.fork():
            return F.dropout(torch.tanh(y), 0.5, training=True)   # tracker stream

    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(16, 16, requires_grad=True)
    start_default, start_tracker = torch.get_rng_state(), tracker.get_states()
    expected = noisy(x, weight)
    expected.sum().backward()
    expected_grads = (x.grad.clone(), weight.grad.clone())
    after_default, after_tracker = torch.get_rng_state(), tracker.get_states()

    x.grad = weight.grad = None
    torch.set_rng_state(start_default)
    tracker.set_states(start_tracker)
    out = checkpoint(noisy, tracker, x, weight)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close((x.grad, weight.grad), expected_grads, rtol=0, atol=0)
    # The caller's streams continue as if no recomputation had happened.
    assert torch.equal(torch.get_rng_state(), after_default)
    assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], after_tracker[MODEL_PARALLEL_RNG])


def test_recompute_segments():
    config = ExecutionConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    assert recompute_segments(config, 7) == [(0, 3, True), (3, 6, True), (6, 7, True)]
    config = dataclasses.replace(config, recompute_method="block", recompute_num_layers=2)
    assert recompute_segments(config, 5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert recompute_segments(config, 1) == [(0, 1, True)]
    assert recompute_segments(ExecutionConfig(recompute_granularity="selective"), 4) == [(0, 4, False)]


@pytest.mark.parametrize("overrides, message", [
    (dict(recompute_granularity="full"), r"--recompute-granularity full needs --recompute-method"),
    (dict(recompute_granularity="full", recompute_method="block"), r"--recompute-num-layers >= 1, got None"),
    (dict(recompute_method="uniform"), r"--recompute-method uniform needs --recompute-granularity full"),
])
def test_bad_recompute_flags(overrides, message):
    with pytest.raises(ValueError, match=message):
        recompute_segments(ExecutionConfig(**overrides), 4)
