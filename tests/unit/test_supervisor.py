"""The Supervisor in one process: what the loop learns from it at its points (counted iterations,
the iteration its parts name, the exit reason) and what an error becomes. Each part it holds has
its own tests (test_reliability.py, test_exits.py, test_save_lock.py, test_launcher_watch.py); the
multi-rank behaviour runs in tests/functional/test_reliability.py."""
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.core.parallel_state import single_process
from megatron.training.arguments import parse_args
from megatron.training.errors import DeviceOutOfMemory
from megatron.training.reliability.supervisor import Supervisor
from megatron.training.state import TrainState

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "255", "--distributed-backend", "gloo"]


def supervisor(*flags) -> Supervisor:
    return Supervisor.start(parse_args(FLAGS + list(flags)), single_process(), print, lambda: None)


def test_after_step_counts_skipped_and_nan_iterations_and_keeps_a_vetoed_loss_out():
    watch, state = supervisor("--skip-iter-on-nan"), TrainState()
    assert watch.after_step(state, applied=True, grad_norm=1.0)
    assert (state.skipped_iterations, state.nan_iterations) == (0, 0)
    assert watch.after_step(state, applied=False, grad_norm=None)  # the fp16 loss scaler skipped it
    assert (state.skipped_iterations, state.nan_iterations) == (1, 0)
    watch.guard.vetoed = True  # the guard found NaN/Inf
    assert not watch.after_step(state, applied=False, grad_norm=None)
    assert (state.skipped_iterations, state.nan_iterations) == (2, 1)


def test_before_step_names_the_iteration_to_the_guard():
    watch = supervisor()
    watch.before_step(5)
    assert watch.guard.iteration == 5


def test_exit_conditions_start_with_training():
    watch = supervisor("--exit-interval", "2")
    assert watch.exit_reason(2) is None
    watch.before_training(time.time())
    try:
        assert watch.exit_reason(1) is None
        assert watch.exit_reason(2) == "--exit-interval 2 reached"
    finally:
        watch.after_training()


def test_on_error_reports_out_of_memory_and_raises_other_errors_unchanged():
    watch = supervisor()
    optimizer = SimpleNamespace(config=SimpleNamespace(optimizer="adam", sgd_momentum=0.9),
                                stepped_elements=lambda: (1 << 28, 0))
    with pytest.raises(DeviceOutOfMemory) as raised:
        watch.on_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 7, [], optimizer)
    assert str(raised.value).startswith("out of memory on rank 0 (cpu) with 7 iterations completed")
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    error = ValueError("a bad batch")
    with pytest.raises(ValueError) as raised:
        watch.on_error(error, 7, [], optimizer)
    assert raised.value is error
