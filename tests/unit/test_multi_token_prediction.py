"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor) against a hand computation
from the model's own weights on a small case: each depth k re-run by hand on the sequence cut to its
first s - k positions (causal attention makes the cut exact: position i never reads a later one), its
loss the cross entropy against labels[:, k:] masked by loss_mask[:, k:], and the training loss
lm loss + factor / D * (mtp_1 + ... + mtp_D) as pretrain_gpt's loss function forms it, with its
gradients; the modules' checkpoint names are Megatron-Core's; bad settings are refused by name."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import TransformerConfig, derive
from pretrain_gpt import loss_func
from tests.distributed.parity import llama_config

BATCH, SEQ, VOCAB, DEPTHS, FACTOR = 2, 12, 128, 2, 0.3


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(**overrides) -> GPTModel:
    """The tiny Llama-style model with DEPTHS prediction modules; every weight (norms included) moved
    off its initial value so that swapped norms or projections cannot pass."""
    config = llama_config(mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR, **overrides)
    model = GPTModel(config, single_process())
    model.initialize_parameters(7)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def batch():
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.25).float()
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(BATCH, SEQ), loss_mask


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def hand_mtp_losses(model: GPTModel, tokens, labels, positions, loss_mask) -> list:
    """Each depth's masked mean loss, built from the weights: depth k embeds tokens[:, k:], joins
    it with the previous depth's hidden states of the first s - k positions, and is scored
    against labels[:, k:] with loss_mask[:, k:]."""
    eps = model.config.norm_epsilon
    embedding = model.embedding.word_embeddings.weight
    rotary = model.rotary(positions)
    hidden = model.decoder(model.embedding(tokens, positions), rotary)  # [s, b, h], after the final norm
    losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        length = SEQ - k
        embedded = F.embedding(tokens[:, k:], embedding).transpose(0, 1)  # [s-k, b, h]
        joined = torch.cat((rms_norm(embedded, layer.enorm.weight, eps),
                            rms_norm(hidden[:length], layer.hnorm.weight, eps)), dim=-1)
        x = F.linear(joined, layer.eh_proj.weight)
        x = layer.transformer_layer(x, model.rotary(positions[:, :length]))
        hidden = rms_norm(x, layer.final_layernorm.weight, eps)  # [s-k, b, h]
        logits = F.linear(hidden, model.output_layer).transpose(0, 1)  # [b, s-k, V]
        token_losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, k:].reshape(-1),
                                       reduction="none").view(BATCH, length)
        mask = loss_mask[:, k:]
        losses.append((token_losses * mask).sum() / mask.sum())
    return losses


def main_loss(model, tokens, labels, positions, loss_mask):
    model.eval()  # evaluation skips the prediction modules: the main loss alone
    token_losses = model(tokens, positions, labels=labels)
    model.train()
    return (token_losses * loss_mask).sum() / loss_mask.sum()


def test_mtp_loss_equals_the_hand_computation():
    model = build()
    tokens, labels, positions, loss_mask = batch()
    output = model(tokens, positions, labels=labels)
    loss, reported = loss_func(loss_mask, None, False, output, mtp_loss_scaling_factor=FACTOR)
    expected_depths = hand_mtp_losses(model, tokens, labels, positions, loss_mask)
    expected = main_loss(model, tokens, labels, positions, loss_mask) + FACTOR / DEPTHS * sum(expected_depths)
    for k, value in enumerate(expected_depths, start=1):
        torch.testing.assert_close(reported[f"mtp_{k} loss"][0], value.detach(), rtol=1e-5, atol=0)
        assert reported[f"mtp_{k} loss"][1] == 1.0  # a mean per micro-batch, as Megatron-Core logs it
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    # and the gradients: of every prediction-module weight, the shared embedding and output layer
    ours = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    theirs = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
    for (name, _), got, want in zip(model.named_parameters(), ours, theirs):
        assert want is not None, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_per_token_loss_adds_the_depth_sums():
    """--calculate-per-token-loss: the loss is a sum, and so is each depth's term (Megatron-Core)."""
    model = build()
    tokens, labels, positions, loss_mask = batch()
    main, depth_losses = model(tokens, positions, labels=labels)
    loss, reported = loss_func(loss_mask, None, True, (main, depth_losses), mtp_loss_scaling_factor=FACTOR)
    sums = [(depth_losses[k - 1, :, :SEQ - k] * loss_mask[:, k:]).sum() for k in range(1, DEPTHS + 1)]
    torch.testing.assert_close(loss, (main * loss_mask).sum() + FACTOR / DEPTHS * sum(sums), rtol=1e-6, atol=0)
    assert reported["lm loss"][1] == loss_mask.sum()


