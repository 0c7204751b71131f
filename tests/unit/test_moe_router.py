"""The router's arithmetic against Megatron-Core's own functions (run in a separate process on the
same random inputs, see megatron_core_moe_reference.py), plus the capacity rule on a hand-computed
case and the --moe-layer-freq patterns."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.parallel_state import TensorParallel
from megatron.core.transformer.config import TransformerConfig, derive
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import AuxLossTracker, TopKRouter
from tests.optional import require_megatron_core, skip_unless_importable_by_megatron_core

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERTS, TOKENS = 8, 24

TOPK_OPTIONS = [
    dict(score_function="softmax", pre_softmax=False, topk=2, num_groups=None, group_topk=None, scaling_factor=None),
    dict(score_function="softmax", pre_softmax=True, topk=2, num_groups=None, group_topk=None, scaling_factor=None),
    dict(score_function="softmax", pre_softmax=True, topk=3, num_groups=4, group_topk=2, scaling_factor=2.5),
    dict(score_function="sigmoid", pre_softmax=False, topk=2, num_groups=None, group_topk=None, scaling_factor=None),
    dict(score_function="sigmoid", pre_softmax=False, topk=4, num_groups=4, group_topk=2, scaling_factor=2.5,
         bias=True),
    dict(score_function="sigmoid", pre_softmax=False, topk=1, num_groups=None, group_topk=None, scaling_factor=None),
]
ROUTER_OPTIONS = [
    dict(score_function="softmax", pre_softmax=False, topk=2, num_groups=None, group_topk=None, scaling_factor=None,
         coeffs={"aux_loss": 0.01}, z_loss_coeff=1e-3),
    dict(score_function="sigmoid", pre_softmax=False, topk=2, num_groups=4, group_topk=2, scaling_factor=None,
         coeffs={"seq_aux_loss": 0.1}, z_loss_coeff=None),
    dict(score_function="softmax", pre_softmax=True, topk=3, num_groups=None, group_topk=None, scaling_factor=1.5,
         coeffs={"aux_loss": 0.02, "seq_aux_loss": 0.05}, z_loss_coeff=0.01),
]
# Every drop policy x padding x capacity factor, at two token counts: with 24 tokens (48 routed
# rows over 8 experts) the capacities are whole numbers, with 10 tokens (20 rows) they are fractional
# (1.25, 2.5, 10), so rounding the capacity down instead of up changes which tokens are kept.
DROP_OPTIONS = [dict(drop_policy=policy, pad_to_capacity=pad, capacity_factor=factor, tokens=tokens)
                for tokens in (TOKENS, 10) for policy in ("probs", "position") for pad in (False, True)
                for factor in (0.5, 1.0, 4.0)]


def moe_config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, padded_vocab_size=64, ffn_hidden_size=32,
                num_experts=EXPERTS, moe_ffn_hidden_size=8)
    return derive(TransformerConfig(**(base | overrides)))


def _cases(generator):
    cases = []
    for options in TOPK_OPTIONS:
        case = dict(kind="topk", logits=torch.randn(TOKENS, EXPERTS, generator=generator),
                    **{k: v for k, v in options.items() if k != "bias"})
        if options.get("bias"):
            case["expert_bias"] = torch.randn(EXPERTS, generator=generator) * 0.1
        cases.append(case)
    for options in DROP_OPTIONS:
        logits = torch.randn(options["tokens"], EXPERTS, generator=generator)
        probs, routing_map = moe_utils.topk_routing(logits, 2)
        cases.append(dict(kind="dropping", probs=probs, routing_map=routing_map, topk=2,
                          **{k: v for k, v in options.items() if k != "tokens"}))
    for options in ROUTER_OPTIONS:
        cases.append(dict(kind="router", weight=torch.randn(EXPERTS, 16, generator=generator) * 0.5,
                          x=torch.randn(6, 4, 16, generator=generator),
                          probe=torch.randn(TOKENS, EXPERTS, generator=generator), **options))
    cases.append(dict(kind="expert_bias", tokens_per_expert=torch.randint(0, 9, (EXPERTS,), generator=generator).float(),
                      expert_bias=torch.randn(EXPERTS, generator=generator), rate=1e-3))
    cases.append(dict(kind="z_loss", logits=torch.randn(TOKENS, EXPERTS, generator=generator) * 3, coeff=1e-3))
    return cases


def _ours(case):
    kind = case["kind"]
    if kind == "topk":
        probs, routing_map = moe_utils.topk_routing(
            case["logits"], case["topk"], score_function=case["score_function"], pre_softmax=case["pre_softmax"],
            num_groups=case["num_groups"], group_topk=case["group_topk"], scaling_factor=case["scaling_factor"],
            expert_bias=case.get("expert_bias"))
        return {"probs": probs, "routing_map": routing_map}
    if kind == "dropping":
        probs, routing_map = moe_utils.drop_tokens_over_capacity(
            case["probs"], case["routing_map"], case["topk"], case["capacity_factor"], case["drop_policy"],
            case["pad_to_capacity"])
        return {"probs": probs, "routing_map": routing_map}
    if kind == "router":
        return _our_router(case)
    if kind == "expert_bias":
        return {"bias": moe_utils.updated_expert_bias(case["tokens_per_expert"], case["expert_bias"], case["rate"])}
    return {"loss": moe_utils.z_loss(case["logits"], case["coeff"])}


def _our_router(case):
    coeffs = case["coeffs"]
    config = moe_config(moe_router_topk=case["topk"], moe_router_score_function=case["score_function"],
                        moe_router_pre_softmax=case["pre_softmax"], moe_router_num_groups=case["num_groups"],
                        moe_router_group_topk=case["group_topk"],
                        moe_router_topk_scaling_factor=case["scaling_factor"],
                        moe_router_load_balancing_type=list(coeffs), moe_aux_loss_coeff=list(coeffs.values()),
                        moe_z_loss_coeff=case["z_loss_coeff"])
    router = TopKRouter(config, layer_number=0, tp=TensorParallel())
    router.tracker = AuxLossTracker(config.num_layers)
    with torch.no_grad():
        router.weight.copy_(case["weight"])
    x = case["x"].clone().requires_grad_(True)
    probs, routing_map = router(x)
    (probs * case["probe"]).sum().backward()
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    losses = {f"loss_{kind}": router.tracker.values[names[kind]][0] * coeff for kind, coeff in coeffs.items()}
    return {"probs": probs.detach(), "routing_map": routing_map, "weight_grad": router.weight.grad, "x_grad": x.grad,
            **losses}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = require_megatron_core("megatron/core/transformer/moe/moe_utils.py")
    generator = torch.Generator().manual_seed(7)
    cases = _cases(generator)
    folder = tmp_path_factory.mktemp("moe_reference")
    source, target = folder / "in.pt", folder / "out.pt"
    torch.save({"cases": cases}, source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "megatron_core_moe_reference.py"),
                           str(source), str(target)], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        skip_unless_importable_by_megatron_core(done.stderr)
        raise AssertionError(done.stderr[-3000:])
    return cases, torch.load(target, weights_only=True)["results"]


def test_router_functions_equal_megatron_core(reference):
    cases, results = reference
    kinds = set()
    for index, (case, expected) in enumerate(zip(cases, results)):
        ours = _ours(case)
        assert set(ours) == set(expected), case["kind"]
        for key, value in expected.items():
            where = f"case {index} ({case['kind']}, {key})"
            if value.dtype == torch.bool:
                assert torch.equal(ours[key], value), where
            else:
                torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7, msg=where)
        kinds.add(case["kind"])
    assert kinds == {"topk", "dropping", "router", "expert_bias", "z_loss"}


def test_capacity_rule_hand_computed():
    # 4 tokens, 2 experts, top-1: capacity = ceil(4 * 1 / 2 * 0.5) = 1 token per expert.
    probs = torch.tensor([[0.9, 0.0], [0.7, 0.0], [0.0, 0.6], [0.8, 0.0]])
    routing_map = probs > 0
    kept_probs, kept = moe_utils.drop_tokens_over_capacity(probs, routing_map, 1, 0.5, "probs")
    assert kept.tolist() == [[True, False], [False, False], [False, True], [False, False]]
    assert kept_probs[0, 0] == 0.9 and kept_probs.sum() == pytest.approx(1.5)
    # Capacity 2: expert 0 keeps tokens 0 and 3 (the highest probabilities); with padding every
    # expert fills its 2 slots (expert 1's extra slot has weight 0).
    _, kept = moe_utils.drop_tokens_over_capacity(probs, routing_map, 1, 1.0, "probs")
    assert kept[:, 0].tolist() == [True, False, False, True] and kept[:, 1].tolist() == [False, False, True, False]
    padded_probs, padded = moe_utils.drop_tokens_over_capacity(probs, routing_map, 1, 1.0, "probs",
                                                               pad_to_capacity=True)
    assert padded.sum(0).tolist() == [2, 2] and padded_probs[:, 1].sum() == pytest.approx(0.6)
    # "position" keeps routed tokens only, capacity of them per expert (ties ordered as torch.topk).
    _, kept = moe_utils.drop_tokens_over_capacity(probs, routing_map, 1, 0.5, "position")
    assert kept.sum(0).tolist() == [1, 1] and not (kept & ~routing_map).any()


def test_expert_bias_changes_choice_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    probs, routing_map = moe_utils.topk_routing(logits, 1, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[False, False, False, True]]
    assert probs[0, 3] == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_router_counts_tokens_for_expert_bias_and_updates():
    config = moe_config(moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_load_balancing_type="none")
    router = TopKRouter(config, layer_number=0, tp=TensorParallel())
    torch.nn.init.normal_(router.weight)
    _, routing_map = router(torch.randn(3, 2, 16))
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(0).float())
    expected = moe_utils.updated_expert_bias(routing_map.sum(0).float(), torch.zeros(EXPERTS), 1e-3)
    router.update_expert_bias(None)
    assert torch.equal(router.expert_bias, expected) and router.local_tokens_per_expert.sum() == 0
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()


@pytest.mark.parametrize("freq, expected", [
    (1, [1, 1, 1, 1]), (2, [1, 0, 1, 0]), ("[0]*1+[1]*3", [0, 1, 1, 1]), ("([1]+[0])*2", [1, 0, 1, 0]),
    ([0, 1, 1, 0], [0, 1, 1, 0])])
def test_moe_layer_pattern(freq, expected):
    assert moe_utils.moe_layer_pattern(freq, 4) == expected


@pytest.mark.parametrize("freq, message", [
    ("[1]*3", "one 0 or 1 per layer"), ("__import__('os')", "neither an integer nor a pattern"), (0, ">= 1")])
def test_moe_layer_pattern_errors(freq, message):
    with pytest.raises(ValueError, match="--moe-layer-freq") as error:
        moe_utils.moe_layer_pattern(freq, 4)
    assert message in str(error.value)


def test_aux_loss_coeff_count_must_match_types():
    config = moe_config(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1])
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff has 1 values for 2"):
        TopKRouter(config, layer_number=0, tp=TensorParallel())


def test_config_default_expert_size():
    assert moe_config(moe_ffn_hidden_size=None).moe_ffn_hidden_size == 32
    assert dataclasses.replace(moe_config(), num_experts=None).num_experts is None
