"""This framework's checkpoint directories: one `iter_NNNNNNN` directory per checkpoint, the tracker
file naming the latest, `common.json` in each, written atomically (through a temporary file and a
rename, fsync'd). Read by training (`--save`/`--load`) and by the conversions."""
import json
import os
import re
from typing import Optional

from megatron.core.checkpointing import CheckpointFormatError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
FORMAT = "megatron-lite torch_dist"
FORMAT_VERSION = 1
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")

def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def tracked_iteration(root: str) -> Optional[int]:
    """The iteration named by `root`'s tracker file, or None when there is no tracker."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if text == "release":
        raise CheckpointFormatError(f"{path} says 'release': that is a Megatron-LM checkpoint; import it with "
                                    "tools/checkpoint/convert.py --source-format megatron")
    try:
        return int(text)
    except ValueError:
        raise CheckpointFormatError(f"{path} holds {text!r}, not an iteration number; fix or delete the file") from None


def read_common(directory: str) -> dict:
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{path} is missing: {directory} is not a complete checkpoint of this framework")
    try:
        with open(path) as handle:
            common = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointFormatError(f"{path} is corrupt ({error})") from None
    if common.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path} is not a {FORMAT} checkpoint (format {common.get('format')!r})")
    if common.get("version", 0) > FORMAT_VERSION:
        raise CheckpointFormatError(f"{path} has format version {common['version']}; this version reads "
                                    f"up to {FORMAT_VERSION}: upgrade megatron-lite")
    return common


def write_json_atomically(path: str, value) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(value, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_text_atomically(path: str, text: str) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(os.path.dirname(path))


def fsync_directory(path: str) -> None:
    descriptor = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
