"""Single-process unit tests of the building blocks, each against a reference written here."""
import math
import threading
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core import parallel_state
from megatron.core.distributed import replica_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel import cross_entropy as tp_cross_entropy
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import Part, TPLayout, replicated_layout, split_layout
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norm import LayerNorm, RMSNorm, build_norm
from megatron.core.transformer.fusions import rotary as apply_rotary
from megatron.core.transformer.rope import RotaryEmbedding, inverse_frequencies

SINGLE = dict(tp=TensorParallel(), device=None)


def make_config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                max_position_embeddings=4096, hidden_dropout=0.0, attention_dropout=0.0,
                group_query_attention="num_query_groups" in overrides)
    return derive(TransformerConfig(**(base | overrides)))


def llama_like(**overrides) -> TransformerConfig:
    return make_config(**(dict(normalization="RMSNorm", swiglu=True,
                               add_bias_linear=False, position_embedding_type="rope") | overrides))


@torch.no_grad()
def fill_random(module: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1]))


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_manual(dtype):
    norm = build_norm(llama_like(norm_epsilon=1e-6), 32, tp=TensorParallel(), device=None)
    assert isinstance(norm, RMSNorm)
    fill_random(norm)
    x = randn(5, 2, 32, seed=1, dtype=dtype)
    x64, w64 = x.double(), norm.weight.double()
    expected = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / 32 + 1e-6) * w64
    out = norm(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_layernorm_matches_torch_and_manual():
    norm = build_norm(make_config(norm_epsilon=1e-5), 32, tp=TensorParallel(), device=None)
    assert isinstance(norm, LayerNorm)
    fill_random(norm)
    reference = torch.nn.LayerNorm(32, eps=1e-5)
    reference.load_state_dict(norm.state_dict())
    x = randn(5, 2, 32, seed=1) * 3 + 1
    torch.testing.assert_close(norm(x), reference(x))
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    torch.testing.assert_close(norm(x), (x - mean) / torch.sqrt(variance + 1e-5) * norm.weight + norm.bias)


def test_norm_layouts_replicated_and_sum_grads_only_with_sequence_parallel():
    for sequence_parallel, tp_size, expected in ((False, 2, False), (True, 1, False), (True, 2, True)):
        norm = build_norm(make_config(), 32, execution=ExecutionConfig(sequence_parallel=sequence_parallel),
                          tp=TensorParallel(size=tp_size, rank=1), device=None)
        for name, param in norm.named_parameters():
            (part,) = param.tp_layout.parts
            assert (part.full_size, part.num_shards, part.sum_replica_grads) == (32, 1, expected)
            assert param.init == ("ones" if name == "weight" else "zeros")


# ------------------------------------------------------------------------------------------------
# Rotary embeddings (reference: complex rotation of the pairs (i, i + d/2), frequencies in Python)
# ------------------------------------------------------------------------------------------------
def reference_frequencies(base, dim, scaling=None):
    freqs = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if scaling is None:
        return freqs
    factor, low, high, original = scaling
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:  # high frequency: kept
            out.append(freq)
        elif wavelength > original / low:  # low frequency: slowed by `factor`
            out.append(freq / factor)
        else:  # in between: linear blend in 1/wavelength
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def reference_rotary(x, positions, freqs):
    """x [s, b, heads, d] with pair (i, i + d/2) rotated by positions[b, s] * freqs[i]."""
    half = len(freqs)
    angles = positions.t().double()[..., None, None] * torch.tensor(freqs, dtype=torch.float64)  # [s,b,1,d/2]
    pairs = torch.complex(x[..., :half].double(), x[..., half:2 * half].double()) * torch.polar(
        torch.ones_like(angles), angles)
    return torch.cat((pairs.real, pairs.imag, x[..., 2 * half:].double()), dim=-1)


def test_inverse_frequencies_default():
    config = llama_like(hidden_size=64, num_attention_heads=4, rotary_base=10000.0)
    torch.testing.assert_close(inverse_frequencies(config).double(),
                               torch.tensor(reference_frequencies(10000.0, 16), dtype=torch.float64), rtol=1e-6, atol=0)


def test_inverse_frequencies_llama31_scaling_covers_all_three_bands():
    config = llama_like(hidden_size=128, num_attention_heads=4, rotary_base=500000.0, use_rope_scaling=True,
                        rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_max_position_embeddings=64)
    expected = reference_frequencies(500000.0, 32, (8.0, 1.0, 4.0, 64))
    plain = reference_frequencies(500000.0, 32)
    bands = {"kept" if e == p else "divided" if math.isclose(e, p / 8) else "blended" for e, p in zip(expected, plain)}
    assert bands == {"kept", "divided", "blended"}
    torch.testing.assert_close(inverse_frequencies(config).double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rotary_matches_complex_rotation(rotary_percent):
    config = llama_like(hidden_size=64, num_attention_heads=4, rotary_percent=rotary_percent)
    rotary_dim = int(16 * rotary_percent)
    positions = torch.stack((torch.arange(10), torch.arange(10) + 37))  # [b, s], second sample offset
    cos, sin = RotaryEmbedding(config, None)(positions)
    assert cos.shape == (10, 2, 1, rotary_dim)
    x = randn(10, 2, 3, 16, seed=3)
    out = apply_rotary(x, cos, sin)
    expected = reference_rotary(x, positions, reference_frequencies(10000.0, rotary_dim))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    if rotary_percent < 1.0:
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_rotary_scores_depend_only_on_relative_position():
    config = llama_like(hidden_size=64, num_attention_heads=4)
    rotary = RotaryEmbedding(config, None)
    q, k = randn(1, 1, 1, 16, seed=4), randn(1, 1, 1, 16, seed=5)

    def score(m, n):
        cos_m, sin_m = rotary(torch.tensor([[m]]))
        cos_n, sin_n = rotary(torch.tensor([[n]]))
        return (apply_rotary(q, cos_m, sin_m) * apply_rotary(k, cos_n, sin_n)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-4, rtol=0)
    assert not torch.isclose(score(7, 3), score(7, 4), atol=1e-3)


# ------------------------------------------------------------------------------------------------
# MLP and attention
# ------------------------------------------------------------------------------------------------
def test_swiglu_mlp_matches_manual():
    config = llama_like(ffn_hidden_size=48)
    mlp = MLP(config, **SINGLE)
    fill_random(mlp)
    assert [p.name for p in mlp.linear_fc1.weight.tp_layout.parts] == ["gate", "up"]
    x = randn(6, 2, 32, seed=1)
    w1 = mlp.linear_fc1.weight
    gate, up = x @ w1[:48].t(), x @ w1[48:].t()
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_gelu_tanh_mlp_with_bias_matches_manual():
    config = make_config(openai_gelu=True, ffn_hidden_size=64)
    mlp = MLP(config, **SINGLE)
    fill_random(mlp)
    x = randn(6, 2, 32, seed=1)
    h = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    expected = h @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_gqa_self_attention_matches_manual():
    config = llama_like(hidden_size=32, num_attention_heads=4, num_query_groups=2)
    attention = SelfAttention(config, rng_tracker=None, **SINGLE).eval()
    fill_random(attention)
    s, b, heads, groups, d = 7, 2, 4, 2, 8
    x = randn(s, b, 32, seed=1)
    w = attention.linear_qkv.weight
    q = (x @ w[:32].t()).view(s, b, heads, d)
    k = (x @ w[32:48].t()).view(s, b, groups, d)
    v = (x @ w[48:].t()).view(s, b, groups, d)
    out = torch.empty(s, b, heads, d)
    causal = torch.ones(s, s).tril().bool()
    for head in range(heads):
        group = head // (heads // groups)  # consecutive query heads share a key/value group
        scores = torch.einsum("ibd,jbd->bij", q[:, :, head], k[:, :, group]) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[:, :, head] = torch.einsum("bij,jbd->ibd", probs, v[:, :, group])
    expected = out.reshape(s, b, 32) @ attention.linear_proj.weight.t()
    torch.testing.assert_close(attention(x), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Cross entropy
# ------------------------------------------------------------------------------------------------
class ThreadGroup:
    """A tensor-parallel group of threads standing in for `comm`: each rank runs in its own thread
    and the all-reduces meet at a barrier, so collective code runs unmodified in one process."""

    def __init__(self, size):
        self.world = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size
        self.local = threading.local()

    def size(self, group):
        return self.world

    def _reduce(self, tensor, combine):
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        result = combine(torch.stack(self.slots))
        self.barrier.wait()  # everyone has read the slots before the next collective writes them
        tensor.copy_(result)

    def all_reduce(self, tensor, group, op=None, async_op=False):
        self._reduce(tensor, lambda stacked: stacked.sum(0))

    def all_reduce_max(self, tensor, group):
        self._reduce(tensor, lambda stacked: stacked.max(0).values)

    def run(self, function):
        """function(rank) on every rank at once; returns the results in rank order."""
        results, errors = [None] * self.world, []

        def worker(rank):
            self.local.rank = rank
            try:
                results[rank] = function(rank)
            except BaseException as error:  # surfaced in the main thread below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def test_cross_entropy_group_of_one_matches_torch():
    logits, target = randn(5, 3, 50, seed=1) * 4, torch.randint(0, 50, (5, 3))
    loss = vocab_parallel_cross_entropy(logits, target, None)
    assert loss.shape == (5, 3) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.reshape(15, 50), target.reshape(15), reduction="none").view(5, 3)
    torch.testing.assert_close(loss, expected)
    bf16 = vocab_parallel_cross_entropy(logits.bfloat16(), target, None)
    assert bf16.dtype == torch.float32


def test_vocab_parallel_cross_entropy_function_forward_and_backward():
    """The tensor-parallel autograd function, run over a group of one (its collectives are no-ops)."""
    logits = (randn(5, 3, 50, seed=1) * 4).requires_grad_()
    target = torch.randint(0, 50, (5, 3), generator=torch.Generator().manual_seed(2))
    weights = randn(5, 3, seed=3)
    loss = _VocabParallelCrossEntropy.apply(logits, target, None, 0)
    (loss * weights).sum().backward()

    reference_logits = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(reference_logits.view(15, 50), target.view(15), reduction="none").view(5, 3)
    (expected * weights).sum().backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logits.grad, reference_logits.grad)


def test_vocab_parallel_cross_entropy_over_four_ranks(monkeypatch):
    group = ThreadGroup(4)
    monkeypatch.setattr(tp_cross_entropy, "comm", group)
    full = randn(5, 3, 20, seed=1) * 4
    target = torch.randint(0, 20, (5, 3), generator=torch.Generator().manual_seed(2))
    weights = randn(5, 3, seed=3)

    def rank_step(rank):
        logits = full[..., 5 * rank:5 * rank + 5].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, "tp", vocab_start=5 * rank)
        (loss * weights).sum().backward()
        return loss.detach(), logits.grad

    results = group.run(rank_step)
    reference = full.clone().requires_grad_()
    expected = F.cross_entropy(reference.view(15, 20), target.view(15), reduction="none").view(5, 3)
    (expected * weights).sum().backward()
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss, expected.detach())
        torch.testing.assert_close(grad, reference.grad[..., 5 * rank:5 * rank + 5])


