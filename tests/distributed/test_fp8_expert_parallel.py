"""FP8 experts under expert parallelism equal one process (gloo).

Two ranks, each with its own tokens, run a MoE layer at EP2 (alltoall and allgather dispatch) with
the experts' GEMMs in FP8 (hybrid, delayed scaling: a first pass that scales from the tensors
themselves, a roll, a second pass from the amax history). The reference is one process (EP1) with
both ranks' tokens in one batch. Each expert has its own scaling state and sees the same rows
in both runs (only in another order), so every amax, scale and FP8 value is the same: the outputs
and all gradients agree at rtol 1e-5, atol 1e-5 x the tensor's largest element (fp32 weights; what
remains is the order of the fp32 sums in the weight-gradient GEMMs and of the combine: measured
about 1e-7 of the gradients' norm). A scaling state shared by the experts, or one that
saw only a rank's own tokens, would differ by FP8's rounding (percents), far outside it.

With expert-tensor parallelism each expert's weights are split and each shard scales its own
tensors, so the reference for EP2 x ETP2 (TP 2 with SP, 4 ranks) is EP1 x ETP2 (TP 2, 2 ranks, both
data-parallel halves of the batch in one): each shard sees the same rows at either EP size.
The ranks run as threads of this process over PyTorch's threaded process group (tests/threaded_ranks.py):
the same collectives on one layer, without spawning and importing torch in 16 processes.
"""
import functools

import pytest
import torch

from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.tensor_parallel.layers import initialize_param
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.fp8 import DelayedScaling, FP8Linear, FP8Options
from megatron.core.transformer.moe.experts import initialize_expert_param
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.threaded_ranks import run_ranks

EXPERTS, HIDDEN, SEQ, BATCH, RTOL = 4, 32, 12, 2, 1e-5


def fp8_moe_layer(groups, dispatcher, execution=ExecutionConfig()):
    """A 4-expert MoE layer (hybrid FP8, delayed scaling, history 2) with its weights initialized from
    the seed as every rank's copy would be; returns the layer and its scaling state."""
    cfg = derive(TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=64,
                                   ffn_hidden_size=48, num_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=2,
                                   swiglu=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                                   moe_router_load_balancing_type="none", moe_token_dispatcher_type=dispatcher))
    layer = MoELayer(cfg, execution=execution, layer_number=0, groups=groups, device=torch.device("cpu"))
    for name, param in layer.named_parameters():
        init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
        init(param, f"decoder.layers.0.mlp.{name}", 5, 0.2, cfg.num_layers)
    options = FP8Options("hybrid", "delayed", amax_history_len=2, amax_compute_algo="max")
    scaling = DelayedScaling(options)
    linears = layer.experts.attach_fp8(lambda: FP8Linear(options, scaling))
    scaling.allocate("cpu")
    for linear in linears:
        linear.bind()
    return layer, scaling


def _data():
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(SEQ, 2 * BATCH, HIDDEN, generator=generator)          # [s, b of both ranks, h]
    return x, torch.randn(SEQ, 2 * BATCH, HIDDEN, generator=generator)


def _run(groups, dispatcher, batch: slice, sequence: slice = slice(None)) -> list:
    """Two passes (a roll between): per pass the output, input gradient and the stacked experts'
    weight gradients of this rank's experts (global experts expert_offset ..., expert-tensor shard
    etp_rank)."""
    layer, scaling = fp8_moe_layer(groups, dispatcher)
    x, grad = _data()
    results = []
    for _ in range(2):
        scaling.roll()
        layer.zero_grad()
        inputs = x[sequence, batch].clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad[sequence, batch])
        results.append({"output": out.detach(), "input_grad": inputs.grad,
                        "fc1": layer.experts.fc1_weight.grad, "fc2": layer.experts.fc2_weight.grad,
                        "offset": layer.experts.expert_offset, "etp_rank": groups.etp_rank,
                        "tp_rank": groups.tp_rank, "dp_rank": groups.dp_rank})
    return results


def _ep2(rank, world_size, dispatcher):
    groups = initialize_model_parallel(1, 1, 1, expert_model_parallel_size=2)
    return _run(groups, dispatcher, slice(rank * BATCH, (rank + 1) * BATCH))


@functools.lru_cache(maxsize=None)
def _results(dispatcher):
    return run_ranks(2, _ep2, dispatcher)


def _etp2(rank, world_size, dispatcher, ep):
    """TP 2 with sequence parallelism and ETP 2; with EP 2 on 4 ranks the two data-parallel ranks each
    take half the batch. Each TP rank routes its own half of the sequence."""
    groups = initialize_model_parallel(2, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=2)
    half = SEQ // 2
    batch = slice(groups.dp_rank * BATCH, (groups.dp_rank + 1) * BATCH) if groups.dp_size == 2 else slice(None)
    return _run(groups, dispatcher, batch, slice(groups.tp_rank * half, (groups.tp_rank + 1) * half))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fp8_experts_at_ep2_equal_one_process(dispatcher):
    want = _run(single_process(), dispatcher, slice(None))
    for rank, passes in enumerate(_results(dispatcher)):
        batch = slice(rank * BATCH, (rank + 1) * BATCH)
        for got, reference in zip(passes, want):
            experts = slice(got["offset"], got["offset"] + EXPERTS // 2)
            for name, expected in (("output", reference["output"][:, batch]),
                                   ("input_grad", reference["input_grad"][:, batch]),
                                   ("fc1", reference["fc1"][experts]), ("fc2", reference["fc2"][experts])):
                atol = RTOL * expected.abs().max().item()
                torch.testing.assert_close(got[name], expected, rtol=RTOL, atol=atol, msg=f"{name}, rank {rank}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fp8_experts_at_ep2_etp2_equal_ep1_etp2(dispatcher):
    """Expert-tensor parallelism splits each expert's weights, so each shard has its own weight scale;
    the rows an expert's shard sees, and so every other amax, are the same at any EP. EP 2 x ETP 2
    (TP 2, SP, 4 ranks) equals EP 1 x ETP 2 (TP 2, 2 ranks, the whole batch) at the same tolerance."""
    want = {passes[0]["etp_rank"]: passes for passes in run_ranks(2, _etp2, dispatcher, 1)}
    half = SEQ // 2
    for rank, passes in enumerate(run_ranks(4, _etp2, dispatcher, 2)):
        for got, reference in zip(passes, want[passes[0]["etp_rank"]]):
            assert got["tp_rank"] == reference["tp_rank"]  # the same sequence half and expert shard
            batch = slice(got["dp_rank"] * BATCH, (got["dp_rank"] + 1) * BATCH)
            experts = slice(got["offset"], got["offset"] + EXPERTS // 2)
            assert got["output"].shape == (half, BATCH, HIDDEN)
            for name, expected in (("output", reference["output"][:, batch]),
                                   ("input_grad", reference["input_grad"][:, batch]),
                                   ("fc1", reference["fc1"][experts]), ("fc2", reference["fc2"][experts])):
                atol = RTOL * expected.abs().max().item()
                torch.testing.assert_close(got[name], expected, rtol=RTOL, atol=atol, msg=f"{name}, rank {rank}")
