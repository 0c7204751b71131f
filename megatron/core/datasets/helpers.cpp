// Index builders for GPTDataset and BlendedDataset, compiled as megatron.core.datasets._helpers.
// helpers.py holds a numpy twin of each function that must return identical arrays. Both follow
// Megatron-Core's helpers.cpp rule for rule, so the same inputs give Megatron-Core's indices.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using IntArray32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using FloatArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Row k of the result locates stream position k * seq_length, k = 0..num_samples, where the stream
// is the documents sizes[document_index[0]], sizes[document_index[1]], ... laid end to end:
// (position in document_index of the document holding that token, offset within that document).
// Row 0 is always (0, 0), even when the first documents are empty. Sample k is the seq_length + 1
// tokens from row k to row k + 1 inclusive.
py::array_t<int64_t> build_sample_idx(const IntArray32& sizes, const IntArray32& document_index,
                                      int64_t seq_length, int64_t num_samples) {
  if (seq_length < 1 || num_samples < 0) {
    throw std::invalid_argument("build_sample_idx: seq_length must be >= 1 and num_samples >= 0");
  }
  const int32_t* size_of = sizes.data();
  const int32_t* documents = document_index.data();
  const int64_t num_sizes = sizes.size();
  const int64_t num_documents = document_index.size();
  for (int64_t i = 0; i < num_documents; ++i) {
    if (documents[i] < 0 || documents[i] >= num_sizes) {
      throw std::out_of_range("build_sample_idx: document index entry " + std::to_string(documents[i]) +
                              " outside sizes of length " + std::to_string(num_sizes));
    }
  }
  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* out = result.mutable_data();
  bool overflow = false;
  {
    py::gil_scoped_release release;
    int64_t position_in_index = 0;  // current entry of document_index
    int64_t document_start = 0;     // stream position where that document starts
    out[0] = 0;
    out[1] = 0;
    for (int64_t k = 1; k <= num_samples && !overflow; ++k) {
      const int64_t position = k * seq_length;
      while (position_in_index < num_documents &&
             document_start + size_of[documents[position_in_index]] <= position) {
        document_start += size_of[documents[position_in_index]];
        ++position_in_index;
      }
      if (position_in_index == num_documents) {
        overflow = true;
        break;
      }
      out[2 * k] = position_in_index;
      out[2 * k + 1] = position - document_start;
    }
  }
  if (overflow) {
    throw std::out_of_range("build_sample_idx: the documents hold fewer than num_samples * seq_length + 1 tokens");
  }
  return result;
}

// Greedy blending: sample i goes to the dataset with the largest error weight * max(i, 1) - count
// (the first such dataset on ties). Returns (dataset_index int16, dataset_sample_index int64).
py::tuple build_blending_indices(const FloatArray& weights, int64_t size) {
  const int64_t num_datasets = weights.size();
  if (num_datasets < 1 || num_datasets > 32767 || size < 0) {
    throw std::invalid_argument("build_blending_indices: need 1..32767 datasets and size >= 0");
  }
  const double* weight = weights.data();
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int16_t* which = dataset_index.mutable_data();
  int64_t* sample = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(num_datasets, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double target = std::max(static_cast<double>(i), 1.0);
      int64_t best = 0;
      double best_error = weight[0] * target - static_cast<double>(counts[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = weight[d] * target - static_cast<double>(counts[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      which[i] = static_cast<int16_t>(best);
      sample[i] = counts[best];
      ++counts[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "C++ index builders for megatron.core.datasets (numpy twin in helpers.py)";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("document_index"),
        py::arg("seq_length"), py::arg("num_samples"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
