"""Shared pieces of the parity tests: a tiny model, deterministic batches, a training run that
returns losses and full (gathered) gradients, and the single-process reference run."""
import dataclasses
import math

import torch

from megatron.core.distributed.ddp import DistributedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive

SEED = 1234


def llama_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                  num_query_groups=2, ffn_hidden_size=96, padded_vocab_size=128, max_position_embeddings=16,
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return derive(TransformerConfig(**values))


def gpt2_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, padded_vocab_size=128,
                  max_position_embeddings=16, normalization="LayerNorm", openai_gelu=True,
                  add_bias_linear=True, position_embedding_type="learned_absolute",
                  untie_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return derive(TransformerConfig(**values))


def split_overrides(overrides: dict) -> tuple:
    """(architecture overrides, ExecutionConfig) of test overrides naming fields of either object."""
    execution_names = {field.name for field in dataclasses.fields(ExecutionConfig)}
    execution = ExecutionConfig(**{k: v for k, v in overrides.items() if k in execution_names})
    return {k: v for k, v in overrides.items() if k not in execution_names}, execution


def global_batches(steps: int, global_batch: int, seq: int, vocab: int) -> list:
    """[steps] of (tokens [G, s], labels [G, s]) from a fixed generator."""
    generator = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        window = torch.randint(0, vocab, (global_batch, seq + 1), generator=generator)
        out.append((window[:, :-1], window[:, 1:]))
    return out


def parity_optimizer_config() -> OptimizerConfig:
    """AdamW with clipping active (the tiny model's gradient norm is well above 0.5). eps is 1e-4
    rather than 1e-8 so that Adam does not turn gradients near zero (where fp32 summation order
    decides the last bits) into full-size updates: that would test Adam's conditioning, not the
    parallel layout."""
    return OptimizerConfig(lr=1e-2, clip_grad=0.5, adam_eps=1e-4)


def gather_full_grads(model: GPTModel, groups) -> dict:
    """{global name: {part: full gradient}} gathered over the tensor-parallel group."""
    grads = {}
    for name, param in model.named_parameters():
        grads[model.global_param_name(name)] = param.tp_layout.local_to_full(param.main_grad, groups.tp)
    return grads


def gather_full_params(model: GPTModel, groups) -> dict:
    return {model.global_param_name(n): p.tp_layout.local_to_full(p.detach(), groups.tp)
            for n, p in model.named_parameters()}


def train_steps(config: TransformerConfig, groups, batches: list, micro_batch_size: int, *,
                optimizer_config: OptimizerConfig = None, sequence_parallel: bool = False,
                execution: ExecutionConfig = None) -> dict:
    """Trains one model chunk over `batches` (global batches); this rank takes its data-parallel
    slice of each micro-batch step as the pretraining sampler does. Returns per step: the loss
    (averaged over micro-batches and data ranks), the gradient norm, and the full gradients."""
    execution = dataclasses.replace(execution or ExecutionConfig(), sequence_parallel=sequence_parallel)
    model = GPTModel(config, groups, execution=execution)
    model.initialize_parameters(SEED)
    ddp = DistributedDataParallel(model, groups)
    optimizer = get_megatron_optimizer(optimizer_config or parity_optimizer_config(), [ddp], groups)
    step_size = micro_batch_size * groups.dp_size
    results = []
    for tokens, labels in batches:
        num_micro = tokens.shape[0] // step_size
        ddp.zero_grad_buffer()
        loss_sum = torch.zeros(1)
        for micro in range(num_micro):
            first = micro * step_size + groups.dp_rank * micro_batch_size
            t, lab = tokens[first:first + micro_batch_size], labels[first:first + micro_batch_size]
            positions = torch.arange(t.shape[1]).expand_as(t)
            loss = ddp(t, positions, labels=lab).mean()
            (loss / num_micro).backward()
            loss_sum += loss.detach() / num_micro
        finalize_model_grads([ddp], groups)
        from megatron.core.distributed import comm

        comm.all_reduce(loss_sum, groups.dp)
        grads = gather_full_grads(model, groups)
        applied, grad_norm = optimizer.step()
        results.append({"loss": loss_sum.item() / groups.dp_size, "grad_norm": grad_norm, "grads": grads,
                        "applied": applied})
    results.append({"params": gather_full_params(model, groups)})
    return results


