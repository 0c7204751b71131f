"""When to stop early: --exit-interval, --exit-duration-in-mins and --exit-signal-handler; and how a
run that stopped on an error exits (`exit_on_error`: the message, not a traceback).

Checked after every iteration. The time limit and the signals are agreed over all ranks (one
max-reduction of two flags), so every rank stops after the same iteration, saves the same
checkpoint and exits 0, even when only some ranks got the signal or crossed the time limit.
"""
import os
import signal
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from megatron.core.distributed import comm
from megatron.training.errors import (CheckpointSaveError, ConfigError, DeviceOutOfMemory, DistributedFailure,
                                      NonFiniteError)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    def __init__(self, training_config, groups, job_start_time: float):
        self.interval = training_config.exit_interval
        self.duration_seconds = (training_config.exit_duration_in_mins * 60.0
                                 if training_config.exit_duration_in_mins else None)  # 0: off, as in Megatron-LM
        self.handle_signals = training_config.exit_signal_handler
        self.groups = groups
        self.job_start_time = job_start_time
        self.received: list = []
        if self.handle_signals:
            for signum in HANDLED_SIGNALS:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received.append(signal.Signals(signum).name)

    def check(self, iteration: int) -> Optional[str]:
        """The reason to stop after `iteration` (the same on every rank), or None."""
        if self.handle_signals or self.duration_seconds is not None:
            flags = torch.tensor([float(bool(self.received)),
                                  float(self.duration_seconds is not None
                                        and time.time() - self.job_start_time > self.duration_seconds)],
                                 device=self.groups.device)
            comm.all_reduce_max(flags, self.groups.world)
            if flags[0] > 0:
                return f"signal {self.received[0]}" if self.received else "signal received by another rank"
            if flags[1] > 0:
                return f"--exit-duration-in-mins {self.duration_seconds / 60.0:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        return None

    def restore(self) -> None:
        """Puts the default signal handlers back (after training)."""
        if self.handle_signals:
            for signum in HANDLED_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)


def exit_on_error(main: Callable, argv: list) -> None:
    """Runs `main(argv)`; an error that says what went wrong in its message exits with that message
    alone (1 for training stopped, 2 for bad flags or inputs) unless MEGATRON_TRACEBACK=1 asks for
    the traceback."""
    try:
        main(argv)
    except (NonFiniteError, DistributedFailure, DeviceOutOfMemory, CheckpointSaveError) as error:
        # Training stopped for a reason the message names (a NaN, a dead or hung rank, memory, disk):
        # the message, not a traceback, unless one is asked for.
        if os.environ.get("MEGATRON_TRACEBACK") == "1":
            raise
        if not isinstance(error, NonFiniteError) or os.environ.get("RANK", "0") == "0":  # that one is agreed
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (ValueError, FileNotFoundError) as error:
        # Configuration and input errors (bad flags, missing or malformed data files) say what and
        # how to fix in their message: print that line alone unless a traceback is asked for. A flag
        # error is the same on every rank: the first rank of each node prints it.
        if os.environ.get("MEGATRON_TRACEBACK") == "1":
            raise
        from megatron.training.arguments import as_flags, is_first_rank

        message = as_flags(str(error))  # a library error names config fields: spelled as flags here
        if isinstance(error, ConfigError):
            if is_first_rank():
                print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        frame = traceback.extract_tb(error.__traceback__)[-1]
        print(f"error: {message}\n(raised at {frame.filename}:{frame.lineno}; "
              "set MEGATRON_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        sys.exit(2)