def test_checkpoint_names_are_megatron_cores():
    model = build(untie_embeddings_and_output_weights=False)
    names = {model.global_param_name(name) for name, _ in model.named_parameters()}
    for depth in range(DEPTHS):
        prefix = f"mtp.layers.{depth}."
        assert {prefix + part for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                           "final_layernorm.weight")} <= names
        assert prefix + "transformer_layer.self_attention.linear_qkv.weight" in names
    assert "output_layer.weight" not in names  # tied: the one embedding serves both ends and every depth


def test_evaluation_and_logits_skip_the_prediction_modules():
    model = build()
    tokens, labels, positions, _ = batch()
    model.eval()
    assert model(tokens, positions, labels=labels).shape == (BATCH, SEQ)
    assert model(tokens, positions).shape == (SEQ, BATCH, VOCAB)


def test_mtp_num_layers_zero_is_none_and_negative_is_refused():
    assert derive(dataclasses.replace(llama_config(), mtp_num_layers=0)).mtp_num_layers is None  # as Megatron-Core
    with pytest.raises(ValueError, match="--mtp-num-layers must be >= 0, got -1"):
        derive(dataclasses.replace(llama_config(), mtp_num_layers=-1))


def test_learned_positions_off_the_first_stage_are_refused():
    config = derive(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                                      max_position_embeddings=16, mtp_num_layers=1))
    with pytest.raises(ValueError, match="--mtp-num-layers with --pipeline-model-parallel-size > 1"):
        GPTModel(config, single_process(), pre_process=False, layer_numbers=[1])


def test_deepseek_v3_checkpoint_mtp_weights_import_and_export():
    """A DeepSeek-V3 checkpoint's prediction module (model.layers.{L}: enorm, hnorm, eh_proj,
    shared_head.norm, a decoder layer, and copies of the embedding and head) lands on the module's
    own weights, and the export gives every tensor back but the copies (transformers' model never
    holds them; the main embedding and head are the ones every depth uses)."""
    from tests.unit.test_mla import deepseek_config, randomize, transformers
    from megatron.core.models.gpt.hf_mapping import (hf_config_from_transformer_config,
                                                     hf_config_to_transformer_config, hf_to_logical,
                                                     load_logical_into_model, logical_to_hf, model_to_logical)

    hf = randomize(transformers.DeepseekV3ForCausalLM(deepseek_config())).eval()
    state = dict(hf.state_dict())
    generator = torch.Generator().manual_seed(5)
    mtp = {}
    for key, tensor in state.items():  # the module's layer: shaped as the last decoder layer
        if key.startswith("model.layers.1."):
            mtp["model.layers.2." + key[len("model.layers.1."):]] = torch.randn(tensor.shape, generator=generator)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
                        ("shared_head.norm.weight", (64,))):
        mtp[f"model.layers.2.{name}"] = torch.randn(shape, generator=generator)
    copies = {"model.layers.2.embed_tokens.weight": state["model.embed_tokens.weight"],
              "model.layers.2.shared_head.head.weight": state["lm_head.weight"]}
    hf_config = deepseek_config(num_nextn_predict_layers=1)
    config = hf_config_to_transformer_config(hf_config)
    assert config.mtp_num_layers == 1
    ours = GPTModel(config, single_process())
    load_logical_into_model(ours, hf_to_logical({**state, **mtp, **copies}, config, "deepseek_v3"))
    layer = ours.mtp.layers[0]
    for ours_weight, key in ((layer.enorm.weight, "enorm.weight"), (layer.hnorm.weight, "hnorm.weight"),
                             (layer.eh_proj.weight, "eh_proj.weight"),
                             (layer.final_layernorm.weight, "shared_head.norm.weight"),
                             (layer.transformer_layer.self_attention.linear_proj.weight, "self_attn.o_proj.weight"),
                             (layer.transformer_layer.mlp.linear_fc2.weight, "mlp.down_proj.weight")):
        assert torch.equal(ours_weight.detach(), mtp[f"model.layers.2.{key}"]), key
    back = logical_to_hf(model_to_logical(ours), config, "deepseek_v3", vocab_size=VOCAB)
    assert sorted(back) == sorted({**state, **mtp})
    for key, tensor in back.items():
        assert torch.equal(tensor, {**state, **mtp}[key]), key
    exported = hf_config_from_transformer_config(config, VOCAB)
    assert exported.num_nextn_predict_layers == 1
    assert hf_config_to_transformer_config(exported) == config


