"""Bytes a model saves for backward, counted with autograd's saved-tensor hooks: each storage once
(a tensor and its views, or a tensor saved by two operations, are one allocation), parameters
excluded. The planner's activation term is checked against it."""
import torch

from megatron.core.context_parallel import slice_batch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import build_tracker


class SavedStorages:
    """Saved-tensor hooks that record each distinct storage saved for backward."""

    def __init__(self, parameters):
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.parameters and storage.nbytes():
            self.storages[key] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def saved_bytes(config, execution, groups, *, seq: int, batch: int) -> int:
    """Bytes that the decoder layers of `config` (no embedding, no output layer) save for backward
    on this rank in one training forward of a micro-batch [batch, seq]: this rank's share of the
    sequence (1/CP, and 1/TP of the layer input with sequence parallelism)."""
    tracker = build_tracker(1234, groups.tp_rank, groups.pp_rank, torch.device("cpu"))
    model = GPTModel(config, groups, execution=execution, rng_tracker=tracker, pre_process=False,
                     post_process=False, device=torch.device("cpu"))
    model.initialize_parameters(1234)
    model.train()
    local_seq = seq // groups.cp_size
    rows = local_seq // groups.tp_size if execution.sequence_parallel and groups.tp_size > 1 else local_seq
    positions = slice_batch(dict(position_ids=torch.arange(seq)[None].expand(batch, seq)), groups.cp_size,
                            groups.cp_rank)["position_ids"]
    x = torch.randn(rows, batch, config.hidden_size, dtype=execution.params_dtype, requires_grad=True)
    counter = SavedStorages(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = model(None, positions, hidden_states=x)
    out.float().sum().backward()  # the saved tensors were usable
    return counter.total
