"""The reliability pieces in one process: the step guard's decisions and messages, spike
detection, the test-only fault parser, failure messages and the out-of-memory report. The
multi-rank behaviour runs in tests/functional/test_reliability.py."""
import math
import os
from types import SimpleNamespace

import pytest
import torch

from megatron.core.parallel_state import single_process
from megatron.training.reliability import fault_injection
from megatron.core.distributed import comm
from megatron.training.reliability.failures import _first_line, enable_nccl_flight_recorder, is_collective_failure, where_it_failed
from megatron.training.reliability.guards import MIN_HISTORY, NonFiniteError, SpikeDetector, StepGuard
from megatron.training.reliability.oom import DeviceOutOfMemory, MemoryWatch, memory_flags


def training_config(**overrides):
    values = dict(check_for_nan_in_loss_and_grad=True, skip_iter_on_nan=False, max_skipped_iters=2,
                  check_for_large_grads=False, check_for_spiky_loss=False, spike_factor=10.0)
    return SimpleNamespace(**(values | overrides))


def guard(messages, checkpoint=None, **overrides):
    return StepGuard.build(training_config(**overrides), single_process(), messages.append, lambda: checkpoint)


def step(guard_, loss: float, grad_square: float, iteration: int):
    """One step through the guard as MixedPrecisionOptimizer.step drives it: (applied?, values)."""
    guard_.iteration = iteration
    guard_.observe_losses([{"lm loss": torch.tensor([loss * 8.0, 8.0])}])
    values = guard_.flags(torch.tensor([grad_square])).tolist()
    return guard_.allow(math.sqrt(grad_square), values), values


def test_finite_steps_pass_and_the_check_can_be_turned_off():
    messages = []
    assert step(guard(messages), 2.0, 4.0, 1)[0] is True
    assert StepGuard.build(training_config(check_for_nan_in_loss_and_grad=False), single_process(), print,
                           lambda: None) is None


@pytest.mark.parametrize("loss, grad_square, what", [
    (float("nan"), 4.0, "the loss on rank 0"),
    (2.0, float("inf"), "the gradients on rank 0 (checked after the data-parallel reduction)"),
    (float("inf"), float("nan"), "the loss on rank 0 and in the gradients on rank 0 (checked after the data-parallel "
                                 "reduction)"),
])
def test_a_non_finite_step_stops_naming_the_iteration_rank_and_what(loss, grad_square, what):
    with pytest.raises(NonFiniteError) as stopped:
        step(guard([], checkpoint="ckpt/iter_0000010"), loss, grad_square, 17)
    message = str(stopped.value)
    assert message.startswith(f"iteration 17: NaN/Inf in {what}; training stopped (--check-for-nan-in-loss-and-grad)")
    assert "resume from ckpt/iter_0000010 with --iterations-to-skip 16" in message


def test_skip_iter_on_nan_skips_up_to_max_skipped_iters_in_a_row():
    messages = []
    g = guard(messages, skip_iter_on_nan=True, max_skipped_iters=2)
    assert step(g, float("nan"), 1.0, 3)[0] is False and g.vetoed
    assert step(g, 1.0, 1.0, 4)[0] is True and not g.vetoed  # a good step resets the count
    assert step(g, float("nan"), 1.0, 5)[0] is False
    assert step(g, float("nan"), 1.0, 6)[0] is False
    assert messages[-1].startswith("WARNING: iteration 6: NaN/Inf in the loss on rank 0; the iteration is skipped "
                                   "(--skip-iter-on-nan: 2 in a row, at most 2)")
    with pytest.raises(NonFiniteError, match=r"^iteration 7: .* \(more than --max-skipped-iters 2 in a row\)"):
        step(g, float("nan"), 1.0, 7)


def test_spike_detector_compares_with_the_recent_largest_value():
    detector = SpikeDetector(factor=10.0)
    for _ in range(MIN_HISTORY - 1):
        assert detector.check(1.0) is None
    assert detector.check(50.0) is None            # too little history yet: joins it
    assert detector.check(499.0) is None           # 9.98x the largest (50)
    assert detector.check(5000.0) == 499.0         # a spike: reported, kept out of the history
    assert detector.check(float("nan")) is None    # non-finite values are the NaN check's business
    assert max(detector.history) == 499.0


def test_spikes_are_reported_with_the_iteration_and_the_last_checkpoint(capsys):
    g = guard([], checkpoint="ckpt/iter_0000020", check_for_large_grads=True, check_for_spiky_loss=True)
    for iteration in range(1, MIN_HISTORY + 1):
        assert step(g, 2.0, 1.0, iteration)[0] is True
    assert step(g, 2.0 * 1000, 1.0e6, MIN_HISTORY + 1)[0] is True  # reported, not acted on
    printed = capsys.readouterr().out
    assert (f"WARNING: iteration {MIN_HISTORY + 1}: gradient norm 1.0000E+03 is 1000.0x the largest of the previous "
            f"{MIN_HISTORY} iterations (1.0000E+00) (--check-for-large-grads); last checkpoint: ckpt/iter_0000020") in printed
    assert f"WARNING: iteration {MIN_HISTORY + 1}: loss on rank 0 2.0000E+03 is 1000.0x" in printed


