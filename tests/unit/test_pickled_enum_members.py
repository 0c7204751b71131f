"""Enum members pickled by name, as early Python 3.11 releases pickle them (`getattr(EnumClass,
'NAME')`; 3.11.2, Debian 12's, among them): checkpoints written under such a Python load, and the
lookup stays limited to enum members, so a file cannot reach anything else through `getattr`."""
import enum
import io
import pickle
from argparse import Namespace

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                 TensorStorageMetadata)

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.checkpointing.safe_pickle import load_pickled, read_dcp_metadata


class _ByName(pickle.Pickler):
    """Pickles every enum member as getattr(its class, its name), as Python 3.11.2 does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _ByNameModule:
    Pickler = _ByName
    Unpickler = pickle.Unpickler
    dump, load, dumps, loads = pickle.dump, pickle.load, pickle.dumps, pickle.loads
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _repickle_by_name(path, obj, protocol: int) -> None:
    buffer = io.BytesIO()
    _ByName(buffer, protocol=protocol).dump(obj)
    assert b"getattr" in buffer.getvalue()
    path.write_bytes(buffer.getvalue())


def _metadata() -> Metadata:
    """A checkpoint index of one tensor, as torch.distributed.checkpoint writes it (its properties
    hold the memory-format enum)."""
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([3]))
    tensor = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([3]), chunks=[chunk])
    return Metadata(state_dict_metadata={"w": tensor})


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_dcp_metadata_with_enum_members_by_name_loads(tmp_path, protocol):
    metadata = _metadata()
    _repickle_by_name(tmp_path / ".metadata", metadata, protocol)
    again = read_dcp_metadata(tmp_path)
    assert again.state_dict_metadata["w"].properties == metadata.state_dict_metadata["w"].properties


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_getattr_reaches_nothing_but_enum_members(tmp_path, protocol):
    # a method of an allowed class, not an enum member
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Lookup(torch.Size, "__init__"), protocol=protocol))
    with pytest.raises(CheckpointFormatError, match="only enum members may be looked up by name"):
        read_dcp_metadata(tmp_path)


class _Lookup:
    """Pickles as getattr(owner, name)."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_megatron_lm_file_with_enum_members_by_name_loads(tmp_path):
    """torch.load(weights_only=True) of a Megatron-LM-style file: the Signals enum (which
    Megatron-LM's arguments hold) pickled by name loads as that member."""
    import signal

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": Namespace(exit_signal=signal.SIGTERM), "w": torch.ones(2)}, path,
               pickle_module=_ByNameModule, pickle_protocol=2)
    assert b"getattr" in path.read_bytes() or _zip_holds(path, b"getattr")
    state = load_pickled(str(path))
    assert state["args"].exit_signal is signal.SIGTERM


def test_megatron_lm_file_getattr_on_other_classes_is_refused(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"x": _Lookup(Namespace, "__init__")}, path, pickle_protocol=2)
    with pytest.raises(ValueError, match="cannot be read as a Megatron checkpoint file"):
        load_pickled(str(path))


def _zip_holds(path, needle: bytes) -> bool:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return any(needle in archive.read(name) for name in archive.namelist() if name.endswith("data.pkl"))
