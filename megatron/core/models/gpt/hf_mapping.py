"""Mapping between Hugging Face `transformers` checkpoints (Llama, GPT-2) and GPTModel.

The meeting point is the *logical* state: {global parameter name: {part name: full tensor}}, the
unsharded tensors a `TPLayout` cuts each rank's parameter from (see tensor_parallel.layers). So:

    HF state dict --hf_to_logical--> logical --load_logical_into_model--> any TP rank / PP stage
    single-process model --model_to_logical--> logical --logical_to_hf--> HF state dict

Everything here is pure tensor manipulation: no file I/O, no communication beyond `local_to_full`.

Differences the mapping absorbs:
- HF keeps q/k/v (Llama) and gate/up (SwiGLU) as separate tensors; GPTModel fuses them, and the
  fused parameters' layouts carry the parts by name ("q", "k", "v", "gate", "up").
- GPT-2 uses `Conv1D`, whose weight is [in, out]: the transpose of `nn.Linear`. Its fused `c_attn`
  is [q; k; v] along the output features.
- The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp_size` (as Megatron
  does); padded rows are zeros going in and dropped coming out.
- Llama checkpoints in HF format are in the rotate-half rotary convention. A model trained with
  --rotary-interleaved pairs channels (2i, 2i+1) instead: its q/k rows are permuted within each
  head on the way out (and back on the way in), which gives the same attention scores.
- With --apply-layernorm-1p a norm scales by (1 + weight): HF stores the scale itself, so 1 is
  added on the way out and subtracted on the way in.
- Query/key normalization (--qk-layernorm, RMSNorm over each head) is Qwen3's `q_norm`/`k_norm`:
  such a Llama-shaped model maps to `Qwen3ForCausalLM`. GPT-2 has no equivalent.
- Mixtures of experts: Mixtral (every layer MoE, softmax over the chosen experts) and Qwen3-MoE
  (with query/key norms; `norm_topk_prob` false is --moe-router-pre-softmax; `mlp_only_layers` and
  `decoder_sparse_step` become the --moe-layer-freq pattern), and Qwen2-MoE (Qwen3-MoE's layout
  without query/key norms, with q/k/v biases and a shared expert scaled by a sigmoid gate:
  --moe-shared-expert-intermediate-size with --moe-shared-expert-gate). HF files hold one tensor per expert
  (`experts.{e}.w1` ...); GPTModel stacks them, `experts.fc1_weight` [E, 2F, h] (gate; up) and
  `experts.fc2_weight` [E, h, F]; the router is HF's `gate`.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.models.gpt.model import WORD_EMBEDDINGS
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

ARCHITECTURES = ("llama", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "gpt2")
_LLAMA_LIKE = ("llama", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe")
# Where each family keeps a mixture-of-experts block: the router, and expert e's gate, up and down
# projections, in the checkpoint files' per-expert names (what save_pretrained writes).
_MOE_KEYS = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}
_MOE_KEYS["qwen2_moe"] = _MOE_KEYS["qwen3_moe"]
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp_size: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of make_vocab_size_divisible_by * tp_size."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def hf_config_to_transformer_config(hf_config, *, make_vocab_size_divisible_by: int = 128,
                                    tp_size: int = 1) -> TransformerConfig:
    """A TransformerConfig equivalent to a `transformers` LlamaConfig, Qwen3Config or GPT2Config.

    Raises ValueError for options GPTModel does not implement, rather than converting them silently.
    """
    arch = architecture_of(hf_config)
    vocab = padded_vocab_size(hf_config.vocab_size, make_vocab_size_divisible_by, tp_size)
    if arch in _LLAMA_LIKE:
        config = _llama_config(hf_config, vocab)
    else:
        config = _gpt2_config(hf_config, vocab)
    config.check_tensor_parallel(tp_size)
    return config


def architecture_of(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {ARCHITECTURES}")
    return model_type


def _llama_rope(hf_config) -> dict:
    """Rotary settings from either transformers 5 (`rope_parameters`) or 4.x (`rope_theta`,
    `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy_scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    out = dict(rotary_base=float(params["rope_theta"]))
    if "partial_rotary_factor" in params:
        out["rotary_percent"] = float(params["partial_rotary_factor"])
    if rope_type == "llama3":
        out.update(rope_scaling=True,
                   rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    return out


def _llama_config(hf_config, vocab_size: int) -> TransformerConfig:
    """Llama, or Qwen3 (Llama with RMSNorm over each query and key head)."""
    if hf_config.model_type == "qwen2_moe" and not hf_config.qkv_bias:
        raise ValueError("Qwen2-MoE without q/k/v biases (qkv_bias false) is not supported")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("Llama attention_bias / mlp_bias are not supported by GPTModel")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported by GPTModel")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"Llama hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if getattr(hf_config, "sliding_window", None) is not None and hf_config.model_type == "mixtral":
        raise ValueError("sliding-window attention (sliding_window) is not supported by GPTModel")
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        vocab_size=vocab_size,
        ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        num_query_groups=num_kv_heads,
        max_position_embeddings=hf_config.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation="silu",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=hf_config.initializer_range,
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        add_qkv_bias=hf_config.model_type == "qwen2_moe",
        **_llama_rope(hf_config),
        **_moe_config(hf_config),
    )


def _moe_config(hf_config) -> dict:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config ({} for dense models)."""
    kind = hf_config.model_type
    if kind == "mixtral":
        if getattr(hf_config, "router_jitter_noise", 0.0):
            raise ValueError("Mixtral router_jitter_noise is not supported (--moe-input-jitter-eps is multiplicative)")
        return dict(num_experts=hf_config.num_local_experts, moe_router_topk=hf_config.num_experts_per_tok,
                    moe_ffn_hidden_size=hf_config.intermediate_size)
    if kind not in ("qwen3_moe", "qwen2_moe"):
        return {}
    shared = {}
    if kind == "qwen2_moe" and hf_config.shared_expert_intermediate_size:
        shared = dict(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    layers = hf_config.num_hidden_layers
    step = hf_config.decoder_sparse_step
    pattern = [0 if (i in hf_config.mlp_only_layers or (i + 1) % step) else 1 for i in range(layers)]
    return dict(num_experts=hf_config.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
                moe_ffn_hidden_size=hf_config.moe_intermediate_size, moe_layer_freq=pattern,
                moe_router_pre_softmax=not hf_config.norm_topk_prob, **shared)

def _gpt2_config(hf_config, vocab_size: int) -> TransformerConfig:
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("GPT-2 scale_attn_by_inverse_layer_idx is not supported by GPTModel")
    if not getattr(hf_config, "scale_attn_weights", True):
        raise ValueError("GPT-2 scale_attn_weights=False is not supported by GPTModel")
    activation = _GPT2_ACTIVATIONS.get(hf_config.activation_function)
    if activation is None:
        raise ValueError(f"GPT-2 activation_function {hf_config.activation_function!r} is not supported; "
                         f"supported: {sorted(_GPT2_ACTIVATIONS)}")
    return TransformerConfig(
        num_layers=hf_config.n_layer,
        hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head,
        vocab_size=vocab_size,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        max_position_embeddings=hf_config.n_positions,
        normalization="LayerNorm",
        norm_epsilon=hf_config.layer_norm_epsilon,
        activation=activation,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
        hidden_dropout=float(hf_config.resid_pdrop),
        attention_dropout=float(hf_config.attn_pdrop),
        init_method_std=hf_config.initializer_range,
    )


def architecture_for_hf(config: TransformerConfig) -> str:
    """'llama', 'qwen3' or 'gpt2': the Hugging Face family whose layers are exactly this config's
    (up to the weight transforms in the module docstring)."""
    if (config.normalization == "RMSNorm" and config.gated_linear_unit and config.activation == "silu"
            and config.position_embedding_type == "rope" and not config.add_bias_linear
            and (not config.add_qkv_bias or config.moe_shared_expert_intermediate_size is not None)):
        if config.rotary_percent != 1.0:
            raise ValueError(f"--rotary-percent {config.rotary_percent} has no Hugging Face Llama equivalent "
                             "(its attention rotates every channel of a head)")
        if config.num_experts is not None:
            return _moe_architecture(config)
        return "qwen3" if config.qk_layernorm else "llama"
    if (config.normalization == "LayerNorm" and not config.gated_linear_unit and config.add_bias_linear
            and config.position_embedding_type == "learned_absolute" and config.activation in ("gelu_tanh", "gelu")
            and config.num_query_groups == config.num_attention_heads
            and config.kv_channels * config.num_attention_heads == config.hidden_size):
        if config.qk_layernorm:
            raise ValueError("--qk-layernorm with LayerNorm has no Hugging Face GPT-2 equivalent")
        return "gpt2"
    raise ValueError("this model has no Hugging Face equivalent here: only Llama (RMSNorm, SwiGLU, RoPE, no biases; "
                     "Qwen3 with --qk-layernorm) and GPT-2 (LayerNorm, GeLU, learned positions, biases, multi-head "
                     "attention) shapes convert")


def _moe_architecture(config: TransformerConfig) -> str:
    """'mixtral' or 'qwen3_moe' for a mixture of experts with a Hugging Face equivalent."""
    plain = (config.moe_router_score_function == "softmax" and not config.moe_router_topk_scaling_factor
             and config.moe_router_num_groups is None and not config.moe_router_enable_expert_bias)
    qwen2 = (config.moe_shared_expert_intermediate_size is not None and config.moe_shared_expert_gate
             and config.add_qkv_bias and not config.qk_layernorm)
    if not plain or (config.moe_shared_expert_intermediate_size is not None and not qwen2):
        raise ValueError("this mixture of experts has no Hugging Face equivalent here: Mixtral, Qwen3-MoE and "
                         "Qwen2-MoE route with softmax, without scaling, groups or expert bias; only Qwen2-MoE has "
                         "shared experts (with the gate and q/k/v biases)")
    if qwen2:
        return "qwen2_moe"
    if config.qk_layernorm:
        return "qwen3_moe"
    if config.moe_router_pre_softmax or 0 in moe_layer_pattern(config.moe_layer_freq, config.num_layers):
        raise ValueError("Mixtral has every layer a mixture of experts with the softmax over the chosen experts: "
                         "drop --moe-router-pre-softmax and --moe-layer-freq")
    return "mixtral"


def hf_config_from_transformer_config(config: TransformerConfig, vocab_size: int):
    """The `transformers` LlamaConfig, Qwen3Config or GPT2Config of a model (the inverse of
    `hf_config_to_transformer_config`); `vocab_size` is the unpadded vocabulary."""
    import transformers

    arch = architecture_for_hf(config)
    if arch in ("mixtral", "qwen3_moe", "qwen2_moe"):
        return _hf_moe_config(config, vocab_size, arch)
    if arch in ("llama", "qwen3"):
        rope = {"rope_type": "default", "rope_theta": config.rotary_base}
        if config.rope_scaling:
            rope.update(rope_type="llama3", factor=config.rope_scaling_factor,
                        low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                        original_max_position_embeddings=config.rope_original_max_position_embeddings)
        config_class = transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig
        extra = {"use_sliding_window": False} if arch == "qwen3" else {"mlp_bias": False}
        return config_class(
            vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
            max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
            tie_word_embeddings=not config.untie_embeddings_and_output_weights, rope_parameters=rope,
            hidden_act="silu", attention_bias=False, initializer_range=config.init_method_std,
            attention_dropout=config.attention_dropout, **extra)
    return transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
        layer_norm_epsilon=config.norm_epsilon, tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        initializer_range=config.init_method_std)


def _hf_moe_config(config: TransformerConfig, vocab_size: int, arch: str):
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base}, hidden_act="silu",
        initializer_range=config.init_method_std, attention_dropout=config.attention_dropout,
        num_experts_per_tok=config.moe_router_topk)
    if config.rope_scaling:
        raise ValueError("Llama 3.1 rope scaling (--use-rope-scaling) has no Mixtral / Qwen3-MoE equivalent")
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=config.moe_ffn_hidden_size,
                                          num_local_experts=config.num_experts, sliding_window=None, **common)
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    common.update(intermediate_size=config.ffn_hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size,
                  num_experts=config.num_experts, decoder_sparse_step=1, use_sliding_window=False,
                  norm_topk_prob=not config.moe_router_pre_softmax,
                  mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                                           qkv_bias=True, **common)
    return transformers.Qwen3MoeConfig(attention_bias=False, **common)


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    """One HF tensor and where it lives in the logical state.

    `parts`: the logical parts the HF tensor is split into along dim 0 (after the Conv1D
    transpose), with their `sizes`; most tensors are one part. `conv1d`: stored as [in, out].
    `vocab`: rows are vocabulary entries (padded in the logical state). `norm`: a norm's scale
    (shifted by one for zero-centered norms). `rotary_heads`: query/key rows of this many heads,
    permuted for an interleaved-RoPE model.
    """

    hf_name: str
    name: str
    parts: tuple = ("",)
    sizes: Optional[tuple] = None
    conv1d: bool = False
    vocab: bool = False
    norm: bool = False
    rotary_heads: int = 0
    expert: Optional[int] = None  # this HF tensor is expert `expert` of a stacked logical tensor


def _llama_entries(config: TransformerConfig) -> list:
    """Llama's tensors, and Qwen3's (Llama's plus q_norm/k_norm)."""
    entries = [_Entry("model.embed_tokens.weight", WORD_EMBEDDINGS, vocab=True)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        qkv = f"{ours}.self_attention.linear_qkv.weight"
        fc1 = f"{ours}.mlp.linear_fc1.weight"
        entries += [
            _Entry(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", norm=True),
            _Entry(f"{hf}.self_attn.q_proj.weight", qkv, ("q",), rotary_heads=config.num_attention_heads),
            _Entry(f"{hf}.self_attn.k_proj.weight", qkv, ("k",), rotary_heads=config.num_query_groups),
            _Entry(f"{hf}.self_attn.v_proj.weight", qkv, ("v",)),
            _Entry(f"{hf}.self_attn.o_proj.weight", f"{ours}.self_attention.linear_proj.weight"),
            _Entry(f"{hf}.post_attention_layernorm.weight", f"{ours}.pre_mlp_layernorm.weight", norm=True),
        ]
        if config.num_experts is not None and moe_layer_pattern(config.moe_layer_freq, config.num_layers)[i]:
            entries += _moe_entries(config, hf, ours)
        else:
            entries += [_Entry(f"{hf}.mlp.gate_proj.weight", fc1, ("gate",)),
                        _Entry(f"{hf}.mlp.up_proj.weight", fc1, ("up",)),
                        _Entry(f"{hf}.mlp.down_proj.weight", f"{ours}.mlp.linear_fc2.weight")]
        if config.qk_layernorm:
            entries += [_Entry(f"{hf}.self_attn.{x}_norm.weight", f"{ours}.self_attention.{x}_layernorm.weight",
                               norm=True) for x in ("q", "k")]
        if config.add_qkv_bias:
            heads = dict(q=config.num_attention_heads, k=config.num_query_groups, v=0)
            entries += [_Entry(f"{hf}.self_attn.{x}_proj.bias", f"{ours}.self_attention.linear_qkv.bias", (x,),
                               rotary_heads=heads[x]) for x in ("q", "k", "v")]
    entries.append(_Entry("model.norm.weight", f"{FINAL_NORM}.weight", norm=True))
    if config.untie_embeddings_and_output_weights:
        entries.append(_Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def _moe_entries(config: TransformerConfig, hf: str, ours: str) -> list:
    family = "mixtral" if not (config.qk_layernorm or config.add_qkv_bias) else "qwen3_moe"
    router, gate, up, down = _MOE_KEYS[family]
    entries = [_Entry(f"{hf}.{router}.weight", f"{ours}.mlp.router.weight")]
    if config.moe_shared_expert_intermediate_size is not None:  # Qwen2-MoE
        shared = f"{ours}.mlp.shared_experts"
        entries += [_Entry(f"{hf}.mlp.shared_expert.gate_proj.weight", f"{shared}.mlp.linear_fc1.weight", ("gate",)),
                    _Entry(f"{hf}.mlp.shared_expert.up_proj.weight", f"{shared}.mlp.linear_fc1.weight", ("up",)),
                    _Entry(f"{hf}.mlp.shared_expert.down_proj.weight", f"{shared}.mlp.linear_fc2.weight"),
                    _Entry(f"{hf}.mlp.shared_expert_gate.weight", f"{shared}.gate_weight")]
    for e in range(config.num_experts):
        entries += [_Entry(f"{hf}.{gate.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("gate",), expert=e),
                    _Entry(f"{hf}.{up.format(e=e)}.weight", f"{ours}.mlp.experts.fc1_weight", ("up",), expert=e),
                    _Entry(f"{hf}.{down.format(e=e)}.weight", f"{ours}.mlp.experts.fc2_weight", expert=e)]
    return entries


def _gpt2_entries(config: TransformerConfig) -> list:
    h = config.hidden_size
    entries = [
        _Entry("transformer.wte.weight", WORD_EMBEDDINGS, vocab=True),
        _Entry("transformer.wpe.weight", POSITION_EMBEDDINGS),
    ]
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}", f"decoder.layers.{i}"
        attention, mlp = f"{ours}.self_attention", f"{ours}.mlp"
        for suffix in ("weight", "bias"):
            conv1d = suffix == "weight"
            entries += [
                _Entry(f"{hf}.ln_1.{suffix}", f"{ours}.input_layernorm.{suffix}", norm=suffix == "weight"),
                _Entry(f"{hf}.attn.c_attn.{suffix}", f"{attention}.linear_qkv.{suffix}",
                       ("q", "k", "v"), (h, h, h), conv1d=conv1d),
                _Entry(f"{hf}.attn.c_proj.{suffix}", f"{attention}.linear_proj.{suffix}", conv1d=conv1d),
                _Entry(f"{hf}.ln_2.{suffix}", f"{ours}.pre_mlp_layernorm.{suffix}", norm=suffix == "weight"),
                _Entry(f"{hf}.mlp.c_fc.{suffix}", f"{mlp}.linear_fc1.{suffix}", conv1d=conv1d),
                _Entry(f"{hf}.mlp.c_proj.{suffix}", f"{mlp}.linear_fc2.{suffix}", conv1d=conv1d),
            ]
    entries += [_Entry(f"transformer.ln_f.{suffix}", f"{FINAL_NORM}.{suffix}", norm=suffix == "weight")
                for suffix in ("weight", "bias")]
    if config.untie_embeddings_and_output_weights:
        entries.append(_Entry("lm_head.weight", OUTPUT_LAYER, vocab=True))
    return entries


def _entries(config: TransformerConfig, arch: str) -> list:
    if arch in _LLAMA_LIKE:
        return _llama_entries(config)
    if arch == "gpt2":
        return _gpt2_entries(config)
    raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")


def _ignored_hf_key(key: str, config: TransformerConfig, arch: str) -> bool:
    """Keys HF state dicts may carry that hold no weights of their own."""
    if key == "lm_head.weight" and not config.untie_embeddings_and_output_weights:
        return True  # the tied copy of the embedding
    if arch == "gpt2" and (key.endswith(".attn.bias") or key.endswith(".attn.masked_bias")):
        return True  # causal-mask buffers of older transformers versions
    return key.endswith("rotary_emb.inv_freq")


def _normalize_gpt2_key(key: str) -> str:
    """Original GPT-2 checkpoints name the base model's tensors without the `transformer.` prefix."""
    if key.startswith("transformer.") or key.startswith("lm_head."):
        return key
    return f"transformer.{key}"


def hf_to_logical(hf_state_dict: dict, config: TransformerConfig, arch: str) -> dict:
    """{global param name: {part name: full tensor}} from a HF Llama or GPT-2 state dict.

    The vocabulary rows of the embedding (and untied output layer) are zero-padded to
    `config.vocab_size`. Raises on missing or unrecognized keys.
    """
    if arch == "gpt2":
        hf_state_dict = {_normalize_gpt2_key(k): v for k, v in hf_state_dict.items()}
    entries = _entries(config, arch)
    known = {entry.hf_name for entry in entries}
    unexpected = [k for k in hf_state_dict if k not in known and not _ignored_hf_key(k, config, arch)]
    missing = [name for name in known if name not in hf_state_dict]
    if unexpected or missing:
        raise KeyError(f"HF state dict does not match the {arch} config: missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    logical, experts = {}, {}
    for entry in entries:
        tensor = _to_ours(hf_state_dict[entry.hf_name], entry, config)
        if entry.expert is not None:  # stacked below, in expert order
            experts.setdefault((entry.name, entry.parts[0]), []).append(tensor)
            continue
        if entry.conv1d:
            tensor = tensor.t()
        if entry.vocab:
            tensor = _pad_rows(tensor, config.vocab_size)
        pieces = tensor.split(list(entry.sizes)) if entry.sizes else (tensor,)
        parts = logical.setdefault(entry.name, {})
        for part, piece in zip(entry.parts, pieces, strict=True):
            parts[part] = piece.contiguous()
    for (name, part), tensors in experts.items():
        logical.setdefault(name, {})[part] = torch.stack(tensors)
    return logical


def logical_to_hf(logical: dict, config: TransformerConfig, arch: str, *,
                  vocab_size: Optional[int] = None) -> dict:
    """The HF state dict of a logical state (the inverse of `hf_to_logical`).

    `vocab_size`: the unpadded vocabulary size (HF's `config.vocab_size`); padded rows past it are
    dropped. None keeps all `config.vocab_size` rows. A tied output layer is not emitted, as in
    the checkpoints `save_pretrained` writes.
    """
    out = {}
    for entry in _entries(config, arch):
        parts = logical[entry.name]
        tensor = torch.cat([parts[p] for p in entry.parts], dim=0) if len(entry.parts) > 1 else parts[entry.parts[0]]
        if entry.expert is not None:
            tensor = tensor[entry.expert]
        if entry.vocab and vocab_size is not None:
            tensor = tensor[:vocab_size]
        if entry.conv1d:
            tensor = tensor.t()
        out[entry.hf_name] = _to_hf(tensor, entry, config).contiguous()
    return out


def _rotary_permutation(config: TransformerConfig, heads: int) -> torch.Tensor:
    """Row order taking one head-stacked q or k projection from the interleaved RoPE layout to
    rotate-half: within each head's rotated channels, rotate-half position j < r/2 reads
    interleaved row 2j and position r/2 + j reads row 2j + 1 (r = rotary channels)."""
    d = config.kv_channels
    rotary = int(d * config.rotary_percent)
    within = torch.cat((torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, d)))
    return (torch.arange(heads).unsqueeze(1) * d + within).reshape(-1)


def _to_hf(tensor: torch.Tensor, entry: _Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.norm and config.layernorm_zero_centered_gamma:
        tensor = tensor + 1.0
    if entry.rotary_heads and config.rotary_interleaved:
        tensor = tensor[_rotary_permutation(config, entry.rotary_heads)]
    return tensor


def _to_ours(tensor: torch.Tensor, entry: _Entry, config: TransformerConfig) -> torch.Tensor:
    if entry.norm and config.layernorm_zero_centered_gamma:
        tensor = tensor - 1.0
    if entry.rotary_heads and config.rotary_interleaved:
        tensor = tensor[torch.argsort(_rotary_permutation(config, entry.rotary_heads))]
    return tensor


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] > rows:
        raise ValueError(f"vocabulary of {tensor.shape[0]} rows exceeds the padded vocab size {rows}")
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat((tensor, padding), dim=0)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def load_logical_into_model(model, logical: dict) -> None:
    """Copies each parameter's slice of the logical state into `model` (any TP rank / PP stage)."""
    for name, param in model.named_parameters():
        global_name = model.global_param_name(name)
        if global_name not in logical:
            raise KeyError(f"logical state has no {global_name!r} (parameter {name!r})")
        full = logical[global_name]
        if hasattr(param, "expert_offset"):  # this rank's experts of the stacked tensors
            full = {part: tensor[param.expert_offset:param.expert_offset + param.shape[0]] for part, tensor in full.items()}
        local = param.tp_layout.full_to_local(full)
        if local.shape != param.shape:
            raise ValueError(f"{global_name}: logical state gives shape {tuple(local.shape)} for this rank, "
                             f"the parameter is {tuple(param.shape)}")
        param.copy_(local)


@torch.no_grad()
def model_to_logical(model) -> dict:
    """The logical state of `model` (collective over its TP group; single process: group None)."""
    logical = {}
    for name, param in model.named_parameters():
        full = param.tp_layout.local_to_full(param, group=model.groups.tp)
        logical[model.global_param_name(name)] = {part: tensor.clone() for part, tensor in full.items()}
    return logical
