"""The planner counts parameters and FLOPs on the model built on the meta device
(megatron/training/planning/built.py): per rank they equal the whole model built for that rank's
tensor-, pipeline- and expert-parallel place; the dense FLOPs are Megatron's formula; multi-latent
attention and multi-token prediction are counted by hand here; and a layer of a new kind is
planned with no planner edit."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelGroups
from megatron.core.pipeline_parallel import layout
from megatron.core.transformer import layer as layer_module
from megatron.core.transformer.flops import matmul_flops_per_token
from megatron.core.transformer.mlp import MLP
from megatron.training.planning.architecture import (active_parameters, architecture, flops_per_iteration,
                                                     stage_expert_parameters, stage_parameters, total_parameters)
from megatron.training.reporting.logging import flops_per_iteration as logged_flops
from tests.distributed.parity import gpt2_config, llama_config

MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=12, qk_layernorm=True)
MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_intermediate_size=48)
CASES = {
    "llama": llama_config(num_layers=4),
    "moe-first-dense": llama_config(num_layers=4, moe_layer_freq="[0,1,1,1]", **MOE),
    "mla": llama_config(num_layers=4, **MLA),
    "mla-moe-mtp": llama_config(num_layers=4, moe_layer_freq="[0,1,1,1]", mtp_num_layers=2, **MLA, **MOE),
    "falcon-7b": gpt2_config(num_layers=4, add_bias_linear=False, position_embedding_type="rope", parallel_attn=True,
                             group_query_attention=True, num_query_groups=1),
}


def _built(config, tp, tp_rank, pp, pp_rank, ep, ep_rank):
    groups = ParallelGroups(tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank, ep_size=ep, ep_rank=ep_rank)
    layers = layout.stage_layer_numbers(config.num_layers, pp, pp_rank)[0]
    model = GPTModel(config, groups, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1, layer_numbers=layers,
                     device=torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
# Expert parallelism only where there are experts.
PARAMETER_CASES = [(case, *sizes) for case in sorted(CASES) for sizes in LAYOUTS
                   if sizes[2] == 1 or CASES[case].num_experts is not None]


@pytest.mark.parametrize("case, tp, pp, ep", PARAMETER_CASES)
def test_parameters_per_rank_are_the_built_models(case, tp, pp, ep):
    config = CASES[case]
    arch = architecture(config)
    stages = layout.layers_per_rank(config.num_layers, pp)
    for pp_rank in range(pp):
        first, last = pp_rank == 0, pp_rank == pp - 1
        first_layer = sum(stages[:pp_rank])
        planned = (stage_parameters(arch, tp, stages[pp_rank], first=first, last=last, pp=pp, first_layer=first_layer)
                   + stage_expert_parameters(arch, ep, 1, stages[pp_rank], first_layer, last=last))
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                assert planned == _built(config, tp, tp_rank, pp, pp_rank, ep, ep_rank), (pp_rank, tp_rank, ep_rank)


def test_the_whole_model_and_its_active_part():
    config = CASES["mla-moe-mtp"]
    arch = architecture(config)
    assert total_parameters(arch) == _built(config, 1, 0, 1, 0, 1, 0)
    # 3 decoder and 2 prediction layers of experts, each running 2 of its 4 experts
    one_expert = 3 * 64 * 32
    assert active_parameters(arch) == total_parameters(arch) - 5 * 2 * one_expert


def _megatron_formula(B, s, L, h, f, q, k, g, V, m, moe_layers=0, active_ffn=0):
    """Megatron's closed form, as the planner wrote it before counting on the model."""
    per_layer = m * h * f + 2 * h * q + 2 * h * k * g + s * q
    return 6 * B * s * (L * per_layer + moe_layers * m * h * (active_ffn - f) + h * V)


@pytest.mark.parametrize("case", ["llama", "gpt2", "moe"])
def test_dense_and_moe_flops_are_megatrons_formula(case):
    if case == "llama":
        config = llama_config(num_layers=3)
        expected = _megatron_formula(4, 32, 3, 64, 96, 64, 8, 2, 128, 3)
    elif case == "gpt2":
        config = gpt2_config(num_layers=3)
        expected = _megatron_formula(4, 32, 3, 64, 128, 64, 16, 4, 128, 2)
    else:
        config = llama_config(num_layers=4, moe_layer_freq="[0,1,1,1]", **MOE)
        expected = _megatron_formula(4, 32, 4, 64, 96, 64, 8, 2, 128, 3, moe_layers=3, active_ffn=2 * 32 + 48)
    assert flops_per_iteration(architecture(config), 4, 32) == expected == logged_flops(config, 4, 32)


