"""Reading pickled checkpoint files without running anything in them.

- `load_pickled`: `torch.load(weights_only=True)` allowing, besides tensors, only what Megatron-LM
  pickles next to them: `argparse.Namespace` (its arguments), a few standard-library and numpy types
  (the RNG state), and Megatron's own enums and config classes, which are never imported: they load
  as inert `MegatronObject` stand-ins.
- `read_dcp_metadata`: a torch.distributed.checkpoint `.metadata` file (which DCP's stock reader
  unpickles with plain pickle, running whatever the file names) read by an unpickler that allows
  only DCP's own metadata classes (`safe_reader.SafeFileSystemReader` reads checkpoints with it).

Any failure is a ValueError naming the file (corrupt, truncated, or holding other objects).
"""
import enum
import io
import os
import pickle
import re
from argparse import Namespace
from pathlib import PosixPath
from signal import Signals
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy
import torch

from megatron.core.checkpointing import CheckpointFormatError

if TYPE_CHECKING:  # imported when read_dcp_metadata runs (see there)
    from torch.distributed.checkpoint.metadata import Metadata


class MegatronObject:
    """An inert stand-in for a Megatron class found in a checkpoint (an enum value, a config): it
    keeps what it was built from and runs nothing."""

    qualified_name = "megatron"

    def __init__(self, *args):
        self.args = args

    def __repr__(self) -> str:
        state = dict(vars(self))
        args = state.pop("args", ())
        inner = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in state.items()])
        return f"{self.qualified_name}({inner})"


def _megatron_stand_ins() -> list:
    names = [
        "megatron.core.enums.ModelType",
        "megatron.core.transformer.enums.ModelType",
        "megatron.core.transformer.enums.AttnBackend",
        "megatron.core.transformer.enums.AttnMaskType",
        "megatron.core.transformer.enums.CudaGraphScope",
        "megatron.core.optimizer.optimizer_config.OptimizerConfig",
        "megatron.core.rerun_state_machine.RerunDiagnostic",
        "megatron.core.rerun_state_machine.RerunMode",
        "megatron.core.rerun_state_machine.RerunState",
    ]
    return [(type(name.rsplit(".", 1)[1], (MegatronObject,), {"qualified_name": name}), name) for name in names]


def _numpy_globals() -> list:
    """numpy's RNG state (a uint32 array) as Megatron-LM saves it, under numpy 1 and 2 module names."""
    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(1))[0]
    allowed = [numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed.append((reconstruct, f"{module}._reconstruct"))
    return allowed


def member_by_name(cls, name: str):
    """What `getattr(cls, name)` gives for an enum member pickled by name (early Python 3.11
    releases, 3.11.2 among them, pickle enum members so; 3.11.7 by value), allowed only for an enum
    class or a Megatron stand-in: any other attribute lookup is refused, so a file cannot reach
    methods or modules through it."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    if isinstance(cls, type) and issubclass(cls, MegatronObject) and name.isidentifier():
        return cls(name)
    raise pickle.UnpicklingError(f"refusing getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}): "
                                 "only enum members may be looked up by name")


_SAFE_GLOBALS = [Namespace, SimpleNamespace, PosixPath, Signals, io.BytesIO, bytes, *_numpy_globals(),
                 *_megatron_stand_ins(), (member_by_name, "builtins.getattr"), (member_by_name, "__builtin__.getattr")]


def load_pickled(path: str):
    """torch.load(path, weights_only=True) with Megatron-LM's non-tensor classes allowed (see the
    module docstring); any failure is a ValueError naming the file."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise ValueError(f"{path}: cannot be read as a Megatron checkpoint file (corrupt, truncated, or holding "
                         f"objects other than tensors and Megatron's arguments): {first_line(error)}") from error


_WEIGHTS_ONLY_REASON = re.compile(
    r"Unsupported global: GLOBAL [\w.]+|Trying to load unsupported GLOBAL [\w.]+|WeightsUnpickler error: [^\n]+")


def first_line(error: BaseException) -> str:
    """The reason in one line (for weights-only refusals: the global that was refused)."""
    text = str(error)
    reason = _WEIGHTS_ONLY_REASON.search(text)
    if reason:
        return reason.group(0)
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# What torch.distributed.checkpoint's `.metadata` pickle may reference.
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "layout", "strided", "memory_format", "contiguous_format", "preserve_format",
              "channels_last"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
    "enum": {"Enum"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in ("builtins", "__builtin__") and name == "getattr":  # an enum member pickled by name
            return member_by_name
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_dcp_metadata(directory) -> "Metadata":
    """The `.metadata` of a torch.distributed.checkpoint directory, unpickled with the allow-list
    above; a missing or corrupt file is a CheckpointFormatError naming it."""
    # Imported here: torch.distributed.checkpoint (and the DTensor code it pulls in) takes a third
    # of a training process's start-up, and only runs that load or save a checkpoint need it.
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = os.path.join(os.fspath(directory), ".metadata")
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{path} is missing: {directory} is not a complete checkpoint")
    try:
        with open(path, "rb") as handle:
            metadata = _DCPMetadataUnpickler(handle).load()
    except Exception as error:
        raise CheckpointFormatError(f"{path} is corrupt or not a checkpoint index ({first_line(error)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{path} does not hold checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def check_dcp_files(directory, metadata: "Metadata") -> None:
    """Every data file `.metadata` refers to exists and is long enough (a truncated copy or an
    interrupted transfer is named here, not deep inside the reader)."""
    needed = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(os.fspath(directory), name)
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"{path} is missing (the checkpoint index refers to it)")
        size = os.path.getsize(path)
        if size < length:
            raise CheckpointFormatError(f"{path} is truncated: {size} bytes, the checkpoint index needs {length}")
