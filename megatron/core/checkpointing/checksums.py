"""Checksums of a checkpoint's files: recorded when saved, verified when loaded.

Each rank checksums the data files it wrote (`__<rank>_<n>.distcp`) right after writing them,
while they are still in the page cache, and rank 0 the index (`.metadata`); the saving job records
them all in the checkpoint's `common.json` under "checksums":

    {"algorithm": "crc32", "files": {"__0_0.distcp": {"crc32": "1c291ca3", "bytes": 52731}, ...}}

CRC-32 (zlib's, which releases the GIL, so an async save's thread does not hold up training)
detects every burst error up to 32 bits and any other corruption with probability 1 - 2^-32; it is
not a defence against deliberate tampering, which needs a signature. Verification on load is
split between the ranks, each reading about 1/world of the files. `common.json` itself is checked
by parsing it (JSON, with the format's name and version).
"""
import json
import os
import re
import zlib
from typing import Optional

import torch

from megatron.core.checkpointing import CheckpointFormatError
from megatron.core.distributed import comm

ALGORITHM = "crc32"
METADATA_FILE = ".metadata"
_ERROR = "!error"
_CHUNK_BYTES = 8 << 20
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def file_checksum(path: str) -> str:
    crc = 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK_BYTES)
            if not chunk:
                return f"{crc:08x}"
            crc = zlib.crc32(chunk, crc)


def _entry(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    return {ALGORITHM: file_checksum(path), "bytes": os.path.getsize(path)}


def files_of_rank(directory: str, rank: int) -> list:
    """The data files torch.distributed.checkpoint wrote for `rank` (`__<rank>_<n>.distcp`)."""
    pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
    return sorted(name for name in os.listdir(directory) if pattern.match(name))


def of_directory(directory: str) -> dict:
    """The checksums of every data file and the index of a checkpoint directory (one process)."""
    names = sorted(name for name in os.listdir(directory) if name.endswith(".distcp") or name == METADATA_FILE)
    return {"algorithm": ALGORITHM, "files": {name: _entry(directory, name) for name in names}}


def gather(directory: str, group) -> dict:
    """Collective over `group` (CPU tensors: a gloo group, or None for one process): every rank
    checksums the files it wrote; returns all of them, with rank 0's `.metadata`, on every rank.
    A rank that cannot read its files still joins the collectives; every rank then raises OSError."""
    rank = comm.rank(group)
    try:
        own = {name: _entry(directory, name) for name in files_of_rank(directory, rank)}
        if rank == 0:
            own[METADATA_FILE] = _entry(directory, METADATA_FILE)
    except OSError as error:
        own = {_ERROR: f"rank {rank}: {error}"}
    files = {}
    for part in _all_gather_json(own, group):
        if _ERROR in part:
            raise OSError(f"checksumming the checkpoint files failed on {part[_ERROR]}")
        files.update(part)
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


def _all_gather_json(value: dict, group) -> list:
    """Every rank's `value` (a JSON-able dict), gathered as zero-padded UTF-8 bytes."""
    data = json.dumps(value).encode()
    length = torch.tensor([len(data)], dtype=torch.int64)
    comm.all_reduce_max(length, group)
    padded = torch.zeros(int(length.item()), dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = comm.size(group)
    gathered = torch.empty(world * padded.numel(), dtype=torch.uint8)
    comm.all_gather_into_tensor(gathered, padded, group)
    parts = gathered.view(world, -1)
    return [json.loads(bytes(row.tolist()).rstrip(b"\0").decode()) for row in parts]


def first_mismatch(directory: str, recorded: dict, rank: int = 0, world: int = 1) -> Optional[tuple]:
    """This rank's share (every world-th file) checked against `recorded`: (description, file name)
    of the first file that differs, or None."""
    files = recorded.get("files", {})
    for index, (name, expected) in enumerate(sorted(files.items())):
        if index % world != rank:
            continue
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing", name
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{path} is {size} bytes, {expected['bytes']} when saved", name
        actual = file_checksum(path)
        if actual != expected[ALGORITHM]:
            return f"{path} is corrupt: its {ALGORITHM} is {actual}, {expected[ALGORITHM]} when saved", name
    return None


def previous_checkpoint(directory: str) -> Optional[str]:
    """The newest checkpoint directory beside `directory` with a smaller iteration, if any."""
    root, name = os.path.split(os.path.normpath(directory))
    match = _ITERATION_DIR.match(name)
    if match is None or not os.path.isdir(root):
        return None
    older = sorted((int(m.group(1)), entry) for entry in os.listdir(root)
                   for m in [_ITERATION_DIR.match(entry)] if m and int(m.group(1)) < int(match.group(1)))
    return os.path.join(root, older[-1][1]) if older else None


def corruption_error(directory: str, iteration, mismatch: str) -> CheckpointFormatError:
    previous = previous_checkpoint(directory)
    if previous is not None:
        step = int(_ITERATION_DIR.match(os.path.basename(previous)).group(1))
        hint = f"load the previous checkpoint with --ckpt-step {step} ({previous}), or restore the file from a copy"
    else:
        hint = "restore the file from a copy; there is no earlier checkpoint beside it"
    return CheckpointFormatError(f"the checkpoint of iteration {iteration} is damaged: {mismatch}; {hint}")
