"""Early exits: --exit-interval, --exit-duration-in-mins and --exit-signal-handler (one process;
the cross-rank agreement runs in tests/functional/test_checkpointing.py under torchrun)."""
import os
import signal
import time
from types import SimpleNamespace

from megatron.core.parallel_state import single_process
from megatron.training.reliability.exits import ExitConditions


def conditions(interval=None, minutes=None, handler=False, started=None):
    config = SimpleNamespace(exit_interval=interval, exit_duration_in_mins=minutes, exit_signal_handler=handler)
    return ExitConditions(config, single_process(), started if started is not None else time.time())


def test_interval_and_duration():
    assert conditions(interval=3).check(2) is None
    assert conditions(interval=3).check(6) == "--exit-interval 3 reached"
    assert conditions(minutes=1.0).check(1) is None
    assert conditions(minutes=1.0, started=time.time() - 61).check(1) == "--exit-duration-in-mins 1 reached"


def test_signals_are_recorded_then_handlers_restored():
    exits = conditions(handler=True)
    try:
        assert exits.check(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exits.check(2) == "signal SIGUSR1"
    finally:
        exits.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_zero_turns_an_exit_off_as_in_megatron_lm():
    exits = conditions(interval=0, minutes=0, started=time.time() - 3600)
    assert exits.check(6) is None
