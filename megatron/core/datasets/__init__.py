"""Datasets: Megatron's `.bin/.idx` format, GPT samples, blending and mock data."""
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, SampleOptions, get_ltor_masks_and_position_ids
from megatron.core.datasets.gpt_dataset_builder import (GPTDatasetConfig, build_gpt_datasets, check_data_inputs,
                                                        parse_data_path, parse_split)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from megatron.core.datasets.mock_dataset import MockGPTDataset

__all__ = ["BlendedDataset", "GPTDataset", "GPTDatasetConfig", "IndexedDataset", "IndexedDatasetBuilder", "MockGPTDataset",
           "SampleOptions", "build_gpt_datasets", "check_data_inputs", "get_ltor_masks_and_position_ids", "optimal_dtype",
           "parse_data_path", "parse_split"]
