"""Writes Megatron-LM mixture-of-experts checkpoints with Megatron-Core's own code: the fixtures of
test_megatron_lm_moe_import.py.

Run with only Megatron-Core on PYTHONPATH (never our `megatron` package), once per rank of 4:

    RANK=r WORLD_SIZE=4 python megatron_lm_moe_reference.py OUT_DIR STORE_FILE

Two models (GPTModel with Megatron-Core's local spec, `get_gpt_decoder_block_spec`):
- "mixtral": every layer a mixture of 4 experts, top-2 softmax routing, SwiGLU experts, GQA, RoPE,
  RMSNorm, untied, no biases.
- "shared": 3 layers, the first dense (--moe-layer-freq [0,1,1]), experts of their own hidden size
  (--moe-ffn-hidden-size 32), sigmoid routing with an expert bias (aux-loss-free balancing, the bias
  set to random values so that it changes the choice), a top-k scaling factor, shared experts with
  their sigmoid gate, query/key layer norms.

Each is built at TP1 / EP1 with weights of a size that makes logits O(1); the logits of a forward
pass on fixed tokens are saved, and the model in both formats. Then the torch_dist checkpoint is
loaded with `dist_checkpointing.load` (Megatron's own resharding) at other layouts (EP2, TP2 x EP2,
PP2 x EP2) and saved again in both formats, and at TP2 x EP2 with expert-tensor-parallel size 1 in
torch_dist. The legacy files of an expert-parallel layout are
`mp_rank_TT[_PPP]_EEE/` (Megatron-LM's `get_checkpoint_name`), written by the ranks of expert-data-
parallel rank 0.

Experts come in three state-dict forms in legacy files: SequentialMLP (`experts.local_experts.{j}.
linear_fc1.weight`, the local spec's default), the legacy GroupedMLP (`experts.weight1` [h, E_local x
2F/tp], `experts.weight2` [E_local x F/tp, h]; --moe-grouped-gemm --moe-use-legacy-grouped-gemm),
built here with the `grouped_gemm` package's availability check answered yes (its kernels are never
called: the model is only loaded and saved), and Transformer Engine's TEGroupedMLP names
(`experts.linear_fc1.weight{j}`, with `_extra_state`), renamed from SequentialMLP's state dict as
megatron_lm_reference.py renames the dense layers, because Transformer Engine needs a GPU.
torch_dist checkpoints hold the same tensors for every form (Megatron-Core maps them all to the
SequentialMLP keys, `mlp.experts.experts.linear_fc1.weight` [.., E, 2F, h] under global expert
indices).

Megatron-Core runs on CPU with megatron_lm_reference.py's shims, and one more: moe_utils'
`te_general_gemm` is set to None, as Megatron-Core means it to be without Transformer Engine (0.16.1
leaves the name undefined then, and the router's linear layer would fail on it); the router then
runs its torch GEMM.
"""
import argparse
import io
import os
import random
import re
import sys

from megatron_lm_reference import (
    COMMON_ARGS,
    ITERATION,
    _cpu_megatron_core,
    _write_tracker,
    reference_inputs,
    randomize,
    save_torch_dist,
    sharded_state_dict,
)

_DENSE = dict(
    hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2, kv_channels=16,
    max_position_embeddings=64, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
    use_rope_scaling=False, rope_scaling_factor=8.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
    bias_swiglu_fusion=False, bias_gelu_fusion=False, add_bias_linear=False, add_qkv_bias=False,
    untie_embeddings_and_output_weights=True, padded_vocab_size=128)
# Megatron-LM's defaults for the MoE arguments (as its validate_args leaves them).
_MOE_DEFAULTS = dict(
    moe_router_topk=2, moe_router_score_function="softmax", moe_router_pre_softmax=False,
    moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
    moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3, moe_router_dtype=None,
    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
    moe_input_jitter_eps=None, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
    moe_use_legacy_grouped_gemm=False, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
    moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs",
    moe_apply_probs_on_input=False, moe_latent_size=None, moe_layer_recompute=False)
