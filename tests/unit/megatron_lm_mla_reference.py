"""Writes a Megatron-LM DeepSeek-V3-style checkpoint with Megatron-Core's own code: the fixtures of
test_megatron_lm_mla_import.py.

Run with only Megatron-Core on PYTHONPATH (never our `megatron` package), once per rank of 4:

    RANK=r WORLD_SIZE=4 python megatron_lm_mla_reference.py OUT_DIR STORE_FILE

One model, "deepseek" (GPTModel with Megatron-Core's local spec, `get_gpt_decoder_block_spec`, and
its multi-token prediction block, `get_gpt_mtp_block_spec`): multi-latent attention with a query
latent (--q-lora-rank) and both latents' norms (--qk-layernorm), YaRN rotary embedding with a
softmax correction (--rope-type yarn, --rotary-scaling-factor, --mscale, --mscale-all-dim, a short
--yarn-original-max-position-embeddings so that the interpolated band reaches the test's
positions); a dense first layer, then a mixture of 4 experts with a shared expert, sigmoid routing
with an expert bias, group-limited top-2 (2 groups, the best 1) and a top-k scaling factor;
one multi-token prediction depth (--mtp-num-layers 1). RMSNorm, SwiGLU, untied, no biases.

It is built at TP1, its weights randomized (megatron_lm_reference.randomize, the expert biases as
megatron_lm_moe_reference.randomize_moe), and the logits of a forward pass on fixed tokens saved: the
main head's and the prediction depth's (both pass through the output layer, which a hook records;
Megatron-Core runs the prediction modules only when labels are given). Then the model is saved in
both formats at TP1, and the torch_dist checkpoint loaded by Megatron-Core's resharding at
TP2 x PP2 (the prediction module on the last stage, with a copy of the word embedding) and saved
again in both formats.

Megatron-Core runs on CPU with megatron_lm_reference.py's and megatron_lm_moe_reference.py's shims,
and one more: 0.16.1's local spec cannot build multi-latent attention as released, because
MLASelfAttention passes `k_channels` and `v_channels` (the query/key head size differs from the
value's) to its core attention, which only Transformer Engine's accepts; the local DotProductAttention
raises TypeError. Here the local spec's core attention is DotProductAttention taking the two: its
arithmetic reads the heads' sizes from the tensors, and only its output's reshape needs v_channels.
And 0.16.1's multi_latent_attention module imports Transformer Engine's classes from
`extensions.transformer_engine`, which without Transformer Engine defines them over a MagicMock and
so succeeds: the module's HAVE_TE is then True, and its `isinstance(self.linear_proj, TELinear)`
(an FP8 option) raises TypeError. Its HAVE_TE is set to False, as it says when the import fails.
The local spec's multi-latent attention is otherwise ColumnParallelLinear layers (the down
projections too: column-parallel, split over the TP ranks in legacy files, where Transformer
Engine's spec keeps them whole on each rank).
"""
import argparse
import os
import sys

from megatron_lm_moe_reference import _MOE_DEFAULTS, randomize_moe
from megatron_lm_reference import (
    COMMON_ARGS,
    ITERATION,
    _cpu_megatron_core,
    _write_tracker,
    reference_inputs,
    save_torch_dist,
    sharded_state_dict,
)

MODEL = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=False,
    num_query_groups=1, kv_channels=16, max_position_embeddings=64, position_embedding_type="rope",
    rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
    normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, bias_swiglu_fusion=False, bias_gelu_fusion=False,
    add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True, padded_vocab_size=128,
    qk_layernorm=True,
    # Multi-latent attention and YaRN
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=12, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
    yarn_original_max_position_embeddings=8, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    # Mixture of experts
    num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=2,
    moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3],
    # Multi-token prediction
    mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
LAYOUTS = ((2, 2),)  # (TP, PP) after TP1


def main():
    out_dir, store = sys.argv[1:3]
    torch = _cpu_megatron_core()
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None  # as megatron_lm_moe_reference.py
    _local_mla_core_attention()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    _single(torch, out_dir)
    for tp, pp in LAYOUTS:
        _parallel(torch, out_dir, tp, pp)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _local_mla_core_attention():
    """The local spec's core attention with MLASelfAttention's `k_channels` / `v_channels`, and
    multi-latent attention told that Transformer Engine is absent (see above)."""
    from megatron.core.models import backends
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # MLA's; the Attention base class first builds one without
                # [s, b, heads/tp, v_channels] -> [s, b, heads/tp x v_channels]
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    backends.LocalSpecProvider.core_attention = lambda self: MLADotProductAttention
    from megatron.core.transformer import multi_latent_attention
    multi_latent_attention.HAVE_TE = False  # Transformer Engine is absent (see above)


