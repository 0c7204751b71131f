"""When communication happens, against the computation (DP=2, gloo), with the distributed optimizer,
--overlap-grad-reduce and --overlap-param-gather, on a model in two chunks (as a pipeline rank with
two virtual stages holds it: layers 0-1 with the embedding, layers 2-3 with the untied output layer).

One step is traced in one ordered list of events: the communication layer's record of every
collective (issued, completed), every first use of a parameter by an operator in forward (seen by a
TorchFunctionMode), and every decoder layer's backward. Checked:
- parameter gathers go out one bucket at a time in forward order, across the two chunks: bucket
  i + 1's gather starts before the layers of bucket i run, and not before the layers of bucket i - 1
  ran (so they are not all issued at once), and no operator uses a parameter before its bucket's
  gather has completed;
- the output layer's gradient is in the first bucket, whose reduction starts before the backward of
  the first decoder layer to run it, overlapping the rest of backward.
"""
import torch
from torch.overrides import TorchFunctionMode

from megatron.core.distributed import comm
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel
from tests.distributed.test_data_parallel import SEED, SEQ, global_batches, model_config, optimizer_config
from tests.distributed.test_data_parallel import scenario as spawned_scenario


class _ParameterUses(TorchFunctionMode):
    """Appends ("use", chain position of its bucket) at each parameter's first use by an operator,
    and notes a use before the bucket's gather completed."""

    def __init__(self, events: list, bucket_of: dict, position: dict):
        super().__init__()
        self.events, self.bucket_of, self.position = events, bucket_of, position
        self.used, self.early = set(), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for arg in list(args) + list((kwargs or {}).values()):
            if isinstance(arg, torch.nn.Parameter) and arg in self.bucket_of and arg not in self.used:
                self.used.add(arg)
                bucket = self.bucket_of[arg]
                self.events.append(("use", self.position[bucket]))
                if bucket.param_gather != "done":
                    self.early.append(self.position[bucket])
        return func(*args, **(kwargs or {}))


def _step(chunks, optimizer, groups, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    hidden = chunks[0](inputs, positions)
    chunks[1].set_input_tensor(hidden)
    chunks[1](None, positions, labels=labels).mean().backward()
    finalize_model_grads(chunks, groups)
    return optimizer.step()


def _ordering_trace():
    groups = initialize_model_parallel(1, 1)
    config = model_config(num_layers=4, untie_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               overlap_param_gather=True, bucket_size=1500)
    chunks = []
    for layers, first in (([0, 1], True), ([2, 3], False)):
        model = GPTModel(config, groups, pre_process=first, post_process=not first, layer_numbers=layers)
        model.initialize_parameters(SEED)
        chunks.append(DistributedDataParallel(model, groups, ddp_config=ddp_config))
    optimizer = get_megatron_optimizer(optimizer_config(), chunks, groups)
    chain = optimizer.gather_chain.buckets
    position = {bucket: index for index, bucket in enumerate(chain)}
    bucket_of = {param: bucket for bucket in chain for param in bucket.params}
    batches = global_batches(2)[:, groups.dp_rank]  # one micro-batch per rank and step
    _step(chunks, optimizer, groups, batches[0])  # leaves every gather owed to the next forward

    events = []
    for layer in chunks[1].module.decoder.layers:
        layer.register_full_backward_pre_hook(lambda *_: events.append(("backward",)))
    output_layer_bucket = chunks[1]._param_to_bucket[chunks[1].module.output_layer]
    with comm.record_collectives(events) as collectives, _ParameterUses(events, bucket_of, position) as uses:
        _step(chunks, optimizer, groups, batches[1])
    labelled = []
    for event in collectives:
        if event[0] == "use" or event[0] == "backward":
            labelled.append(event)
        elif event[1] == "all_gather_into_tensor":
            index = next(i for i, b in enumerate(chain) if b.param_data.data_ptr() == event[2].data_ptr())
            labelled.append((f"gather {event[0]}", index))
        elif event[2].data_ptr() == output_layer_bucket.grad_data.data_ptr() and event[1].startswith("reduce"):
            labelled.append((f"output layer reduce {event[0]}",))
    return dict(events=labelled, early=uses.early, num_buckets=len(chain),
                output_layer_bucket=output_layer_bucket.index,
                chunk0_buckets=len(chunks[0].gather_order))


def _first(events: list, wanted: tuple) -> int:
    return next(index for index, event in enumerate(events) if event == wanted)


def test_gathers_run_one_bucket_ahead_and_the_output_layer_reduces_first():
    for result in spawned_scenario(2, "communication order"):
        events, count = result["events"], result["num_buckets"]
        assert count >= 6 and 0 < result["chunk0_buckets"] < count  # several buckets in each chunk
        assert result["early"] == []  # no parameter used before its gather completed
        for index in range(1, count):
            start = _first(events, ("gather start", index))
            assert start < _first(events, ("use", index - 1)), (index, events)  # ahead of the layers before it
            if index >= 2:
                assert start > _first(events, ("use", index - 2)), (index, events)  # one bucket ahead, no more
        assert result["output_layer_bucket"] == 0
        reduce_start = _first(events, ("output layer reduce start",))
        assert reduce_start < _first(events, ("backward",)), events
