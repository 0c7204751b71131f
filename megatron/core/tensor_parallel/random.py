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
    """Seeds the default generators (the CPU's and `device`'s) alike on every TP rank and adds the
    per-rank model-parallel stream, which seeds only `device`'s generator and restores it."""
    default, tensor_parallel = model_parallel_seed(seed, tp_rank, pp_rank)
    utils.manual_seed(torch.device("cpu"), default)
    utils.manual_seed(device, default)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, tensor_parallel)
    return tracker


class _CheckpointFunction(torch.autograd.Function):
    """Runs `function` without keeping its activations; backward re-runs it from the saved inputs.

    The RNG states at the start of the forward (the default generator of the CPU and of `device`,
    and every stream of the tracker) are put back for the re-run, so dropout draws the same masks,
    and the caller's states are restored afterwards, so the rest of backward is unaffected.
    """

    @staticmethod
    def forward(ctx, function, tracker, device, *args):
        ctx.function, ctx.tracker, ctx.device = function, tracker, device
        ctx.rng_states = _capture_rng(tracker, device)
        with torch.no_grad():
            outputs = function(*args)
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.needs_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.non_tensor_args = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*(a for a, t in zip(args, ctx.is_tensor) if t))
        return outputs

    @staticmethod
    def backward(ctx, *output_grads):
        saved = iter(ctx.saved_tensors)
        args = [next(saved).detach().requires_grad_(needs_grad) if is_tensor else value
                for is_tensor, needs_grad, value in zip(ctx.is_tensor, ctx.needs_grad, ctx.non_tensor_args)]
        caller_states = _capture_rng(ctx.tracker, ctx.device)
        _restore_rng(ctx.rng_states, ctx.tracker, ctx.device)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _restore_rng(caller_states, ctx.tracker, ctx.device)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, output_grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if needs_grad else None for a, needs_grad in zip(args, ctx.needs_grad))
        return (None, None, None) + grads


def _capture_rng(tracker, device) -> tuple:
    cpu = torch.device("cpu")
    return (utils.rng_state(cpu), utils.rng_state(device) if device.type != "cpu" else None,
            tracker.get_states() if tracker is not None else None)


def _restore_rng(states: tuple, tracker, device) -> None:
    cpu_state, device_state, tracker_states = states
    utils.set_rng_state(torch.device("cpu"), cpu_state)
    if device_state is not None:
        utils.set_rng_state(device, device_state)
    if tracker is not None:
        tracker.set_states(tracker_states)


def checkpoint(function, tracker, *args):
    """function(*args) with activation recomputation (see `_CheckpointFunction`).

    `args` may mix tensors and other values; at least one tensor should require grad, else nothing
    would backpropagate through the block and it is simply run (nothing to recompute)."""
    if not torch.is_grad_enabled() or not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return function(*args)
    device = next(a.device for a in args if torch.is_tensor(a))
    return _CheckpointFunction.apply(function, tracker, device, *args)
