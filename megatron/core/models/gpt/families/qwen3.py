"""Qwen3 (`Qwen3ForCausalLM`): Llama with query/key norms (--qk-layernorm, RMSNorm over each
head: HF's `q_norm`/`k_norm`)."""
from megatron.core.models.gpt.families import llama
from megatron.core.models.gpt.families.base import Family

FAMILIES = [Family("qwen3", "Qwen3", "Qwen3Config", "Qwen3ForCausalLM", llama.KEYS,
                   dict(llama.SHAPE, qk_layernorm=True), llama.weights, llama.SELECTS,
                   extra=dict(hidden_act="silu", attention_bias=False, use_sliding_window=False))]