# ------------------------------------------------------------------------------------------------
# TPLayout
# ------------------------------------------------------------------------------------------------
def qkv_layout(tp_size, tp_rank, *, heads=8, groups=2, head_dim=3):
    kv_shards = min(tp_size, groups)
    return TPLayout(0, (Part("q", heads * head_dim, tp_size),
                        Part("k", groups * head_dim, kv_shards, sum_replica_grads=True),
                        Part("v", groups * head_dim, kv_shards, sum_replica_grads=True)), tp_size, tp_rank)


def qkv_full(heads=8, groups=2, head_dim=3, columns=5):
    return {"q": randn(heads * head_dim, columns, seed=1), "k": randn(groups * head_dim, columns, seed=2),
            "v": randn(groups * head_dim, columns, seed=3)}


def simulated_tp_comm(locals_by_rank, dim):
    """A stand-in for `comm` inside tensor_parallel.layers: its all-gather returns every rank's
    local tensor (prepared in advance), as a real TP group would."""

    def all_gather_into_tensor(output, input_, group):
        output.copy_(torch.cat([t.movedim(dim, 0) for t in locals_by_rank]))

    return types.SimpleNamespace(size=lambda group: len(locals_by_rank),
                                 all_gather_into_tensor=all_gather_into_tensor)


