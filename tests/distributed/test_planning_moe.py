"""The planner's mixture-of-experts terms against the model: activation memory against what autograd
saves for backward (saved-tensor hooks, as tests/distributed/test_planning_activations.py does for
the dense layers), per recompute mode (none, selective, full, --moe-layer-recompute), for both token
dispatchers, with and without shared experts (and their gate), with capacity padding, a
load-balancing loss and an fp32 router, in one process, and on 2 gloo processes with EP 2, with TP 2
(SP) and ETP 2, and with TP 2 (SP), EP 2 and ETP 1; and the plan's parameter count against the model's for Mixtral- and Qwen3-MoE-shaped
configurations.

With expert parallelism the rows a rank's experts receive depend on the routing; the plan assumes
balanced routing, so the mean over the ranks (which sees every row once) is compared.
"""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.tensor_parallel.random import build_tracker
from megatron.training.planning.architecture import (architecture, stage_expert_parameters, stage_parameters,
                                                     total_parameters)
from megatron.training.planning.layout import Layout
from megatron.training.planning.memory import stage_layer_activations
from tests.distributed.activation_probe import saved_bytes
from tests.distributed.harness import run_distributed
from tests.distributed.parity import llama_config, split_overrides

TOLERANCE = 0.05
MOE = dict(num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2)
RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "moe-layer-recompute": dict(moe_layer_recompute=True)}
VARIANTS = {
    "allgather": {},
    "alltoall": dict(moe_token_dispatcher_type="alltoall"),
    "allgather-shared": dict(moe_shared_expert_intermediate_size=32),
    "allgather-wide-shared": dict(moe_shared_expert_intermediate_size=256),
    "alltoall-shared-gate": dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32,
                                 moe_shared_expert_gate=True),
    "allgather-bf16-router-fp32": dict(params_dtype=torch.bfloat16, moe_router_dtype="fp32"),
    "alltoall-aux-loss-capacity": dict(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=[0.01],
                                       moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "first-layer-dense": dict(moe_layer_freq="[0]*1+[1]*2"),
    # many small experts: the routing's [tokens, experts] tensors weigh as much as the experts' rows
    "allgather-64-experts-top-1": dict(num_experts=64, moe_ffn_hidden_size=8, moe_router_topk=1),
}


def model_config(variant: str, recompute: str, **overrides) -> tuple:
    values = dict(MOE, num_layers=3, max_position_embeddings=128, **VARIANTS[variant], **RECOMPUTE[recompute],
                  **overrides)
    values, execution = split_overrides(values)
    return llama_config(**values), execution


