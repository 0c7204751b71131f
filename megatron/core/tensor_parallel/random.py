"""Named RNG streams so dropout is right inside and outside tensor-parallel regions.

The default stream is identical on all tensor-parallel ranks (dropout on replicated activations
must agree); the "model-parallel" stream differs per TP rank (dropout on sharded activations, such
as attention probabilities of different heads, or sequence-parallel shards, must not repeat).
`fork(name)` swaps a stream in for a block and puts the caller's state back afterwards, which is
also what lets activation recomputation reproduce the same masks.
"""
import contextlib

import torch

from megatron.core import utils

MODEL_PARALLEL_RNG = "model-parallel-rng"


class RNGStatesTracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = utils.rng_state(self.device)
        utils.manual_seed(self.device, seed)
        self.states[name] = utils.rng_state(self.device)
        utils.set_rng_state(self.device, saved)

    def get_states(self) -> dict:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        saved = utils.rng_state(self.device)
        utils.set_rng_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = utils.rng_state(self.device)
            utils.set_rng_state(self.device, saved)


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> tuple[int, int]:
    """(default stream seed, model-parallel stream seed), offset as Megatron offsets them."""
    default = seed + 100 * pp_rank
    return default, default + 2718 + tp_rank


def build_tracker(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> RNGStatesTracker:
    default, tensor_parallel = model_parallel_seed(seed, tp_rank, pp_rank)
    utils.manual_seed(device, default)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, tensor_parallel)
    return tracker