def test_qkv_layout_with_replicated_kv_slices_by_hand():
    """8 heads, 2 KV groups, TP=4: rank r holds query heads 2r, 2r+1 and KV group r // 2."""
    full = qkv_full()
    for rank in range(4):
        layout = qkv_layout(4, rank)
        local = layout.full_to_local(full)
        group = rank // 2
        expected = torch.cat((full["q"][6 * rank:6 * rank + 6], full["k"][3 * group:3 * group + 3],
                              full["v"][3 * group:3 * group + 3]))
        assert torch.equal(local, expected)
        assert [(p.name, offset, length) for p, offset, length in layout.local_offsets()] == [
            ("q", 0, 6), ("k", 6, 3), ("v", 9, 3)]
        assert layout.replicas(layout.parts[0]) == 1 and layout.replicas(layout.parts[1]) == 2


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_qkv_layout_round_trip(tp_size, monkeypatch):
    full = qkv_full()
    locals_by_rank = [qkv_layout(tp_size, r).full_to_local(full) for r in range(tp_size)]
    monkeypatch.setattr(tp_layers, "comm", simulated_tp_comm(locals_by_rank, dim=0))
    for rank in range(tp_size):
        back = qkv_layout(tp_size, rank).local_to_full(locals_by_rank[rank], group="tp")
        assert back.keys() == full.keys()
        for name in full:
            assert torch.equal(back[name], full[name]), (tp_size, rank, name)