def fixture_name(fmt, tp=1, pp=1):
    return f"deepseek_{fmt}_tp{tp}_pp{pp}"


def megatron_args(torch, tp, pp, fmt):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        **{**COMMON_ARGS, **_MOE_DEFAULTS, **MODEL}, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, expert_tensor_parallel_size=tp,
        ckpt_format=fmt, use_dist_ckpt=fmt == "torch_dist", params_dtype=torch.float32,
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto)


def build_model(torch, tp, pp):
    """This rank's GPTModel, as Megatron-LM builds a multi-latent-attention model with the local spec."""
    from megatron.core import parallel_state
    from megatron.core.models import backends
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    a = argparse.Namespace(**{**COMMON_ARGS, **_MOE_DEFAULTS, **MODEL})
    backends.LNImpl = transformer_block.LayerNormImpl = backends.WrappedTorchNorm
    config = MLATransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, kv_channels=a.kv_channels, normalization=a.normalization,
        layernorm_epsilon=a.norm_epsilon, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, qk_layernorm=a.qk_layernorm,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
        qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim, rope_type=a.rope_type,
        rotary_base=a.rotary_base, rotary_scaling_factor=a.rotary_scaling_factor, mscale=a.mscale,
        mscale_all_dim=a.mscale_all_dim, original_max_position_embeddings=a.yarn_original_max_position_embeddings,
        beta_fast=a.yarn_beta_fast, beta_slow=a.yarn_beta_slow,
        num_moe_experts=a.num_experts, moe_layer_freq=a.moe_layer_freq, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        moe_router_topk=a.moe_router_topk, moe_router_score_function=a.moe_router_score_function,
        moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
        moe_router_num_groups=a.moe_router_num_groups, moe_router_group_topk=a.moe_router_group_topk,
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type="allgather", mtp_num_layers=a.mtp_num_layers,
        mtp_loss_scaling_factor=a.mtp_loss_scaling_factor)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=a.normalization,
                                              pp_rank=pp_rank)
    mtp_spec = get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=False, pp_rank=pp_rank)
    return GPTModel(
        config, decoder_spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_percent=1.0,
        rotary_base=a.rotary_base, mtp_block_spec=mtp_spec).eval()


def save_legacy(torch, model, args, root):
    """Megatron-LM's legacy save: one file per (TP, PP) rank, written by data-parallel rank 0."""
    import random

    import numpy
    from megatron.core import parallel_state as ps
    if ps.get_data_parallel_rank() == 0:
        rank_dir = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if ps.get_pipeline_model_parallel_world_size() > 1:
            rank_dir += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        path = os.path.join(root, f"iter_{ITERATION:07d}", rank_dir, "model_optim_rng.pt")
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "num_floating_point_operations_so_far": 0, "model": model.state_dict_for_save_checkpoint(),
                 "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    _write_tracker(torch, root)


def _single(torch, out_dir):
    model = build_model(torch, 1, 1)
    randomize_moe(torch, model)
    tokens, positions, mask = reference_inputs(torch)
    if torch.distributed.get_rank() == 0:
        # The output layer's logits [s, b, V]: the prediction depth's, then the main head's; copied, as
        # Megatron-Core's cross entropy then works on them in place.
        outputs = []
        hook = model.output_layer.register_forward_hook(
            lambda module, inputs, output: outputs.append(output[0].clone()))
        with torch.no_grad():
            model(tokens, positions, mask, labels=tokens)
        hook.remove()
        mtp_logits, logits = outputs
        torch.save({"tokens": tokens, "logits": logits.transpose(0, 1), "mtp_logits": mtp_logits.transpose(0, 1)},
                   os.path.join(out_dir, "deepseek_logits.pt"))
    save_torch_dist(torch, [model], megatron_args(torch, 1, 1, "torch_dist"),
                    os.path.join(out_dir, fixture_name("torch_dist")))
    save_legacy(torch, model, megatron_args(torch, 1, 1, "torch"), os.path.join(out_dir, fixture_name("torch")))


def _parallel(torch, out_dir, tp, pp):
    from megatron.core import dist_checkpointing
    model = build_model(torch, tp, pp)
    source = os.path.join(out_dir, fixture_name("torch_dist"), f"iter_{ITERATION:07d}")
    sharded = sharded_state_dict([model])
    model.load_state_dict(dist_checkpointing.load(sharded, source)["model"])
    save_torch_dist(torch, [model], megatron_args(torch, tp, pp, "torch_dist"),
                    os.path.join(out_dir, fixture_name("torch_dist", tp, pp)))
    save_legacy(torch, model, megatron_args(torch, tp, pp, "torch"), os.path.join(out_dir, fixture_name("torch", tp, pp)))


if __name__ == "__main__":
    main()
