"""Writes Megatron-LM checkpoints with Megatron-Core's own code: the fixtures of
test_megatron_lm_import.py.

Run with only Megatron-Core on PYTHONPATH (never our `megatron` package), once per rank of 4:

    RANK=r WORLD_SIZE=4 python megatron_lm_reference.py OUT_DIR STORE_FILE

First, at TP1 (data parallel 4), it builds a Llama-style and a GPT-style GPTModel, gives them weights
of a size that makes logits O(1), saves each in both formats (torch_dist with `dist_checkpointing`;
legacy `mp_rank_00/model_optim_rng.pt`) and saves the logits of a forward pass on fixed tokens.
Then it loads those torch_dist checkpoints at TP2 x PP2 with `dist_checkpointing.load` (Megatron's
own resharding) and saves them again at that layout in both formats; the Llama model also at
TP2 x PP2 with two virtual stages (legacy keys `model0`, `model1`). A third model, "qk", has
the options whose import was once refused: query/key layer norms, zero-centered norm weights
(--apply-layernorm-1p) and interleaved rotary embeddings (LayerNorm, GQA, RoPE, biases, exact
GeLU, untied).

Checkpoints follow Megatron-LM's `save_checkpoint`: `iter_0000007/` plus
`latest_checkpointed_iteration.txt`; the state dict holds `args` (an argparse.Namespace with
Megatron's argument names, including Megatron enum values), `checkpoint_version` 3.0, `iteration`,
`model` (`model0`, `model1`, ... with virtual stages), and for legacy files the RNG state (numpy's
included). The GPT-style legacy files use the Transformer Engine spec's parameter names (the
layer norms fused into linear_qkv / linear_fc1, `_extra_state` entries), renamed from the local
spec by Megatron's own `sharded_state_dict_keys_map`, because Transformer Engine needs a GPU.

Megatron-Core runs on CPU here with five shims, none of which changes any arithmetic (and enum
members are pickled by value on every Python, see `_cpu_megatron_core`):
`torch.cuda.current_device` answers "cpu" (rotary frequencies are moved to it each forward),
`torch.cuda.synchronize` is a no-op (called by the checkpoint writer), `Tensor.cuda` returns the
tensor itself (the tied output layer of the last pipeline stage is moved to the GPU before its
all-reduce with the first stage's embedding), and the CUDA RNG tracker's `fork` is a null context
(dropout is zero; the tracker itself needs CUDA), and apex's fused layer-norm function, which
Megatron-Core's `FusedLayerNorm` calls with the (1 + weight) scale it forms itself, is
`F.layer_norm` (apex is not installed; Megatron-Core's torch norms refuse zero-centered weights, so
the "qk" model's norms are `FusedLayerNorm`, Megatron-Core's choice when apex is present). The
causal mask is passed explicitly, because Megatron's default mask is built on "cuda".
"""
import argparse
import contextlib
import io
import os
import random
import sys

ITERATION = 7
TOKENS_SEED = 1234
BATCH, SEQ = 2, 16

MODELS = {
    "llama": dict(
        num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, max_position_embeddings=64, position_embedding_type="rope",
        rotary_base=500000, rotary_percent=1.0, use_rope_scaling=True, rope_scaling_factor=8.0,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, bias_swiglu_fusion=False,
        bias_gelu_fusion=False, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, padded_vocab_size=128),
    "gpt": dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=False,
        num_query_groups=1, kv_channels=16, max_position_embeddings=64, position_embedding_type="learned_absolute",
        rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, bias_swiglu_fusion=False,
        bias_gelu_fusion=True, add_bias_linear=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=False, padded_vocab_size=128),
    "qk": dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, max_position_embeddings=64, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, bias_swiglu_fusion=False,
        bias_gelu_fusion=False, add_bias_linear=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, padded_vocab_size=128,
        qk_layernorm=True, apply_layernorm_1p=True, rotary_interleaved=True),
}
# Megatron-LM's defaults for the options the importer checks (and refuses when set).
COMMON_ARGS = dict(
    apply_layernorm_1p=False, qk_layernorm=False, num_experts=None, multi_latent_attention=False,
    mtp_num_layers=None, rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
    apply_residual_connection_post_layernorm=False, squared_relu=False, quick_geglu=False,
    use_legacy_models=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
    make_vocab_size_divisible_by=128, vocab_size=100, seq_length=SEQ, fp16=False, bf16=False,
    transformer_impl="local", seed=1234)


def main():
    out_dir, store = sys.argv[1:3]
    torch = _cpu_megatron_core()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    for name in MODELS:
        _single(torch, name, out_dir)
    for name, tp, pp, vpp in (("llama", 2, 2, None), ("gpt", 2, 2, None), ("llama", 2, 2, 2), ("qk", 2, 2, None)):
        _parallel(torch, name, out_dir, tp, pp, vpp)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _cpu_megatron_core():
    import enum

    import torch
    # Enum members pickled by value, as Python 3.11.7 and later pickle them: early 3.11 releases
    # (3.11.2) pickle them by name through getattr, which Megatron-Core's own weights-only reload of
    # its common.pt refuses.
    enum.Enum.__reduce_ex__ = lambda self, protocol: (self.__class__, (self._value_,))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.fusions import fused_layer_norm
    fused_layer_norm.FusedLayerNormAffineFunction = _LayerNormFunction
    fused_layer_norm.HAVE_FUSED_LAYER_NORM = True
    return torch