def test_gate_up_and_row_parallel_layouts_round_trip(monkeypatch):
    gate, up = randn(8, 4, seed=1), randn(8, 4, seed=2)
    fc1 = [TPLayout(0, (Part("gate", 8, 2), Part("up", 8, 2)), 2, r) for r in range(2)]
    locals_by_rank = [layout.full_to_local({"gate": gate, "up": up}) for layout in fc1]
    assert torch.equal(locals_by_rank[1], torch.cat((gate[4:], up[4:])))
    monkeypatch.setattr(tp_layers, "comm", simulated_tp_comm(locals_by_rank, dim=0))
    back = fc1[1].local_to_full(locals_by_rank[1], group="tp")
    assert torch.equal(back["gate"], gate) and torch.equal(back["up"], up)

    weight = randn(4, 12, seed=3)  # row-parallel: split along the input features (dim 1)
    rows = [split_layout(1, 12, 3, r, "input features") for r in range(3)]
    locals_by_rank = [layout.full_to_local({"": weight}) for layout in rows]
    assert torch.equal(locals_by_rank[2], weight[:, 8:])
    monkeypatch.setattr(tp_layers, "comm", simulated_tp_comm(locals_by_rank, dim=1))
    assert torch.equal(rows[0].local_to_full(locals_by_rank[0], group="tp")[""], weight)