def test_prediction_layer_after_a_mixture_of_experts_layer_is_one_and_logs_its_router():
    """Built as the last decoder layer (Megatron-Core builds it from the last layer's spec): with the
    first layer dense and the second a mixture of experts, the module's layer is a mixture of experts
    whose auxiliary loss is tracked after the decoder's layers and averaged over 1 + D MoE layers."""
    from megatron.core.transformer.moe.router import aux_loss_log_values

    model = build(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq="[0]*1+[1]*1",
                  moe_aux_loss_coeff=[0.01])
    assert [layer.transformer_layer.is_moe for layer in model.mtp.layers] == [True] * DEPTHS
    tokens, labels, positions, loss_mask = batch()
    loss, _ = loss_func(loss_mask, None, False, model(tokens, positions, labels=labels), mtp_loss_scaling_factor=FACTOR)
    loss.backward()
    assert all(layer.transformer_layer.mlp.router.weight.grad is not None for layer in model.mtp.layers)
    values = aux_loss_log_values([model], model.config, single_process(), 1, per_layer=True)
    per_layer = [values[f"moe/load_balancing_loss_layer_{i}"][0] for i in range(2 + DEPTHS)]
    assert per_layer[0] == 0 and all(value > 0 for value in per_layer[1:])  # layer 0 dense; 1 and the modules MoE
    torch.testing.assert_close(values["load_balancing_loss"][0], sum(per_layer) / (1 + DEPTHS))


@torch.no_grad()
def test_prediction_module_logits_equal_transformers_mtp_layer():
    """An independent reference: `transformers`' MtpLayer (the module its speculative decoding loads
    from DeepSeek-V3 checkpoints) with DeepseekV3's decoder layer and norm, its weights put at the
    checkpoint names (model.layers.{L}.enorm, ..., shared_head.norm = its post_norm) and imported:
    given the same previous hidden states (the decoder's output after its final norm) and the
    tokens shifted by one, the module's logits equal ours (1e-4, fp32)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from megatron.core.models.gpt.hf_mapping import hf_config_to_transformer_config, hf_to_logical, load_logical_into_model
    from megatron.core.transformer.multi_token_prediction import roll_left
    from tests.unit.test_mla import deepseek_config, randomize, transformers

    hf_config = deepseek_config(num_nextn_predict_layers=1)
    hf = randomize(transformers.DeepseekV3ForCausalLM(hf_config)).eval()
    module = randomize(MtpLayer(hf_config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0)).eval()
    names = {"mtp_block.": "", "post_norm.": "shared_head.norm."}
    mtp = {}
    for key, tensor in module.state_dict().items():
        renamed = next((new + key[len(old):] for old, new in names.items() if key.startswith(old)), key)
        mtp[f"model.layers.2.{renamed}"] = tensor
    config = hf_config_to_transformer_config(hf_config)
    ours = GPTModel(config, single_process()).eval()
    load_logical_into_model(ours, hf_to_logical({**hf.state_dict(), **mtp}, config, "deepseek_v3"))

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    shifted = roll_left(tokens)
    previous = hf.model(input_ids=tokens).last_hidden_state  # [b, s, h], after the final norm
    rotary = hf.model.rotary_emb(previous, positions)
    expected = hf.lm_head(module(hf.model.embed_tokens(shifted), previous, rotary, None, positions, None))

    hidden = ours.decoder(ours.embedding(tokens, positions), ours.rotary(positions))
    layer = ours.mtp.layers[0]
    got = F.linear(layer(hidden, ours.embedding(shifted, positions), ours.rotary(positions)), ours.output_layer)
    got = got.transpose(0, 1)[..., :VOCAB]
    assert expected.std() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_context_parallelism_is_refused_at_startup():
    from megatron.training.arguments import parse_args
    from megatron.training.validation import ConfigError, validate
    from tests.unit.test_arguments import MINIMAL

    config = parse_args(MINIMAL + ["--position-embedding-type", "rope", "--mtp-num-layers", "1",
                                   "--context-parallel-size", "2", "--attention-dropout", "0"])
    with pytest.raises(ConfigError, match="--mtp-num-layers is not supported with --context-parallel-size 2"):
        validate(config, world_size=2)
