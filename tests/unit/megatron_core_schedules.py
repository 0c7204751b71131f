"""Run by test_schedule_order.py in a subprocess with only Megatron-Core on PYTHONPATH.

    python megatron_core_schedules.py SPEC.json OUTPUT.json

Runs Megatron-Core's own pipeline schedules (`forward_backward_pipelining_without_interleaving` and
`..._with_interleaving`) for one rank at a time, on CPU, and records the order of their forward and
backward steps: its `forward_step` and `backward_step` are replaced by recorders, and its
point-to-point transport (`_p2p_ops`) by one that hands back empty tensors, so everything between
them (warm-up counts, schedule tables, which chunk runs when, overlapped and blocking p2p) is
Megatron-Core's code as shipped. Nothing of ours is imported.

SPEC: a list of {"pp", "rank", "virtual" (1: non-interleaved), "microbatches", "group" (micro-batch
group size or null), "overlap" (overlap_p2p_comm), "flush" (overlap_p2p_comm_warmup_flush)}.
OUTPUT: for each, the steps as ["F" or "B", chunk, micro-batch].
"""
import contextlib
import json
import sys
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402

SHAPE = (4, 1, 8)  # seq, micro-batch, hidden: what the transport allocates for a receive


class Group:
    """The size and rank Megatron-Core reads from a process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class Done:
    def wait(self):
        pass


def transport(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, **_):
    """Megatron-Core's `_p2p_ops` without the peers: every posted operation completes at once."""
    named = (("send_next", tensor_send_next), ("recv_prev", tensor_recv_prev), ("send_prev", tensor_send_prev),
             ("recv_next", tensor_recv_next))
    return {name: Done() for name, tensor in named if tensor is not None}


def batched_transport(**tensors):
    """`_batched_p2p_ops` likewise (a list of requests)."""
    return list(transport(**tensors).values())


class Chunk(torch.nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.index = index


def trace(spec: dict) -> list:
    pp, rank, virtual, n = spec["pp"], spec["rank"], spec["virtual"], spec["microbatches"]
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                 virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
                                 overlap_p2p_comm=spec["overlap"], batch_p2p_comm=not spec["overlap"],
                                 batch_p2p_sync=False,
                                 overlap_p2p_comm_warmup_flush=spec["flush"],
                                 microbatch_group_size_per_vp_stage=spec["group"] or pp)
    # Fields of TransformerConfig (a subclass) that the schedules read.
    config.hidden_size, config.fine_grained_activation_offloading = SHAPE[2], False
    group = Group(pp, rank)
    communicator = p2p_communication.P2PCommunicator(group, config)
    processes = type("Groups", (), dict(tp=Group(1, 0), cp=Group(1, 0), embd=None, pos_embd=None, pp=group,
                                        dp_cp=Group(1, 0)))()
    steps, outputs = [], {}

    def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args,
                     current_microbatch=None, vp_stage=None, **kwargs):
        chunk = vp_stage or 0
        steps.append(("F", chunk, current_microbatch))
        output = torch.zeros(1, requires_grad=True)
        outputs[id(output)] = (chunk, current_microbatch)
        return output, torch.zeros((), dtype=torch.int)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        steps.append(("B",) + outputs.pop(id(output_tensor)))
        return None if input_tensor is None else torch.zeros(SHAPE)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    chunks = [Chunk(config, index) for index in range(virtual)]
    common = dict(forward_step_func=None, num_microbatches=n, seq_length=SHAPE[0], micro_batch_size=SHAPE[1],
                  p2p_communicator=communicator, pg_collection=processes)
    if virtual > 1:
        schedules.forward_backward_pipelining_with_interleaving(data_iterator=[None] * virtual, model=chunks, **common)
    else:
        schedules.forward_backward_pipelining_without_interleaving(data_iterator=None, model=chunks[0], **common)
    return steps


def main():
    specs = json.load(open(sys.argv[1]))
    # CPU stand-ins for the CUDA calls on the schedules' path (a device for allocations, the
    # global rank of a group member).
    torch.cuda.current_device = lambda: "cpu"
    original_zeros = torch.zeros
    torch.zeros = lambda *args, device=None, **kwargs: original_zeros(*args, **kwargs)
    p2p_communication.dist.get_global_rank = lambda group, rank: rank
    p2p_communication._p2p_ops = transport
    p2p_communication._batched_p2p_ops = batched_transport
    schedules.nvtx_range_push = schedules.nvtx_range_pop = lambda *args, **kwargs: None
    with contextlib.redirect_stdout(sys.stderr):
        traces = [trace(spec) for spec in specs]
    json.dump(traces, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