def test_split_layout_names_the_flag():
    with pytest.raises(ValueError, match=r"10 is not divisible by 4 \(rows by --tensor-model-parallel-size\)"):
        split_layout(0, 10, 4, 0, "rows")


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_unique_square_norm_counts_replicas_once(tp_size):
    full = qkv_full()
    total = sum(qkv_layout(tp_size, r).unique_square_norm(qkv_layout(tp_size, r).full_to_local(full))
                for r in range(tp_size))
    expected = sum(t.double().pow(2).sum() for t in full.values())
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)

    # A replicated parameter (a norm weight) counts once over the group, not tp_size times.
    weight = randn(7, seed=4)
    norms = [replicated_layout((7,), tp_size, r).unique_square_norm(weight) for r in range(tp_size)]
    torch.testing.assert_close(sum(norms), weight.pow(2).sum())


def test_sum_partial_replica_grads_sums_over_the_ranks_sharing_a_slice(monkeypatch):
    """TP=4, 2 KV groups: k/v gradients are summed over ranks {0, 1} and {2, 3}; q is left alone.
    A replicated part marked sum_replica_grads (a sequence-parallel norm) is summed over all ranks."""
    group = ThreadGroup(4)
    monkeypatch.setattr(replica_grads, "comm", group)
    grads = [randn(12, 5, seed=10 + r) for r in range(4)]
    norm_grads = [randn(7, seed=20 + r) for r in range(4)]

    def rank_step(rank):
        grad, norm_grad = grads[rank].clone(), norm_grads[rank].clone()
        qkv_layout(4, rank).sum_partial_replica_grads(grad, "tp")
        replicated_layout((7,), 4, rank, sum_replica_grads=True).sum_partial_replica_grads(norm_grad, "tp")
        return grad, norm_grad

    results = group.run(rank_step)
    for rank, (grad, norm_grad) in enumerate(results):
        partner = rank ^ 1
        assert torch.equal(grad[:6], grads[rank][:6])
        torch.testing.assert_close(grad[6:], grads[rank][6:] + grads[partner][6:])
        torch.testing.assert_close(norm_grad, sum(norm_grads))


# ------------------------------------------------------------------------------------------------
# Initialization
# ------------------------------------------------------------------------------------------------
def built(config, seed, groups=None, **kwargs):
    model = GPTModel(config, groups or parallel_state.single_process(), **kwargs)
    model.initialize_parameters(seed)
    return model


def test_initialization_is_deterministic_and_seed_dependent():
    config = llama_like(num_query_groups=2, untie_embeddings_and_output_weights=True)
    first, again, other = built(config, 1234), built(config, 1234), built(config, 1235)
    for (name, a), (_, b), (_, c) in zip(first.named_parameters(), again.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
        if a.init in ("normal", "scaled_normal"):
            assert not torch.equal(a, c), name
    assert not torch.equal(first.output_layer, first.embedding.word_embeddings.weight)


def test_initialization_differs_across_layers_and_fused_parts():
    model = built(llama_like(), 7)
    layer0, layer1 = model.decoder.layers
    for name, param in layer0.named_parameters():
        other = dict(layer1.named_parameters())[name]
        if param.init in ("normal", "scaled_normal"):
            assert not torch.equal(param, other), name
        else:
            assert torch.equal(param, other), name
    qkv = layer0.self_attention.linear_qkv.weight  # MHA: q, k, v parts have the same shape
    q, k, v = qkv.split(32)
    assert not torch.equal(q, k) and not torch.equal(k, v)
    gate, up = layer0.mlp.linear_fc1.weight.chunk(2)
    assert not torch.equal(gate, up)


def test_initialization_rules():
    config = make_config(hidden_size=64, num_attention_heads=4, num_layers=8, init_method_std=0.02)
    model = built(config, 3)
    layer = model.decoder.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))
    assert torch.equal(layer.input_layernorm.bias, torch.zeros(64))
    assert torch.equal(layer.self_attention.linear_qkv.bias, torch.zeros(192))
    # Output projections of the residual branches are scaled by 1/sqrt(2 * num_layers).
    scaled_std = 0.02 / math.sqrt(2 * 8)
    assert layer.self_attention.linear_proj.weight.std().item() == pytest.approx(scaled_std, rel=0.05)
    assert layer.mlp.linear_fc2.weight.std().item() == pytest.approx(scaled_std, rel=0.05)
    assert layer.mlp.linear_fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_initialization_is_tensor_parallel_invariant(tp_size):
    """Rank r of a TP model starts from its slice of the TP=1 weights (built alone: construction
    and initialization issue no collectives)."""
    config = llama_like(hidden_size=32, num_attention_heads=4, num_query_groups=2, padded_vocab_size=64,
                        untie_embeddings_and_output_weights=True)
    reference = built(config, 11)
    full = {reference.global_param_name(n): p.tp_layout.local_to_full(p, None)
            for n, p in reference.named_parameters()}
    for rank in range(tp_size):
        model = built(config, 11, ParallelGroups(tp_size=tp_size, tp_rank=rank))
        for name, param in model.named_parameters():
            expected = param.tp_layout.full_to_local(full[model.global_param_name(name)])
            assert torch.equal(param, expected), (rank, name)