class _LayerNormFunction:
    """apex's FusedLayerNormAffineFunction, computed by F.layer_norm."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):
        raise NotImplementedError  # only its signature is read

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps):
        import torch.nn.functional as F
        return F.layer_norm(input, normalized_shape, weight, bias, eps)


def fixture_name(name, fmt, tp=1, pp=1, vpp=None):
    return f"{name}_{fmt}_tp{tp}_pp{pp}" + (f"_vpp{vpp}" if vpp else "")


def megatron_args(torch, name, tp, pp, vpp, fmt):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        **{**COMMON_ARGS, **MODELS[name]}, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, ckpt_format=fmt, use_dist_ckpt=fmt == "torch_dist",
        params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto)


def build_chunks(torch, name, tp, pp, vpp):
    """The model chunks of this rank (one, or one per virtual stage), as Megatron-LM builds them."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models import backends
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    a = argparse.Namespace(**{**COMMON_ARGS, **MODELS[name]})
    # The LayerNorm class of the local spec and of the final norm: the torch one (apex absent), FusedLayerNorm
    # for zero-centered weights.
    backends.LNImpl = transformer_block.LayerNormImpl = (
        FusedLayerNorm if a.apply_layernorm_1p else backends.WrappedTorchNorm)
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, gated_linear_unit=a.swiglu,
        activation_func=torch.nn.functional.silu if a.swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion,
        add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, qk_layernorm=a.qk_layernorm,
        layernorm_zero_centered_gamma=a.apply_layernorm_1p, rotary_interleaved=a.rotary_interleaved)
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunks.append(GPTModel(
            config, get_gpt_layer_local_spec(normalization=a.normalization, qk_layernorm=a.qk_layernorm),
            vocab_size=a.padded_vocab_size,
            max_sequence_length=a.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
            position_embedding_type=a.position_embedding_type, rotary_percent=a.rotary_percent,
            rotary_base=a.rotary_base, rope_scaling=a.use_rope_scaling, rope_scaling_factor=a.rope_scaling_factor,
            vp_stage=vp_stage).eval())
    return chunks


def randomize(torch, model, seed=0):
    """Weights that make logits O(1): Megatron's own init (std 0.02, norms at one) gives logits so
    small that a tight tolerance could not tell a correct import from a wrong one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif "embedding" in name:
                param.copy_(noise)
            elif param.ndim == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def sharded_state_dict(chunks):
    from megatron.core import parallel_state
    metadata = {"singleton_local_shards": False,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}


def save_torch_dist(torch, chunks, args, root):
    from megatron.core import dist_checkpointing
    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, **sharded_state_dict(chunks),
             "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, directory)
    _write_tracker(torch, root)


def te_names(state_dict):
    """The local spec's state dict under the Transformer Engine spec's names, with the
    `_extra_state` entries Transformer Engine adds (here: empty, as without FP8)."""
    renamed = {}
    for key, value in state_dict.items():
        for local, fused in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):
            if f".{local}" in key and key.startswith("decoder.layers."):
                key = key.replace(local, fused)
        if key.endswith("._extra_state"):
            value = io.BytesIO()
        renamed[key] = value
    for key in [k for k in renamed if k.endswith("self_attention.linear_qkv.weight")]:
        renamed[key.replace("linear_qkv.weight", "core_attention._extra_state")] = None
    return renamed


def save_legacy(torch, name, chunks, args, root):
    """Written by the first data-parallel rank of each (TP, PP) rank, as Megatron-LM does."""
    import numpy
    from megatron.core import parallel_state
    if parallel_state.get_data_parallel_rank() != 0:
        _write_tracker(torch, root)
        return
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    path = os.path.join(root, f"iter_{ITERATION:07d}", rank_dir, "model_optim_rng.pt")
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "num_floating_point_operations_so_far": 0,
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
    for i, chunk in enumerate(chunks):
        model_state = chunk.state_dict_for_save_checkpoint()
        if name == "gpt":
            model_state = te_names(model_state)
        state["model" if len(chunks) == 1 else f"model{i}"] = model_state
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)
    _write_tracker(torch, root)


def _write_tracker(torch, root):
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def reference_inputs(torch) -> tuple:
    """The reference scripts' batch: tokens [b, s] (seeded), positions and the causal mask."""
    generator = torch.Generator().manual_seed(TOKENS_SEED)
    tokens = torch.randint(0, COMMON_ARGS["vocab_size"], (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    return tokens, positions, mask


def _single(torch, name, out_dir):
    (model,) = build_chunks(torch, name, 1, 1, None)
    randomize(torch, model)
    tokens, positions, mask = reference_inputs(torch)
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            logits = model(tokens, positions, mask)  # [b, s, V]
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(out_dir, f"{name}_logits.pt"))
    for fmt, save in (("torch_dist", save_torch_dist), ("torch", None)):
        root = os.path.join(out_dir, fixture_name(name, fmt))
        args = megatron_args(torch, name, 1, 1, None, fmt)
        if save is None:
            save_legacy(torch, name, [model], args, root)
        else:
            save(torch, [model], args, root)


def _parallel(torch, name, out_dir, tp, pp, vpp):
    from megatron.core import dist_checkpointing
    chunks = build_chunks(torch, name, tp, pp, vpp)
    source = os.path.join(out_dir, fixture_name(name, "torch_dist"), f"iter_{ITERATION:07d}")
    sharded = sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(sharded, source)
    for key, chunk in zip(sharded, chunks):
        chunk.load_state_dict(loaded[key])
    for fmt in ("torch_dist", "torch"):
        root = os.path.join(out_dir, fixture_name(name, fmt, tp, pp, vpp))
        args = megatron_args(torch, name, tp, pp, vpp, fmt)
        if fmt == "torch_dist":
            save_torch_dist(torch, chunks, args, root)
        else:
            save_legacy(torch, name, chunks, args, root)


if __name__ == "__main__":
    main()
