"""The MoE layer equals a naive loop over tokens and their chosen experts; the experts start from the
same weights whatever the expert-parallel layout; GPTModel builds MoE layers per --moe-layer-freq."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelGroups, single_process
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.experts import GroupedMLP, initialize_expert_param
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute
from megatron.core.tensor_parallel.layers import initialize_param

HIDDEN, EXPERTS = 16, 4


def config(**overrides):
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=64, ffn_hidden_size=24,
                num_experts=EXPERTS, moe_ffn_hidden_size=12, moe_router_topk=2, swiglu=True,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                moe_router_load_balancing_type="none")
    return derive(TransformerConfig(**(base | overrides)))


EXECUTION = ExecutionConfig(params_dtype=torch.float64)


def initialized_layer(cfg, seed=3):
    layer = MoELayer(cfg, execution=EXECUTION, layer_number=0, groups=single_process(), device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in layer.named_parameters():
            full_name = f"decoder.layers.0.mlp.{name}"
            init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
            init(param, full_name, seed, 0.5, cfg.num_layers)
            if "bias" in name:
                param.normal_(0.0, 0.1)
    return layer


def naive(layer, cfg, x):
    """Per token: sum over its chosen experts of prob x expert(token), plus the shared experts."""
    experts = layer.experts
    tokens = x.reshape(-1, HIDDEN)
    probs, routing_map = layer.router(x)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in range(EXPERTS):
            if not routing_map[t, e]:
                continue
            h = F.linear(tokens[t], experts.fc1_weight[e],
                         experts.fc1_bias[e] if experts.fc1_bias is not None else None)
            if cfg.swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            y = F.linear(h, experts.fc2_weight[e], experts.fc2_bias[e] if experts.fc2_bias is not None else None)
            out[t] = out[t] + probs[t, e] * y
    out = out.view(x.shape)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(swiglu=False, add_bias_linear=True, moe_router_topk=1),
    dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True, moe_router_score_function="sigmoid"),
    dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
    dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position", moe_token_dispatcher_type="alltoall"),
    dict(moe_grouped_gemm=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
         moe_z_loss_coeff=0.01),
])
def test_moe_layer_equals_naive_loop(overrides):
    cfg = config(**overrides)
    layer = initialized_layer(cfg)
    x = torch.randn(5, 3, HIDDEN, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(5, 3, HIDDEN, dtype=torch.float64)
    out = layer(x)
    (out * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    x_grad = x.grad.clone()
    x.grad = None
    layer.zero_grad()
    reference = naive(layer, cfg, x)
    (reference * probe).sum().backward()
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x_grad, x.grad, rtol=1e-10, atol=1e-12)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_permute_then_unpermute_sums_copies():
    hidden = torch.randn(6, 3)
    probs, routing_map = moe_utils.topk_routing(torch.randn(6, EXPERTS), 2)
    rows, row_probs, index, per_expert = permute(hidden, probs, routing_map)
    assert per_expert.tolist() == routing_map.sum(0).tolist() and rows.shape[0] == 12
    torch.testing.assert_close(unpermute(rows, index, 6), 2 * hidden)
    torch.testing.assert_close(row_probs.sum(), probs.sum())


def test_expert_initialization_is_independent_of_expert_parallel_size():
    cfg = config()
    whole = GroupedMLP(cfg, execution=EXECUTION, num_local_experts=4, expert_offset=0, etp=TensorParallel(), tp=TensorParallel(),
                       device="cpu")
    half = GroupedMLP(cfg, execution=EXECUTION, num_local_experts=2, expert_offset=2, etp=TensorParallel(), tp=TensorParallel(),
                      device="cpu")
    for module in (whole, half):
        initialize_expert_param(module.fc1_weight, "decoder.layers.0.mlp.experts.fc1_weight", 5, 0.02, 2)
    torch.testing.assert_close(whole.fc1_weight[2:], half.fc1_weight, rtol=0, atol=0)
    assert not torch.equal(whole.fc1_weight[0], whole.fc1_weight[1])


def test_expert_tensor_parallel_slices_each_expert():
    cfg = config()
    whole = GroupedMLP(cfg, execution=EXECUTION, num_local_experts=4, expert_offset=0, etp=TensorParallel(), tp=TensorParallel(),
                       device="cpu")
    second = GroupedMLP(cfg, execution=EXECUTION, num_local_experts=4, expert_offset=0, etp=TensorParallel(size=2, rank=1), tp=TensorParallel(size=2, rank=1),
                        device="cpu")
    for module in (whole, second):
        for name in ("fc1_weight", "fc2_weight"):
            initialize_expert_param(getattr(module, name), f"e.{name}", 5, 0.02, 2)
    gate, up = whole.fc1_weight.chunk(2, dim=1)
    torch.testing.assert_close(second.fc1_weight, torch.cat([gate[:, 6:], up[:, 6:]], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(second.fc2_weight, whole.fc2_weight[:, :, 6:], rtol=0, atol=0)


def test_gpt_model_builds_moe_layers_per_layer_freq():
    cfg = config(num_layers=4, moe_layer_freq="[0]*1+[1]*3", position_embedding_type="rope",
                 normalization="RMSNorm", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    model = GPTModel(cfg, single_process())
    model.initialize_parameters(1)
    assert [layer.is_moe for layer in model.decoder.layers] == [False, True, True, True]
    tokens = torch.randint(0, 64, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    loss = model(tokens, positions, labels=tokens)
    loss.mean().backward()
    assert model.moe_aux_losses.values["load_balancing_loss"][1:].gt(0).all()
    assert model.moe_aux_losses.values["load_balancing_loss"][0] == 0
    names = dict(model.named_parameters())
    assert names["decoder.layers.1.mlp.router.weight"].grad.abs().sum() > 0
    assert names["decoder.layers.3.mlp.experts.fc2_weight"].shape == (EXPERTS, HIDDEN, 12)


def test_moe_needs_experts_divisible_by_expert_parallel_size():
    groups = ParallelGroups(ep_size=3)
    with pytest.raises(ValueError, match=r"4 is not divisible by 3 \(--num-experts by --expert-model-parallel-size\)"):
        MoELayer(config(), execution=EXECUTION, layer_number=0, groups=groups, device="cpu")


def test_unknown_dispatcher_is_refused_by_name():
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type must be one of"):
        MoELayer(config(moe_token_dispatcher_type="flex"), execution=EXECUTION, layer_number=0, groups=single_process(), device="cpu")