def test_initialization_is_pipeline_invariant_and_ties_the_last_stage_head():
    config = llama_like()
    reference = built(config, 5)
    last_stage = built(config, 5, pre_process=False, layer_numbers=[1])
    assert torch.equal(last_stage.decoder.layers[0].mlp.linear_fc1.weight,
                       reference.decoder.layers[1].mlp.linear_fc1.weight)
    assert last_stage.global_param_name("output_layer") == "embedding.word_embeddings.weight"
    assert torch.equal(last_stage.output_layer, reference.embedding.word_embeddings.weight)


# ------------------------------------------------------------------------------------------------
# Config validation
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, tp_size, message", [
    (dict(num_attention_heads=6, hidden_size=48), 4,
     r"6 is not divisible by 4 \(--num-attention-heads by --tensor-model-parallel-size\)"),
    (dict(num_attention_heads=8, ffn_hidden_size=100), 8,
     r"100 is not divisible by 8 \(--ffn-hidden-size by --tensor-model-parallel-size\)"),
    (dict(num_attention_heads=8, padded_vocab_size=100), 8,
     r"100 is not divisible by 8 \(padded vocabulary size by --tensor-model-parallel-size\)"),
    (dict(num_attention_heads=12, hidden_size=48, num_query_groups=6), 4,
     r"6 is not divisible by 4 \(--num-query-groups by --tensor-model-parallel-size\)"),
    (dict(num_attention_heads=12, hidden_size=48, num_query_groups=3), 4,
     r"4 is not divisible by 3 \(--tensor-model-parallel-size by --num-query-groups"),
])
def test_check_tensor_parallel_names_the_flags(overrides, tp_size, message):
    config = make_config(**overrides)
    with pytest.raises(ValueError, match=message):
        config.check_tensor_parallel(tp_size)
    with pytest.raises(ValueError, match=message):  # raised when the model is built, not mid-step
        GPTModel(config, ParallelGroups(tp_size=tp_size))


def test_valid_tensor_parallel_shapes_pass():
    make_config(num_attention_heads=8, num_query_groups=2).check_tensor_parallel(8)
    make_config(num_attention_heads=8, num_query_groups=8).check_tensor_parallel(4)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=30), r"30 is not divisible by 4 \(--hidden-size by --num-attention-heads\)"),
    (dict(num_query_groups=3), r"4 is not divisible by 3 \(--num-attention-heads by --num-query-groups\)"),
    (dict(normalization="BatchNorm"), "--normalization"),
    (dict(position_embedding_type="alibi"), "--position-embedding-type"),
])
def test_config_post_init_errors_name_the_flags(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)
