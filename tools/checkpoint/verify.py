"""Check a checkpoint offline: every file present, of the size and checksum recorded when it was saved.

    python tools/checkpoint/verify.py ckpt/run1                 # the latest checkpoint of a save directory
    python tools/checkpoint/verify.py ckpt/run1 --all           # every checkpoint in it
    python tools/checkpoint/verify.py ckpt/run1/iter_0000200    # one checkpoint

Reads every data file once (CRC-32, as recorded in `common.json`). Prints one line per checkpoint
and exits 0 when all are intact, 1 naming the first damaged file of each one that is not.
Checkpoints saved before checksums were recorded are checked for missing and truncated files only.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

from megatron.core.checkpointing import CheckpointFormatError, checksums  # noqa: E402
from megatron.core.checkpointing.safe_pickle import check_dcp_files, read_dcp_metadata  # noqa: E402
from megatron.core.checkpointing.directory import (  # noqa: E402
    TRACKER_FILE,
    checkpoint_dir,
    read_common,
    tracked_iteration,
)

_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoints(path: str, every: bool) -> list:
    """The checkpoint directories `path` names: itself, the latest of a save directory, or all."""
    if _ITERATION_DIR.match(os.path.basename(os.path.normpath(path))):
        return [path]
    if every:
        found = sorted(name for name in os.listdir(path) if _ITERATION_DIR.match(name))
        if not found:
            raise CheckpointFormatError(f"{path} holds no iter_NNNNNNN checkpoint directory")
        return [os.path.join(path, name) for name in found]
    return [latest(path)]


def latest(path: str) -> str:
    """The checkpoint directory the tracker file of save directory `path` names (the messages are
    those of a run's --load, which reads the same tracker)."""
    iteration = tracked_iteration(path) if os.path.isdir(path) else None
    if iteration is None:
        raise CheckpointFormatError(f"--load {path}: no checkpoint found (no {TRACKER_FILE}); training starts "
                                    "from randomly initialized weights")
    directory = checkpoint_dir(path, iteration)
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"{os.path.join(path, TRACKER_FILE)} names iteration {iteration}, but "
                                    f"{directory} does not exist; restore it, or point the tracker at an existing "
                                    "iteration")
    return directory


def verify(directory: str) -> str:
    """A line saying what was checked; raises CheckpointFormatError naming the damage."""
    start = time.perf_counter()
    common = read_common(directory)
    check_dcp_files(directory, read_dcp_metadata(directory))
    recorded = common.get("checksums")
    if recorded is None:
        return f"ok: {directory} (saved without checksums: only file presence and sizes checked)"
    mismatch = checksums.first_mismatch(directory, recorded)
    if mismatch is not None:
        raise checksums.corruption_error(directory, common["iteration"], mismatch[0])
    size = sum(entry["bytes"] for entry in recorded["files"].values())
    return (f"ok: {directory} ({len(recorded['files'])} files, {size / 1e6:.1f} MB, checksums match; "
            f"{time.perf_counter() - start:.2f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a save directory (its latest checkpoint) or one iter_NNNNNNN directory")
    parser.add_argument("--all", action="store_true", help="every checkpoint of the save directory")
    args = parser.parse_args(argv)
    try:
        directories = checkpoints(args.path, args.all)
    except (CheckpointFormatError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    damaged = 0
    for directory in directories:
        try:
            print(verify(directory))
        except (CheckpointFormatError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            damaged += 1
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
