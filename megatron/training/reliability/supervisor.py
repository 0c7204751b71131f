"""The reliability room's one door: the `Supervisor` owns every check and report around the loop,
and the loop calls it at fixed points instead of calling each part:

    Supervisor.before_start()          the worker ends with its launcher (launcher_watch.py)
    Supervisor.start(...)              one job per --save (save_lock.py); the failure report joins the
                                       job's store (failures.py); the step guard (guards.py), the
                                       straggler clock (straggler.py) and the test-only faults
                                       (fault_injection.py) are built
    before_training()                  --exit-signal-handler's handlers are installed (exits.py)
    before_step(iteration)             the guard and the faults learn the iteration
    before_forward_backward()          the straggler clock starts
    after_forward_backward(reported)   the clock stops; the guard sees the step's losses
    (optimizer.step(supervisor.guard)  the guard's flags travel with the gradient norm)
    after_step(state, applied, norm)   skipped and NaN iterations counted
    at_log_line(iteration)             the straggler report
    exit_reason(iteration)             --exit-interval, --exit-duration-in-mins, a signal
    on_error(error, iteration, ...)    out of memory and dead or hung ranks become messages (oom.py, failures.py)
    after_training() / release()       the signal handlers restored / the --save lock released

Each part stays in its own module with its own tests; this module only holds them together.
"""
import datetime
from typing import Callable, Optional

from megatron.training.reliability.exits import ExitConditions
from megatron.training.reliability.failures import FailureReport, Watch
from megatron.training.reliability.fault_injection import FaultInjector
from megatron.training.reliability.guards import StepGuard
from megatron.training.reliability.launcher_watch import die_with_launcher
from megatron.training.reliability.oom import MemoryWatch
from megatron.training.reliability.save_lock import SaveLock, hold_save_directory
from megatron.training.reliability.straggler import StragglerReport


class Supervisor:
    """The reliability parts of one run (see the module docstring); a part that the flags leave off is None."""

    def __init__(self, config, groups, guard: Optional[StepGuard], failure_report: Optional[FailureReport],
                 straggler: Optional[StragglerReport], faults: Optional[FaultInjector], save_lock: Optional[SaveLock]):
        self.config = config
        self.groups = groups
        self.guard = guard                      # NaN/Inf and spike checks of every step
        self.failure_report = failure_report    # names dead or hung ranks (torchrun jobs)
        self.straggler = straggler              # --log-straggler
        self.faults = faults                    # test-only (MEGATRON_TEST_FAULTS)
        self.save_lock = save_lock              # this job's hold on --save
        self.exits: Optional[ExitConditions] = None  # from before_training on

    @staticmethod
    def before_start() -> None:
        """Before the process joins the job: under torchrun the worker dies with its launcher."""
        die_with_launcher()

    @classmethod
    def start(cls, config, groups, printer: Callable[[str], None],
              last_checkpoint: Callable[[], Optional[str]]) -> "Supervisor":
        """After the process groups exist and before anything is built: takes the --save lock (every
        rank stops here when another job holds it) and builds the parts the flags ask for.
        `last_checkpoint()` names the newest checkpoint, for the guard's messages."""
        save_lock = hold_save_directory(config.checkpoint.save, groups, printer)
        timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
        return cls(config, groups,
                   guard=StepGuard.build(config.training, groups, printer, last_checkpoint),
                   failure_report=FailureReport.connect(groups.global_rank, groups.world_size, timeout),
                   straggler=StragglerReport(config.logging, groups) if config.logging.log_straggler else None,
                   faults=FaultInjector.from_environment(groups.global_rank), save_lock=save_lock)

    def wrap(self, forward_step_func: Callable) -> Callable:
        """The step function, with the test-only faults around it when MEGATRON_TEST_FAULTS asks for them."""
        return self.faults.wrap(forward_step_func) if self.faults is not None else forward_step_func

    # -- around the loop -----------------------------------------------------------------------
    def before_training(self, job_start_time: float) -> None:
        """The exit conditions (their signal handlers from here on; the time limit counts from `job_start_time`)."""
        self.exits = ExitConditions(self.config.training, self.groups, job_start_time)

    def after_training(self) -> None:
        """The default signal handlers back (also after an error)."""
        if self.exits is not None:
            self.exits.restore()

    def release(self) -> None:
        """Releases the --save lock (at the end of a run that finished normally)."""
        if self.save_lock is not None:
            self.save_lock.release()

    # -- around each step ----------------------------------------------------------------------
    def before_step(self, iteration: int) -> None:
        """`iteration`: the one about to run (1-based, as logged), for the guard's and faults' messages."""
        for part in (self.guard, self.faults):
            if part is not None:
                part.iteration = iteration

    def before_forward_backward(self) -> None:
        if self.straggler is not None:
            self.straggler.start()

    def after_forward_backward(self, reported: list) -> None:
        """The forward-backward time ends here, before the gradient reduction makes the ranks wait
        for one another; the guard flags a non-finite loss among this rank's `reported` values."""
        if self.straggler is not None:
            self.straggler.stop()
        if self.guard is not None:
            self.guard.observe_losses(reported)

    def after_step(self, state, applied: bool, grad_norm: Optional[float]) -> bool:
        """Counts a step that was not applied in `state` (as skipped, and as NaN unless the fp16
        loss scaler skipped it); returns whether the step's losses count in the logged average
        (not a NaN/Inf step's)."""
        vetoed = self.guard is not None and self.guard.vetoed
        if not applied:
            state.skipped_iterations += 1
            if grad_norm is not None or vetoed:
                state.nan_iterations += 1
        return not vetoed

    def at_log_line(self, iteration: int) -> None:
        """With --log-straggler, the report of the interval (collective over all ranks)."""
        if self.straggler is None:
            return
        report = self.straggler.report(iteration)
        if report is not None:
            print(report, flush=True)

    def exit_reason(self, iteration: int) -> Optional[str]:
        """Why to stop after `iteration` (the same on every rank), or None."""
        return self.exits.check(iteration) if self.exits is not None else None

    def on_error(self, error: Exception, iteration: int, chunks: list, optimizer) -> None:
        """Raises what `error`, with `iteration` iterations completed, means for the run:
        `DeviceOutOfMemory` with the start-up estimate of `chunks` and `optimizer` and the flags that
        reduce memory, `DistributedFailure` naming the dead or hung ranks, or `error` itself, posted
        first as this rank's cause for the other ranks' reports."""
        # The watches turn the error into theirs on its way out of their blocks: out of memory first,
        # so that the failure report posts the message that names it.
        with Watch(self.failure_report, lambda: iteration), \
                MemoryWatch(self.config, self.groups, chunks, optimizer, lambda: iteration):
            raise error