def test_mla_and_mtp_flops_by_hand():
    """Per token forward: each projection 2 x in x out; the attention products causal, s/2 keys per
    query: 2 (s/2) n (nope + rope) for the scores, 2 (s/2) n v for the values. Multi-token prediction
    (Megatron-LM's count): each depth a layer of the last layer's kind, its eh_proj [2h -> h] and
    its logits."""
    h, n, s, V, f = 64, 8, 32, 128, 96
    q_lora, kv_lora, nope, rope, v = 24, 16, 16, 8, 12
    projections = (h * q_lora + q_lora * n * (nope + rope) + h * (kv_lora + rope) + kv_lora * n * (nope + v)
                   + n * v * h)
    attention = 2 * projections + 2 * (s // 2) * n * (nope + rope) + 2 * (s // 2) * n * v
    layer = attention + 2 * 3 * h * f
    config = llama_config(num_layers=2, mtp_num_layers=2, **MLA)
    per_token = 2 * layer + 2 * (layer + 2 * 2 * h * h) + 3 * 2 * h * V
    assert flops_per_iteration(architecture(config), 2, s) == 3 * 2 * s * per_token == logged_flops(config, 2, s)


class ToyMLP(MLP):
    """A layer of a new kind: the MLP with one more matrix, a [h, h] mixing of its output."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.mix = torch.nn.Parameter(torch.empty(config.hidden_size, config.hidden_size,
                                                  device=kwargs["device"]))

    def forward(self, x):
        return super().forward(x) @ self.mix


def test_a_new_layer_kind_is_planned_without_planner_edits(monkeypatch):
    monkeypatch.setattr(layer_module, "MLP", ToyMLP)
    config = llama_config(num_layers=3, num_query_groups=8, padded_vocab_size=256)  # a model the caches have not seen
    arch = architecture(config)
    assert total_parameters(arch) == _built(config, 1, 0, 1, 0, 1, 0)
    plain = _megatron_formula(4, 32, 3, 64, 96, 64, 8, 8, 256, 3)
    assert flops_per_iteration(arch, 4, 32) == plain + 6 * 4 * 32 * 3 * 64 * 64


def test_generic_count_is_two_flops_per_weight():
    mlp = MLP(llama_config(), device=torch.device("meta"))
    assert matmul_flops_per_token(mlp, 16) == 2 * (64 * 2 * 96 + 96 * 64)


@pytest.mark.parametrize("case", ["llama", "mla"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activation_widths_are_the_built_layers(case, tp):
    """The analytic activation terms read the widths the built layer has on this rank: the qkv
    buffer (key/value heads replicated when TP exceeds the groups) and the output projection's input."""
    from megatron.training.planning.layout import Layout
    from megatron.training.planning.memory import layer_activation_terms

    config = CASES[case]
    lay = Layout(tp=tp, pp=1, cp=1, dp=1, micro_batch_size=2, global_batch_size=2, seq_length=16, precision="bf16",
                 device="gpu", attention_kernel="flash", fused_elementwise=True)
    terms = layer_activation_terms(architecture(config), lay, selective=True)
    layer = layer_module.TransformerLayer(config, groups=ParallelGroups(tp_size=tp), rng_tracker=None,
                                          device=torch.device("meta"))
    attention, tokens = layer.self_attention, 2 * 16
    assert terms["proj_input"] == 2 * tokens * attention.linear_proj.weight.shape[1]
    if case == "llama":
        assert terms["qkv"] == 2 * tokens * attention.linear_qkv.weight.shape[0]
    else:  # q and k are [no-position part; rotated part] per head, v a view of kv_up's output
        q_width = attention.linear_q_up_proj.weight.shape[0]
        assert terms["qkv"] == 2 * tokens * (2 * q_width + attention.linear_kv_up_proj.weight.shape[0])
