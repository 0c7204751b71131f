"""Mixtral (`MixtralForCausalLM`): Llama with every layer a mixture of experts, softmax over the
chosen experts, no shared experts."""
import functools

from megatron.core.models.gpt.families import llama
from megatron.core.models.gpt.families.base import Family

KEYS = dict(llama.KEYS, num_experts="num_local_experts", moe_ffn_hidden_size="intermediate_size",
            moe_router_topk="num_experts_per_tok")
# The router, and expert e's gate, up and down projections, as save_pretrained names them.
EXPERTS = ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
           "block_sparse_moe.experts.{e}.w2")

FAMILIES = [Family("mixtral", "Mixtral", "MixtralConfig", "MixtralForCausalLM", KEYS,
                   dict(llama.SHAPE, qk_layernorm=False), functools.partial(llama.weights, experts=EXPERTS),
                   llama.SELECTS + ("add_qkv_bias",), experts=True,
                   extra=dict(hidden_act="silu", sliding_window=None, router_jitter_noise=0.0),
                   note=" (Mixtral has every layer a mixture of experts, softmax over the chosen experts, "
                        "no shared experts)")]
