"""checksums: recorded per file, any changed byte found and named; tools/checkpoint/verify.py."""
import os
import subprocess
import sys
import zlib

import pytest
import torch

from megatron.core.checkpointing import CheckpointFormatError, checksums
from megatron.core.checkpointing.sharded import ShardedState
from megatron.core.checkpointing.storage import save_state

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "iter_0000004"
    state = ShardedState()
    state.add_whole("weight", torch.arange(40000, dtype=torch.float32))
    save_state(state, str(directory))
    (tmp_path / "iter_0000002").mkdir()
    return directory


def test_recorded_checksums_are_zlibs_crc32_of_every_file(checkpoint):
    recorded = checksums.of_directory(str(checkpoint))
    assert sorted(recorded["files"]) == [".metadata", "__0_0.distcp"]
    for name, entry in recorded["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"crc32": f"{zlib.crc32(data):08x}", "bytes": len(data)}
    assert checksums.gather(str(checkpoint), None) == recorded  # one process: its own files and the index
    assert checksums.first_mismatch(str(checkpoint), recorded) is None


@pytest.mark.parametrize("offset", [0, 70000, -1])
def test_one_changed_byte_is_named(checkpoint, offset):
    recorded = checksums.of_directory(str(checkpoint))
    path = checkpoint / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    description, name = checksums.first_mismatch(str(checkpoint), recorded)
    assert name == "__0_0.distcp" and description.startswith(f"{path} is corrupt: its crc32 is ")
    error = checksums.corruption_error(str(checkpoint), 4, description)
    assert isinstance(error, CheckpointFormatError)
    assert str(error).endswith(f"; load the previous checkpoint with --ckpt-step 2 ({checkpoint.parent / 'iter_0000002'}),"
                               " or restore the file from a copy")


def test_shares_of_the_ranks_cover_every_file_once(checkpoint):
    recorded = {"algorithm": "crc32", "files": {f"f{i}": {"crc32": "0", "bytes": 0} for i in range(5)}}
    found = [checksums.first_mismatch(str(checkpoint), recorded, rank, 3)[1] for rank in range(3)]
    assert found == ["f0", "f1", "f2"]  # each rank's first file: f0, f3 | f1, f4 | f2


def test_verify_tool_on_a_directory_without_checksums(checkpoint):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "verify.py"), str(checkpoint)],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 1 and result.stderr.startswith(f"error: {checkpoint / 'common.json'} is missing")
