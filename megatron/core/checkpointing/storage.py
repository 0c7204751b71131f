"""Reading and writing a `ShardedState` with `torch.distributed.checkpoint` (DCP).

On disk a checkpoint is a DCP directory: `.metadata` (the global shape of every logical tensor and
where each saved box lies) and `__<rank>_<n>.distcp` files with the boxes. Every rank writes the
boxes it holds; boxes that several ranks hold identically (replicas) are written once. On load every
rank asks for the boxes it needs under its own layout, and DCP reads the overlapping parts of the
saved boxes, whatever layout wrote them.

Two things differ from DCP's default planners:
- boxes of a logical tensor (`sharded.Boxes`) are this module's own, not DTensors: the pieces a
  distributed-optimizer shard covers are not a regular grid;
- nothing is unpickled beyond plain data: `.metadata` is read with an unpickler that admits only
  DCP's metadata classes, tensors with `torch.load(weights_only=True)` (DCP's reader), and
  non-tensor entries are refused (the state holds tensors only).

A requested box may reach past the saved tensor along a dimension (a vocabulary padded to a larger
multiple than the saving run's): the part that exists is read and the rest is zero-filled.
"""
import collections
import contextlib
import io
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_write_item_for_tensor,
    create_read_items_for_chunk_list,
)

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.checkpointing.safe_pickle import check_dcp_files, read_dcp_metadata
from megatron.core.checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.checkpointing.sharded import Boxes, ShardedState


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------
def _flat_dict(state: ShardedState) -> dict:
    overlap = state.sharded.keys() & state.whole.keys()
    if overlap:
        raise ValueError(f"keys both sharded and whole: {sorted(overlap)[:3]}")
    return {**state.sharded, **state.whole}


class _SavePlanner(DefaultSavePlanner):
    """Write items for `Boxes` (one per box, keyed by its offsets) and whole tensors."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, Boxes):
                items.append(_create_write_item_for_tensor(key, value))
                continue
            properties = dcp_metadata.TensorProperties(dtype=value.dtype)
            for index, (offsets, tensor) in enumerate(value.pieces):
                chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
                items.append(WriteItem(
                    index=dcp_metadata.MetadataIndex(key, offsets, index), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(value.size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        return _lookup(self.state_dict, index)


def _lookup(state_dict: dict, index) -> torch.Tensor:
    value = state_dict[index.fqn]
    if not isinstance(value, Boxes):
        return value
    offsets = tuple(index.offset)
    if index.index is not None and index.index < len(value.pieces) and value.pieces[index.index][0] == offsets:
        return value.pieces[index.index][1]
    for piece_offsets, tensor in value.pieces:
        if piece_offsets == offsets:
            return tensor
    raise KeyError(f"{index.fqn}: no box at offsets {offsets}")


def save_state(state: ShardedState, directory: str, *, process_group=None, thread_count: int = 1) -> None:
    """Writes every rank's part of `state` into `directory` (collective over `process_group`, or
    the default group; a single process needs no torch.distributed)."""
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True)
    with _quiet():
        dcp.save(_flat_dict(state), storage_writer=writer, planner=_SavePlanner(), process_group=process_group,
                 no_dist=not _distributed())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet():
    """DCP warns that a single process is 'assuming the intent' of a local save/load, and about
    overwriting a directory that we create fresh ourselves: both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint in.*")
        yield


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
read_metadata = read_dcp_metadata