MODELS = {
    "mixtral": dict(_DENSE, num_layers=2, ffn_hidden_size=96, num_experts=4, moe_layer_freq=1, moe_ffn_hidden_size=96),
    "shared": dict(_DENSE, num_layers=3, ffn_hidden_size=96, qk_layernorm=True, num_experts=4,
                   moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
                   moe_shared_expert_gate=True, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.0,
                   moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3]),
}
# (model, TP, PP, EP, ETP, legacy forms): the layouts each model is saved at after TP1 / PP1 / EP1
# (ETP None: TP, Megatron-LM's default). TP2 with ETP1 only in torch_dist (such legacy files are refused).
LAYOUTS = (("mixtral", 1, 1, 2, None, ("sequential",)), ("mixtral", 2, 1, 2, None, ("sequential", "grouped")),
           ("mixtral", 1, 2, 2, None, ("sequential",)), ("mixtral", 2, 1, 2, 1, ()),
           ("shared", 1, 1, 2, None, ("te",)), ("shared", 2, 1, 2, None, ("te",)))
SINGLE_FORMS = {"mixtral": ("sequential", "grouped"), "shared": ("sequential", "te")}


def main():
    out_dir, store = sys.argv[1:3]
    torch = _cpu_megatron_core()
    from megatron.core.transformer.moe import grouped_gemm_util, moe_utils
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    moe_utils.te_general_gemm = None  # Transformer Engine absent: the router's torch GEMM (0.16.1 leaves it unset)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    for name in MODELS:
        _single(torch, name, out_dir)
    for name, tp, pp, ep, etp, forms in LAYOUTS:
        _parallel(torch, name, out_dir, tp, pp, ep, etp, forms)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def fixture_name(name, fmt, tp=1, pp=1, ep=1, etp=None):
    """fmt: torch_dist, torch (SequentialMLP), torch-grouped (legacy GroupedMLP) or torch-te
    (TEGroupedMLP's names)."""
    return f"{name}_{fmt}_tp{tp}_pp{pp}_ep{ep}" + (f"_etp{etp}" if etp is not None else "")


def megatron_args(torch, name, tp, pp, ep, fmt, etp=None):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    values = {**COMMON_ARGS, **_MOE_DEFAULTS, **MODELS[name]}
    if fmt == "torch-grouped":
        values.update(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    elif fmt == "torch-te":
        values.update(moe_grouped_gemm=True, transformer_impl="transformer_engine")
    return argparse.Namespace(
        **values, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
        ckpt_format="torch" if fmt.startswith("torch-") else fmt, use_dist_ckpt=fmt == "torch_dist",
        params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto)


def build_model(torch, name, tp, pp, ep, etp=None, grouped=False):
    """This rank's GPTModel, as Megatron-LM builds a mixture of experts with the local spec."""
    from megatron.core import parallel_state
    from megatron.core.models import backends
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.destroy_model_parallel()
    etp = tp if etp is None else etp
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    a = argparse.Namespace(**{**COMMON_ARGS, **_MOE_DEFAULTS, **MODELS[name]})
    backends.LNImpl = transformer_block.LayerNormImpl = backends.WrappedTorchNorm
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, gated_linear_unit=a.swiglu,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        pipeline_dtype=torch.float32, use_cpu_initialization=True,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        qk_layernorm=a.qk_layernorm, num_moe_experts=a.num_experts, moe_layer_freq=a.moe_layer_freq,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_topk=a.moe_router_topk,
        moe_router_score_function=a.moe_router_score_function,
        moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=a.moe_shared_expert_gate, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped, bf16=grouped)
    return GPTModel(
        config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=a.normalization,
                                           pp_rank=parallel_state.get_pipeline_model_parallel_rank()),
        vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_percent=1.0,
        rotary_base=a.rotary_base).eval()