def planned(model, *, seq: int, batch: int, tp: int = 1, ep: int = 1, etp: int = 1) -> float:
    config, execution = model
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[execution.params_dtype]
    dp = max(1, ep * etp // tp)
    lay = Layout(tp=tp, pp=1, cp=1, dp=dp, micro_batch_size=batch, global_batch_size=batch * dp, seq_length=seq,
                 precision=precision, sequence_parallel=execution.sequence_parallel, etp=etp,
                 recompute_granularity=execution.recompute_granularity,
                 recompute_method=execution.recompute_method, recompute_num_layers=execution.recompute_num_layers,
                 fused_elementwise=False, device="cpu", ep=ep, moe_layer_recompute=execution.moe_layer_recompute)
    return stage_layer_activations(architecture(config), lay, config.num_layers)[0]


SHAPES = ((32, 2), (64, 1))


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_process(variant, recompute):
    for seq, batch in SHAPES:
        config = model_config(variant, recompute)
        measured = saved_bytes(*config, single_process(), seq=seq, batch=batch)
        plan = planned(config, seq=seq, batch=batch)
        assert abs(plan - measured) <= TOLERANCE * measured, (seq, batch, plan, measured)


PARALLEL_CASES = [  # (variant, TP, EP, ETP) on 2 processes; TP > 1 with sequence parallelism
    ("allgather", 1, 2, 1), ("alltoall", 1, 2, 1), ("alltoall-shared-gate", 1, 2, 1),
    ("allgather-64-experts-top-1", 1, 2, 1),
    ("allgather", 2, 1, 2), ("alltoall", 2, 1, 2), ("allgather-shared", 2, 1, 2),
    ("allgather", 2, 2, 1), ("alltoall", 2, 2, 1), ("allgather-wide-shared", 2, 2, 1),
]


def _config(variant: str, tp: int) -> tuple:
    return model_config(variant, "none", **(dict(sequence_parallel=True) if tp > 1 else {}))


def _measure_parallel(rank, world_size):
    results = {}
    for variant, tp, ep, etp in PARALLEL_CASES:
        groups = initialize_model_parallel(tp, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        for seq, batch in SHAPES:
            results[(variant, tp, ep, etp, seq, batch)] = saved_bytes(*_config(variant, tp), groups, seq=seq,
                                                                      batch=batch)
    return results


def test_expert_and_tensor_parallel():
    """EP 2; TP 2 with SP and ETP 2 (each expert split); TP 2 with SP, EP 2 and ETP 1 (experts split
    over the TP ranks, which route their own sequence shards)."""
    ranks = run_distributed(2, _measure_parallel)
    failures = []
    for variant, tp, ep, etp in PARALLEL_CASES:
        for seq, batch in SHAPES:
            measured = sum(results[(variant, tp, ep, etp, seq, batch)] for results in ranks) / len(ranks)
            plan = planned(_config(variant, tp), seq=seq, batch=batch, tp=tp, ep=ep, etp=etp)
            if abs(plan - measured) > TOLERANCE * measured:
                failures.append(f"{variant} TP{tp} EP{ep} ETP{etp} s{seq} b{batch}: plan {plan:.0f}, "
                                f"measured mean {measured:.0f}")
    assert not failures, "\n".join(failures)


SHAPED = {  # tiny models with the families' structure
    "mixtral": dict(num_experts=8, moe_ffn_hidden_size=96, moe_router_topk=2, num_layers=2),
    "qwen3-moe": dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=4, num_layers=3, qk_layernorm=True,
                      kv_channels=16, moe_layer_freq="[0]*1+[1]*2"),
    "qwen2-moe-shared": dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, num_layers=2,
                             moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True),
    "gelu-bias": dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1, num_layers=2, swiglu=False,
                      add_bias_linear=True),
}


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_parameter_count_is_the_models(name):
    config = llama_config(**SHAPED[name])
    model = GPTModel(config, single_process(), rng_tracker=build_tracker(1, 0, 0, torch.device("cpu")),
                     device=torch.device("cpu"))
    assert total_parameters(architecture(config)) == sum(p.numel() for p in model.parameters())


RANK_LAYOUTS = {  # (TP, EP, ETP) on 2 processes: experts split by EP or by ETP, or replicated over TP
    "EP2": (1, 2, 1), "TP2-ETP2": (2, 1, 2), "TP2-EP2-ETP1": (2, 2, 1)}


def _count_per_rank(rank, world_size):
    counts = {}
    for name, (tp, ep, etp) in RANK_LAYOUTS.items():
        groups = initialize_model_parallel(tp, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        config = llama_config(**SHAPED["qwen2-moe-shared"])
        model = GPTModel(config, groups, rng_tracker=build_tracker(1, groups.tp_rank, 0, torch.device("cpu")),
                         device=torch.device("cpu"))
        experts = sum(p.numel() for name_, p in model.named_parameters() if ".experts." in name_)
        counts[name] = (sum(p.numel() for p in model.parameters()) - experts, experts)
    return counts


def test_parameters_per_rank_under_expert_and_tensor_parallelism():
    """The plan's dense and routed-expert parameters on each rank are the model's: EP splits the
    experts, ETP each expert, and with ETP 1 every TP rank holds whole experts."""
    arch = architecture(llama_config(**SHAPED["qwen2-moe-shared"]))
    for counts in run_distributed(2, _count_per_rank):
        for name, (tp, ep, etp) in RANK_LAYOUTS.items():
            planned_dense = stage_parameters(arch, tp, arch.num_layers, first=True, last=True, pp=1)
            planned_experts = stage_expert_parameters(arch, ep, etp, arch.num_layers)
            assert counts[name] == (planned_dense, planned_experts), name
