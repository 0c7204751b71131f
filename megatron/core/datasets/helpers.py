"""Sample-index and blending-index builders: the C++ extension `_helpers` when it is built, else numpy.

Both implementations return identical arrays (tests/unit/data checks this), and both follow
Megatron-Core's `helpers.cpp`. The numpy one is slower for blending (a Python loop) and needs more
memory for sample indices (a cumulative sum over the whole document index), so it is used only as
a fallback, with a warning.
"""
import warnings
from typing import Tuple

import numpy as np

try:
    from megatron.core.datasets import _helpers as _cpp
except ImportError:  # extension not compiled: `python setup.py build_ext --inplace` builds it
    _cpp = None

_warned = False
INT32_MAX = np.iinfo(np.int32).max


def cpp_available() -> bool:
    return _cpp is not None


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        warnings.warn("megatron.core.datasets._helpers (C++) is not built; using the slower numpy index builders. "
                      "Build it with `pip install -e .` or `python setup.py build_ext --inplace`.", RuntimeWarning, stacklevel=3)
        _warned = True


def build_sample_idx_numpy(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Row k: (position in document_index, offset) of stream position k * seq_length; row 0 is (0, 0); see helpers.cpp."""
    if seq_length < 1 or num_samples < 0:
        raise ValueError("build_sample_idx: seq_length must be >= 1 and num_samples >= 0")
    lengths = np.asarray(sizes, dtype=np.int32)[np.asarray(document_index, dtype=np.int64)].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples and positions[-1] >= (ends[-1] if ends.size else 0):
        raise IndexError("build_sample_idx: the documents hold fewer than num_samples * seq_length + 1 tokens")
    result = np.zeros((num_samples + 1, 2), dtype=np.int64)
    if num_samples:
        which = np.searchsorted(ends, positions[1:], side="right")
        result[1:, 0] = which
        result[1:, 1] = positions[1:] - (ends[which] - lengths[which])
    return result


def build_blending_indices_numpy(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Greedy blending, as helpers.cpp: sample i goes to argmax_d weight[d] * max(i, 1) - count[d]."""
    weights = [float(w) for w in np.asarray(weights, dtype=np.float64)]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    indices = range(len(weights))
    for i in range(size):
        target = max(float(i), 1.0)
        best = max(indices, key=lambda d: (weights[d] * target - float(counts[d]), -d))
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_sample_idx(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """The sample index, int32 when every entry fits (Megatron-Core's rule), else int64."""
    if _cpp is None:
        _warn_fallback()
        result = build_sample_idx_numpy(sizes, document_index, seq_length, num_samples)
    else:
        try:
            result = _cpp.build_sample_idx(np.asarray(sizes, dtype=np.int32), np.asarray(document_index, dtype=np.int32),
                                           int(seq_length), int(num_samples))
        except (OverflowError, IndexError) as error:  # pybind11 maps std::out_of_range to IndexError
            raise IndexError(str(error)) from error
    largest = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0)
    return result.astype(np.int32) if largest <= INT32_MAX else result


def build_blending_indices(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    if _cpp is None:
        _warn_fallback()
        return build_blending_indices_numpy(weights, size)
    dataset_index, dataset_sample_index = _cpp.build_blending_indices(np.asarray(weights, dtype=np.float64), int(size))
    return dataset_index, dataset_sample_index