def randomize_moe(torch, model, seed=0):
    """randomize()'s weights, and expert biases of the size of the sigmoid scores' differences."""
    randomize(torch, model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("router.expert_bias"):
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def te_names(state_dict, moe_layers):
    """The local spec's state dict under Transformer Engine's names: the layer norms fused into the
    next linear layer (dense layers only: a mixture-of-experts layer keeps its pre_mlp_layernorm),
    SequentialMLP's `local_experts.{j}.linear_fcN.weight` as TEGroupedMLP's `linear_fcN.weight{j}`, and
    the `_extra_state` entries Transformer Engine adds."""
    renamed = {}
    for key, value in state_dict.items():
        if re.search(r"local_experts\.\d+\..*_extra_state$", key):
            continue  # TEGroupedMLP has one _extra_state per grouped linear layer (added below)
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        if match:
            layer, rest = int(match.group(1)), match.group(2)
            rest = rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            if layer not in moe_layers:
                rest = rest.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            expert = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", rest)
            if expert:
                rest = f"mlp.experts.{expert.group(2)}.{expert.group(3)}{expert.group(1)}"
            key = f"decoder.layers.{layer}.{rest}"
        renamed[key] = io.BytesIO() if key.endswith("._extra_state") else value
    for key in [k for k in renamed if k.endswith("mlp.experts.linear_fc1.weight0")]:
        for linear in ("linear_fc1", "linear_fc2"):
            renamed[key.replace("linear_fc1.weight0", f"{linear}._extra_state")] = io.BytesIO()
    return renamed


def save_legacy(torch, name, model, args, root, form):
    """Megatron-LM's legacy save: one file per (TP, PP, EP) rank, from expert-data-parallel rank 0."""
    import numpy
    from megatron.core import parallel_state as ps
    if ps.get_expert_data_parallel_rank() == 0:
        rank_dir = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if ps.get_pipeline_model_parallel_world_size() > 1:
            rank_dir += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        if ps.get_expert_model_parallel_world_size() > 1:
            rank_dir += f"_{ps.get_expert_model_parallel_rank():03d}"
        path = os.path.join(root, f"iter_{ITERATION:07d}", rank_dir, "model_optim_rng.pt")
        model_state = model.state_dict_for_save_checkpoint()
        if form == "te":
            pattern = MODELS[name]["moe_layer_freq"]
            moe_layers = {i for i in range(MODELS[name]["num_layers"])
                          if (pattern[i] if isinstance(pattern, list) else i % pattern == 0)}
            offset = ps.get_pipeline_model_parallel_rank() * (MODELS[name]["num_layers"]
                                                              // ps.get_pipeline_model_parallel_world_size())
            model_state = te_names(model_state, {i - offset for i in moe_layers})
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "num_floating_point_operations_so_far": 0, "model": model_state,
                 "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    _write_tracker(torch, root)


def _legacy_format(form):
    return "torch" if form == "sequential" else f"torch-{form}"


def _single(torch, name, out_dir):
    model = build_model(torch, name, 1, 1, 1)
    randomize_moe(torch, model)
    tokens, positions, mask = reference_inputs(torch)
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            logits = model(tokens, positions, mask)  # [b, s, V]
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(out_dir, f"{name}_logits.pt"))
    save_torch_dist(torch, [model], megatron_args(torch, name, 1, 1, 1, "torch_dist"),
                    os.path.join(out_dir, fixture_name(name, "torch_dist")))
    for form in SINGLE_FORMS[name]:
        fmt = _legacy_format(form)
        source = model if form != "grouped" else _reloaded(torch, name, out_dir, 1, 1, 1, grouped=True)
        save_legacy(torch, name, source, megatron_args(torch, name, 1, 1, 1, fmt),
                    os.path.join(out_dir, fixture_name(name, fmt)), form)


def _reloaded(torch, name, out_dir, tp, pp, ep, etp=None, grouped=False):
    """The TP1 / EP1 torch_dist checkpoint loaded at (tp, pp, ep, etp) by Megatron-Core's resharding."""
    from megatron.core import dist_checkpointing
    model = build_model(torch, name, tp, pp, ep, etp, grouped)
    source = os.path.join(out_dir, fixture_name(name, "torch_dist"), f"iter_{ITERATION:07d}")
    sharded = sharded_state_dict([model])
    loaded = dist_checkpointing.load(sharded, source)
    model.load_state_dict(loaded["model"])
    return model


def _parallel(torch, name, out_dir, tp, pp, ep, etp, forms):
    model = _reloaded(torch, name, out_dir, tp, pp, ep, etp)
    save_torch_dist(torch, [model], megatron_args(torch, name, tp, pp, ep, "torch_dist", etp),
                    os.path.join(out_dir, fixture_name(name, "torch_dist", tp, pp, ep, etp)))
    for form in forms:
        fmt = _legacy_format(form)
        source = model if form != "grouped" else _reloaded(torch, name, out_dir, tp, pp, ep, etp, grouped=True)
        save_legacy(torch, name, source, megatron_args(torch, name, tp, pp, ep, fmt),
                    os.path.join(out_dir, fixture_name(name, fmt, tp, pp, ep)), form)


if __name__ == "__main__":
    main()
