"""Qwen3-MoE (`Qwen3MoeForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`).

Qwen3-MoE: Llama with query/key norms and mixture-of-experts layers; `norm_topk_prob` false is
--moe-router-pre-softmax; `mlp_only_layers` and `decoder_sparse_step` are the --moe-layer-freq
pattern. Qwen2-MoE: Qwen3-MoE's layout without query/key norms, with q/k/v biases and a shared
expert scaled by a sigmoid gate (--moe-shared-expert-intermediate-size with
--moe-shared-expert-gate)."""
from megatron.core.models.gpt.families import llama
from megatron.core.models.gpt.families.base import Entry, Family, HFKey

QWEN3_MOE_KEYS = dict(
    llama.KEYS, num_experts="num_experts", moe_ffn_hidden_size="moe_intermediate_size",
    moe_router_topk="num_experts_per_tok",
    moe_router_pre_softmax=HFKey("norm_topk_prob", to_hf=lambda pre_softmax: not pre_softmax,
                                 from_hf=lambda norm: not norm))
QWEN2_MOE_KEYS = dict(QWEN3_MOE_KEYS, moe_shared_expert_intermediate_size=HFKey(
    "shared_expert_intermediate_size", to_hf=lambda size: size or 0, from_hf=lambda size: size or None))
EXPERTS = ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")
_SELECTS = llama.SELECTS + ("add_qkv_bias",)
_EXTRA = dict(hidden_act="silu", use_sliding_window=False)


def weights(config) -> list:
    """Llama's tensors with Qwen's expert names, and Qwen2-MoE's shared expert and its gate."""
    entries = llama.weights(config, experts=EXPERTS)
    if config.moe_shared_expert_intermediate_size is None:
        return entries
    for i, moe in enumerate(config.moe_layers):
        if moe:
            hf, shared = f"model.layers.{i}.mlp", f"decoder.layers.{i}.mlp.shared_experts"
            entries += llama.mlp_weights(f"{hf}.shared_expert", f"{shared}.mlp")
            entries.append(Entry(f"{hf}.shared_expert_gate.weight", f"{shared}.gate_weight"))
    return entries


FAMILIES = [
    Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE_KEYS,
           dict(llama.SHAPE, qk_layernorm=True), weights, _SELECTS, experts=True, layer_pattern=True,
           extra=dict(_EXTRA, attention_bias=False)),
    Family("qwen2_moe", "Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", QWEN2_MOE_KEYS,
           dict(llama.SHAPE, qk_layernorm=False, add_qkv_bias=True, moe_shared_expert_gate=True), weights,
           _SELECTS, experts=True, layer_pattern=True, extra=dict(_EXTRA, qkv_bias=True)),
]