def saved_shapes(directory: str) -> dict:
    """{key: global shape} of every tensor in a checkpoint directory."""
    metadata = read_metadata(directory)
    return {key: tuple(value.size) for key, value in metadata.state_dict_metadata.items()
            if isinstance(value, dcp_metadata.TensorStorageMetadata)}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _clip(offsets: tuple, sizes: tuple, saved: tuple) -> Optional[tuple]:
    """The part of box (offsets, sizes) inside a saved tensor of shape `saved`, or None."""
    clipped = tuple(min(o + s, limit) - o for o, s, limit in zip(offsets, sizes, saved))
    return clipped if all(c > 0 for c in clipped) else None


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's own set-up rewrites values it does not know (our Boxes) to None: keep them.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        saved = self.metadata.state_dict_metadata
        for key, value in self.state_dict.items():
            entry = saved.get(key)
            if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
                raise CheckpointFormatError(f"the checkpoint has no tensor {key!r}")
            if not isinstance(value, Boxes):
                if tuple(entry.size) != tuple(value.shape):
                    raise CheckpointFormatError(f"{key}: the checkpoint holds shape {tuple(entry.size)}, "
                                                f"this run needs {tuple(value.shape)}")
                requests += create_read_items_for_chunk_list(
                    key, entry, [dcp_metadata.ChunkStorageMetadata(torch.Size([0] * value.dim()), value.shape)])
                continue
            _check_shape(key, tuple(entry.size), value.size)
            chunks = []
            for offsets, tensor in value.pieces:
                sizes = _clip(offsets, tuple(tensor.shape), tuple(entry.size))
                if sizes != tuple(tensor.shape):
                    tensor.zero_()  # rows past the saved tensor (vocabulary padding)
                if sizes is not None:
                    chunks.append(dcp_metadata.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            requests += create_read_items_for_chunk_list(key, entry, chunks)
        return LoadPlan(requests)

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointFormatError(f"refusing to unpickle non-tensor entry {read_item.dest_index.fqn!r}")


def _check_shape(key: str, saved: tuple, wanted: tuple) -> None:
    """Shapes may differ only along dim 0 of vocabulary tensors (padding); anything else means
    the checkpoint is of another model."""
    vocab = "word_embeddings" in key or key.endswith("output_layer.weight")
    if len(saved) != len(wanted) or (saved[1:] != wanted[1:]) or (saved[0] != wanted[0] and not vocab):
        raise CheckpointFormatError(f"{key}: the checkpoint holds shape {saved}, this model needs {wanted}")


def load_state(state: ShardedState, directory: str, *, process_group=None) -> None:
    """Fills every tensor of `state` in place from `directory` (collective like `save_state`)."""
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"checkpoint directory {directory} does not exist")
    check_dcp_files(directory, read_metadata(directory))
    try:
        with _quiet():
            dcp.load(_flat_dict(state), storage_reader=SafeFileSystemReader(directory), planner=_LoadPlanner(),
                     process_group=process_group, no_dist=not _distributed())
    except dcp.CheckpointException as error:
        raise CheckpointFormatError(_describe_failure(directory, error)) from None


def _describe_failure(directory: str, error) -> str:
    """One line from DCP's per-rank report: a corrupt index, a truncated or missing shard file."""
    for rank, (cause, _trace) in sorted(error.failures.items()):
        if isinstance(cause, CheckpointFormatError):
            return str(cause)
        text = str(cause)
        if isinstance(cause, AssertionError) and "metadata read failed" in text:
            return text.split("metadata read failed: ", 1)[1].split(";", 1)[0]
        return (f"reading {directory} failed on rank {rank}: {type(cause).__name__}: {text.splitlines()[-1] if text else ''}"
                " (a truncated, missing or corrupt file?)")
    return f"reading {directory} failed: {error}"


def read_full_tensors(directory: str, keys: Optional[list] = None) -> dict:
    """{key: full tensor} of the listed keys (default: every tensor), in one process (for tools)."""
    metadata = read_metadata(directory)
    wanted = collections.OrderedDict()
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, dcp_metadata.TensorStorageMetadata) and (keys is None or key in keys):
            wanted[key] = torch.empty(tuple(value.size), dtype=value.properties.dtype)
    missing = sorted(set(keys or ()) - wanted.keys())
    if missing:
        raise CheckpointFormatError(f"{directory} has no tensors {missing[:5]}")
    state = ShardedState()
    for key, tensor in wanted.items():
        state.add_whole(key, tensor)
    load_state(state, directory)
    return dict(wanted)

