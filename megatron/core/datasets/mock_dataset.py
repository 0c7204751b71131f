"""Random-token dataset for `--mock-data`: deterministic by seed, no files needed."""
import numpy as np


class MockGPTDataset:
    """Samples of `seq_length` random tokens; sample i is the same on every rank and every run.

    Each item is a dict of numpy arrays, the contract every GPT dataset here follows:
    tokens (int64, [s]), labels (int64, [s], tokens shifted by one), loss_mask (float32, [s]),
    position_ids (int64, [s]).
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for a mock dataset of {self.num_samples}")
        rng = np.random.default_rng([self.seed, index])
        window = rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
        return {
            "tokens": window[:-1].copy(),
            "labels": window[1:].copy(),
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
            "position_ids": np.arange(self.seq_length, dtype=np.int64),
        }