def reference_steps(config: TransformerConfig, batches: list, micro_batch_size: int, **kwargs) -> list:
    return train_steps(config, single_process(), batches, micro_batch_size, **kwargs)


# The norm the optimizer reports against the norm of the gathered full gradients: the same fp32
# values summed in another order (a few roundings of 2^-24 each), so 1e-6 relative. A replicated
# tensor counted twice, or a shard left out, moves it by far more (the norm weights of one layer
# counted twice moved this model's norm by 9e-5).
GRAD_NORM_RTOL = 1e-6


def norm_of_full_gradients(per_rank_grads: list) -> float:
    """The global gradient norm computed by hand from full (gathered) gradients: `per_rank_grads` is
    one {key: full gradient} per rank; a key several ranks hold (data-parallel replicas, the two
    copies of a tied embedding) is counted once. No replication weights, no shards."""
    unique = {}
    for grads in per_rank_grads:
        for key, grad in grads.items():
            unique.setdefault(key, grad)
    return math.sqrt(sum(float(grad.double().pow(2).sum()) for grad in unique.values()))


def assert_norm_is_the_full_gradients_norm(norm: float, per_rank_grads: list, context=()) -> None:
    expected = norm_of_full_gradients(per_rank_grads)
    assert abs(norm - expected) <= GRAD_NORM_RTOL * expected, (*context, norm, expected, norm / expected - 1)


def assert_runs_match(run: list, reference: list, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses, gradient norms and every gathered gradient of every step, then the final weights.
    Each step's gradient norm also equals the norm of the gathered gradients (GRAD_NORM_RTOL).

    `atol` covers elements near zero, where summation order alone moves the relative error.
    """
    for step, (got, want) in enumerate(zip(run[:-1], reference[:-1])):
        flat = {(name, part): grad for name, parts in got["grads"].items() for part, grad in parts.items()}
        assert_norm_is_the_full_gradients_norm(got["grad_norm"], [flat], ("step", step))
        assert abs(got["loss"] - want["loss"]) <= rtol * abs(want["loss"]), (step, got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= rtol * abs(want["grad_norm"]), (
            step, got["grad_norm"], want["grad_norm"])
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            for part, tensor in want["grads"][name].items():
                torch.testing.assert_close(got["grads"][name][part], tensor, rtol=rtol, atol=atol,
                                           msg=lambda m: f"step {step} grad {name}[{part}]: {m}")
    for name, parts in reference[-1]["params"].items():
        for part, tensor in parts.items():
            torch.testing.assert_close(run[-1]["params"][name][part], tensor, rtol=rtol, atol=atol,
                                       msg=lambda m: f"final weight {name}[{part}]: {m}")


def compare_tp_cases_with_one_process(rank, world_size, tp: int, cases: list, *, steps: int = 3, global_batch: int = 4,
                                      micro_batch: int = 2, seq: int = 16) -> bool:
    """Run on every rank of a TP `tp` layout: for each (name, config, sequence_parallel) case, `steps`
    training steps equal the single-process run of the same batches (atol 2e-6)."""
    from megatron.core.parallel_state import initialize_model_parallel

    groups = initialize_model_parallel(tp, 1)
    for name, config, sequence_parallel in cases:
        batches = global_batches(steps, global_batch, seq, config.padded_vocab_size)
        run = train_steps(config, groups, batches, micro_batch, sequence_parallel=sequence_parallel)
        reference = reference_steps(config, batches, micro_batch)
        try:
            assert_runs_match(run, reference, atol=2e-6)
        except AssertionError as error:
            raise AssertionError(f"case {name} (tp={tp}, sp={sequence_parallel}): {error}") from None
    return True
