"""FP8, compile and recompute are applied from outside the layers, in one place (parallelize.py).

A layer that picked its own kernels, or forgot to declare one, would leave an eager fusion behind
when the run asks for compiled ones: every elementwise chain a module of the built model holds must
be the compiled version under the fusion switches, and the eager one without them."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import single_process
from megatron.core.tensor_parallel.random import build_tracker
from megatron.core.transformer import fusions
from megatron.core.transformer.block import RecomputedCoreAttention
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe import experts, moe_utils, token_dispatcher
from megatron.core.utils import compiled
from tests.distributed.parity import llama_config

EAGER = {fusions.rms_norm, fusions.rms_norm_1p, fusions.add_rms_norm, fusions.add_rms_norm_1p, fusions.swiglu,
         fusions.rotary, fusions.rotary_interleaved, moe_utils.route, token_dispatcher.permute_rows,
         token_dispatcher.unpermute, experts.accumulate_expert_grads_}
FUSED = dict(fuse_elementwise=True, moe_router_fusion=True, moe_permute_fusion=True)
MODELS = {
    "llama": {},
    "layernorm-1p": dict(apply_layernorm_1p=True),
    "mla": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                v_head_dim=16, rotary_interleaved=True),
    "moe": dict(num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1]),
}


def _held_functions(model) -> list:
    """(where, function) for every fusion function a module of `model` (or its dispatcher) holds."""
    held = []
    for name, module in model.named_modules():
        owners = [(name, vars(module))]
        if hasattr(module, "dispatcher"):
            owners.append((f"{name}.dispatcher.local", vars(module.dispatcher.local)))
        for where, attributes in owners:
            held += [(f"{where}.{key}", value) for key, value in attributes.items()
                     if any(value is f or value is compiled(f) or value is compiled(f, None) for f in EAGER)]
    return held


@pytest.mark.parametrize("case", sorted(MODELS))
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_every_fusion_a_layer_holds_follows_the_switches(case, fused):
    model = GPTModel(llama_config(**MODELS[case]), single_process(), execution=ExecutionConfig(**(FUSED if fused else {})))
    held = _held_functions(model)
    assert held, "the model holds no fusion at all"
    wrong = [where for where, function in held if (function in EAGER) == fused]
    assert not wrong, wrong
    assert model.compiled_loss == fused


def test_recompute_is_applied_to_the_built_layers():
    execution = ExecutionConfig(recompute_granularity="selective", moe_layer_recompute=True)
    model = GPTModel(llama_config(**MODELS["moe"]), single_process(), execution=execution,
                     rng_tracker=build_tracker(1, 0, 0, torch.device("cpu")))
    assert all(isinstance(layer.self_attention.core_attention, RecomputedCoreAttention) for layer in model.decoder.layers)
    assert [layer.recompute_mlp for layer in model.decoder.layers] == [False, True]  # the MoE layer only
    full = ExecutionConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert GPTModel(llama_config(), single_process(), execution=full).decoder.segments == [(0, 1, True), (1, 2, False)]
