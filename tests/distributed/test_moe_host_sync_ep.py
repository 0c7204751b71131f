"""Host reads of the MoE layer at expert-parallel size 2 (gloo, 2 processes), over two micro-batches'
forward and backward: none with the all-gather dispatcher, one per layer and micro-batch (all its
split sizes at once) with the all-to-all dispatcher. Counted as in
tests/unit/test_moe_host_sync.py."""
import functools

import pytest
import torch

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.distributed.harness import run_distributed
from tests.unit.test_moe_host_sync import HIDDEN, HostReads, config

MICRO_BATCHES = 2
DISPATCHERS = ("allgather", "alltoall")


def _count_reads(dispatcher: str) -> list:
    groups = initialize_model_parallel(1, 1, 1, expert_model_parallel_size=2)
    cfg = config(moe_ffn_hidden_size=16, moe_token_dispatcher_type=dispatcher)
    layer = MoELayer(cfg, execution=ExecutionConfig(params_dtype=torch.float32), layer_number=0, groups=groups,
                     device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(groups.ep_rank)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    mode, tolist = HostReads(), torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: mode.reads.append("tolist") or tolist(self)
    try:
        with mode:
            for _ in range(MICRO_BATCHES):
                layer(torch.randn(6, 2, HIDDEN, generator=generator, requires_grad=True)).square().sum().backward()
    finally:
        torch.Tensor.tolist = tolist
    return mode.reads


def _run(rank, world_size):
    return {dispatcher: _count_reads(dispatcher) for dispatcher in DISPATCHERS}


@functools.lru_cache(maxsize=None)
def _results():
    return run_distributed(2, _run, timeout=300)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_host_reads_at_ep2(dispatcher):
    expected = [] if dispatcher == "allgather" else ["tolist"] * MICRO_BATCHES  # one read per micro-batch
    for reads in (result[dispatcher] for result in _results()):
        assert reads == expected
