"""Hash-named `.npy` cache for dataset indices, written atomically (temporary name, then rename).

A dataset describes itself as a JSON-able dict (paths, split, seed, sizes, ...); the MD5 of that
description names its files, so a changed setting never reads stale indices. One rank builds
and writes; the others wait at a barrier and then only read.
"""
import hashlib
import json
import os
import tempfile
from typing import Dict, Optional, Sequence

import numpy as np

# Part of every hash: bump it whenever the rules that build the indices change, so that caches
# written under the old rules are never read. 2: Megatron-Core's shuffling, split and blending rules.
CACHE_FORMAT_VERSION = 2


def description_hash(description: Dict) -> str:
    text = json.dumps({"cache_format": CACHE_FORMAT_VERSION, **description}, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def default_cache_dir(path_prefix: str) -> str:
    """The default cache: a `cache/` directory beside the data."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")


class IndexCache:
    """The files of one dataset's indices: `{cache_dir}/{hash}-{kind}-{name}.npy`."""

    def __init__(self, cache_dir: str, kind: str, description: Dict):
        self.cache_dir = cache_dir
        self.description = description
        self.stem = os.path.join(cache_dir, f"{description_hash(description)}-{kind}")

    def path(self, name: str) -> str:
        return f"{self.stem}-{name}.npy"

    def exists(self, names: Sequence[str]) -> bool:
        return all(os.path.isfile(self.path(name)) for name in names)

    def load(self, names: Sequence[str]) -> Dict[str, np.ndarray]:
        missing = [self.path(name) for name in names if not os.path.isfile(self.path(name))]
        if missing:
            raise FileNotFoundError(f"dataset index cache file {missing[0]} is missing: the builder rank did not write it. "
                                    "Check that --data-cache-path is on a filesystem every rank sees and that the "
                                    "builder rank did not fail")
        return {name: np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in names}

    def prepare(self) -> None:
        """Create the cache directory and check it is writable: call before building anything."""
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.cache_dir):
                pass
        except OSError as error:
            raise ValueError(f"cannot write the dataset index cache in {self.cache_dir} ({error.strerror or error}); "
                             "set --data-cache-path to a writable directory") from error

    def save(self, arrays: Dict[str, np.ndarray]) -> None:
        self.prepare()
        self._write(self.stem + "-description.txt", json.dumps(self.description, indent=2, sort_keys=True).encode())
        for name, array in arrays.items():
            temporary = f"{self.path(name)}.tmp-{os.getpid()}"
            with open(temporary, "wb") as handle:
                np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
            os.replace(temporary, self.path(name))

    def _write(self, path: str, data: bytes) -> None:
        temporary = f"{path}.tmp-{os.getpid()}"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)


def resolve_cache_dir(data_cache_path: Optional[str], path_prefix: str) -> str:
    return data_cache_path if data_cache_path else default_cache_dir(path_prefix)
