"""The planner's activation memory against what autograd really saves for backward.

Each case builds decoder layers of a tiny model, runs one training forward with saved-tensor hooks
that record every distinct storage saved for backward (parameters excluded, views and tensors saved
twice counted once), and compares the bytes with the plan's activation term for the same layout:
per recompute mode (none, selective, full uniform and block), at several shapes, fp32 and bf16,
GQA and multi-head attention, RMSNorm/SwiGLU/RoPE and LayerNorm/GeLU/dropout with the flash and the
math attention kernels, multi-latent attention (with and without the query latent and the latents'
norms); and on 2 gloo processes with tensor parallelism (with and without sequence
parallelism, key/value heads split and replicated) and context parallelism (each comm type).
The plan must agree within 5% (it agrees exactly where every saved tensor is accounted for).
"""

import pytest
import torch

from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.training.planning.architecture import architecture
from megatron.training.planning.layout import Layout
from megatron.training.planning.memory import stage_layer_activations
from tests.distributed.activation_probe import saved_bytes
from tests.distributed.harness import run_distributed
from tests.distributed.parity import gpt2_config, llama_config, split_overrides

TOLERANCE = 0.05
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=12, qk_layernorm=True)
RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
             "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)}
MODELS = {
    "llama-gqa-fp32": dict(family="llama"),
    "llama-gqa-bf16": dict(family="llama", params_dtype=torch.bfloat16),
    "llama-mha-bf16": dict(family="llama", num_query_groups=8, params_dtype=torch.bfloat16),
    "gpt-dropout-fp32": dict(family="gpt", hidden_dropout=0.1),
    "gpt-math-dropout-bf16": dict(family="gpt", hidden_dropout=0.1, attention_dropout=0.1, attention_backend="math",
                                  params_dtype=torch.bfloat16),
    # Multi-latent attention (its value width differs: PyTorch's CPU SDPA runs the math kernel)
    "mla-latent-norms-fp32": dict(family="llama", attention_backend="math", **MLA),
    "mla-latent-norms-bf16": dict(family="llama", attention_backend="math", params_dtype=torch.bfloat16, **MLA),
    "mla-direct-query-bf16": dict(family="llama", attention_backend="math", params_dtype=torch.bfloat16,
                                  **dict(MLA, q_lora_rank=None, qk_layernorm=False)),
}


def model_config(name: str, recompute: str, **overrides) -> tuple:
    """(architecture, ExecutionConfig) of a named model and recompute mode."""
    values = dict(MODELS[name], num_layers=3, max_position_embeddings=128, **RECOMPUTE[recompute], **overrides)
    family = values.pop("family")
    values, execution = split_overrides(values)
    return (llama_config if family == "llama" else gpt2_config)(**values), execution


def planned(model, *, seq: int, batch: int, tp: int = 1, cp: int = 1) -> float:
    """The plan's bytes saved by these layers for one micro-batch on one rank (CPU kernels, eager
    elementwise chains: what the measured run executes)."""
    config, execution = model
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[execution.params_dtype]
    lay = Layout(tp=tp, pp=1, cp=cp, dp=1, micro_batch_size=batch, global_batch_size=batch, seq_length=seq,
                 precision=precision, sequence_parallel=execution.sequence_parallel,
                 cp_comm_type=execution.cp_comm_type, recompute_granularity=execution.recompute_granularity,
                 recompute_method=execution.recompute_method, recompute_num_layers=execution.recompute_num_layers,
                 fused_elementwise=False, device="cpu",
                 attention_kernel="math" if execution.attention_backend == "math" else "flash")
    return stage_layer_activations(architecture(config), lay, config.num_layers)[0]


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_process(name, recompute):
    for seq, batch in ((32, 2), (64, 1), (128, 3)):
        config = model_config(name, recompute)
        measured = saved_bytes(*config, single_process(), seq=seq, batch=batch)
        plan = planned(config, seq=seq, batch=batch)
        assert abs(plan - measured) <= TOLERANCE * measured, (seq, batch, plan, measured)



@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
@pytest.mark.parametrize("name", sorted(name for name in MODELS if name.startswith("mla")))
def test_multi_latent_attention_is_exact(name, recompute):
    """Every tensor multi-latent attention saves is accounted for: the plan is the measurement."""
    for seq, batch in ((32, 2), (64, 1)):
        config = model_config(name, recompute)
        assert planned(config, seq=seq, batch=batch) == saved_bytes(*config, single_process(), seq=seq, batch=batch)


PARALLEL_CASES = [
    # (name, model, recompute, tp, cp, overrides)
    ("tp2", "llama-gqa-bf16", "none", 2, 1, {}),
    ("tp2-sp", "llama-gqa-bf16", "none", 2, 1, dict(sequence_parallel=True)),
    ("tp2-sp-selective", "llama-gqa-fp32", "selective", 2, 1, dict(sequence_parallel=True)),
    ("tp2-sp-full", "llama-gqa-bf16", "full-uniform-2", 2, 1, dict(sequence_parallel=True)),
    ("tp2-kv-replicated", "llama-gqa-bf16", "none", 2, 1, dict(num_query_groups=1, sequence_parallel=True)),
    ("tp2-sp-gpt-dropout", "gpt-dropout-fp32", "none", 2, 1, dict(sequence_parallel=True)),
    ("cp2-p2p", "llama-gqa-bf16", "none", 1, 2, {}),
    ("cp2-all-gather", "llama-gqa-bf16", "none", 1, 2, dict(cp_comm_type="all_gather")),
    ("cp2-a2a", "llama-mha-bf16", "none", 1, 2, dict(cp_comm_type="a2a")),
    ("cp2-selective", "llama-gqa-fp32", "selective", 1, 2, {}),
]


def _measure_all(rank, world_size):
    results = {}
    for name, model, recompute, tp, cp, overrides in PARALLEL_CASES:
        groups = initialize_model_parallel(tp, 1, cp)
        for seq, batch in ((32, 2), (64, 1)):
            config = model_config(model, recompute, **overrides)
            results[(name, seq, batch)] = saved_bytes(*config, groups, seq=seq, batch=batch)
    return results


def test_tensor_and_context_parallel():
    ranks = run_distributed(2, _measure_all)
    failures = []
    for name, model, recompute, tp, cp, overrides in PARALLEL_CASES:
        for seq, batch in ((32, 2), (64, 1)):
            config = model_config(model, recompute, **overrides)
            plan = planned(config, seq=seq, batch=batch, tp=tp, cp=cp)
            for rank, results in enumerate(ranks):
                measured = results[(name, seq, batch)]
                if abs(plan - measured) > TOLERANCE * measured:
                    failures.append(f"{name} s{seq} b{batch} rank {rank}: plan {plan:.0f}, measured {measured}")
    assert not failures, "\n".join(failures)