def test_fault_specifications_parse_and_fire_in_the_first_attempt_only(monkeypatch):
    assert fault_injection.parse("nan-loss@3:1, kill@5:0") == [fault_injection.Fault("nan-loss", 3, 1),
                                                                fault_injection.Fault("kill", 5, 0)]
    with pytest.raises(ValueError, match="'nan@3' is not KIND@ITERATION:RANK"):
        fault_injection.parse("nan@3")
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        fault_injection.parse("boom@3:1")
    monkeypatch.setenv(fault_injection.VARIABLE, "nan-loss@3:1")
    assert fault_injection.FaultInjector.from_environment(rank=1).faults == [fault_injection.Fault("nan-loss", 3, 1)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_injection.FaultInjector.from_environment(rank=1) is None


def test_collective_errors_are_recognised_and_shortened():
    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:35011: Connection reset by peer. This is typically caused by a remote worker "
                         "hanging or bugs in the application. GLHF!")
    assert is_collective_failure(error)
    assert _first_line(error) == "RuntimeError: Read error [127.0.0.1]:35011: Connection reset by peer"
    assert not is_collective_failure(ValueError("bad flag")) and not is_collective_failure(RuntimeError("a bug"))


def test_a_failed_wait_is_a_collective_failure_and_says_where():
    class TimedOut:
        def wait(self):
            raise RuntimeError("Application timeout caused pair closure")

    with pytest.raises(RuntimeError) as raised:
        comm.PendingWork(TimedOut(), None).wait()
    assert is_collective_failure(raised.value)
    assert where_it_failed(raised.value).startswith("waiting on an asynchronous collective "
                                                    "(megatron/core/distributed/comm.py:")


def _oom_run(**training):
    config = SimpleNamespace(training=SimpleNamespace(**({"recompute_granularity": None, "micro_batch_size": 4}
                                                         | training)),
                             parallel=SimpleNamespace(sequence_parallel=False, use_distributed_optimizer=False,
                                                      use_torch_fsdp2=False))
    groups = SimpleNamespace(tp_size=1, pp_size=1, dp_size=2, cp_size=1, global_rank=0, device=torch.device("cpu"))
    optimizer = SimpleNamespace(config=SimpleNamespace(optimizer="adam", sgd_momentum=0.9),
                                stepped_elements=lambda: (1 << 28, 0))
    return SimpleNamespace(config=config, groups=groups, chunks=[], optimizer=optimizer)


def test_out_of_memory_names_the_estimate_the_peak_and_the_flags():
    run = _oom_run()
    with pytest.raises(DeviceOutOfMemory) as raised:
        with MemoryWatch(run.config, run.groups, run.chunks, run.optimizer, lambda: 12):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(raised.value)
    assert message.startswith("out of memory on rank 0 (cpu) with 12 iterations completed: CUDA out of memory. Tried to "
                              "allocate")
    assert "start-up estimate: 2.000 GiB (parameters 0.000, gradients 0.000, optimizer state 2.000;" in message
    assert "measured peak: " in message
    for flag in ("--recompute-granularity selective", "--micro-batch-size 2", "--tensor-model-parallel-size 2 with "
                 "--sequence-parallel", "--pipeline-model-parallel-size 2", "--use-distributed-optimizer"):
        assert flag in message
    assert memory_flags(_oom_run(recompute_granularity="full", micro_batch_size=1).config, run.groups)[0].startswith(
        "--tensor-model-parallel-size 2")


def test_nccl_flight_recorder_is_switched_on_and_its_dumps_placed(tmp_path, monkeypatch):
    """The variables PyTorch reads when it creates an NCCL group (the GPU path itself needs two GPUs)."""
    names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    note = enable_nccl_flight_recorder(str(tmp_path / "ckpt"))
    prefix = str(tmp_path / "ckpt" / "flight_recorder" / "nccl_trace_rank_")
    assert [os.environ[name] for name in names] == [prefix, prefix, "2000", "2000", "1"]
    assert (tmp_path / "ckpt" / "flight_recorder").is_dir()
    assert f"writes its last 2000 collectives to {prefix}<rank>" in note
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/trace_")  # the user's choice wins
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")
    assert "writes its last 500 collectives to /elsewhere/trace_<rank>" in enable_nccl_flight_recorder(None)

