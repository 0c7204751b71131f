"""The training loop: pretrain -> train (train_step, evaluate) with Megatron's log line."""
import dataclasses
import datetime
import gc
import logging
import math
import time
from functools import partial
from typing import Callable, Optional

import torch

from megatron.core import utils
from megatron.core.distributed import comm
from megatron.core.distributed.ddp import finalize_model_grads
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.parallel_state import ParallelGroups
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig
from megatron.core.transformer.fp8 import choose_fp8_linears
from megatron.core.transformer.moe.router import aux_loss_log_values, finish_moe_step
from megatron.training import builders
from megatron.training.arguments import format_config
from megatron.training.state import BatchSchedule, TrainState, batch_schedule
from megatron.training.checkpointing import Checkpointer, checkpoint_dir
from megatron.training.config import Config
from megatron.training.data import build_loader, endless
from megatron.training.reliability.exits import ExitConditions
from megatron.training.reliability.failures import FailureReport, Watch
from megatron.training.fast_paths import fast_paths_line
from megatron.training.reliability.fault_injection import FaultInjector
from megatron.training.reliability.guards import StepGuard
from megatron.training.initialize import initialize_distributed, world_size_from_env
from megatron.training.logging import TensorBoardWriter, flops_per_iteration, iteration_line, tensorboard_scalars
from megatron.training.memory import memory_report, theoretical_bytes
from megatron.training.reliability.oom import MemoryWatch
from megatron.training.profiling import StepProfiler
from megatron.training.progress import ProgressLog
from megatron.training.reliability.save_lock import SaveLock, hold_save_directory
from megatron.training.startup import check_fits_in_memory, startup_checks
from megatron.training.reliability.straggler import StragglerReport

_JOB_START_TIME = time.time()  # --exit-duration-in-mins counts from here (module import ~ job start)


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a step needs, built once by `setup` (and never changed: `pretrain` adds its
    TensorBoard writer and progress log with `dataclasses.replace`)."""

    config: Config
    groups: ParallelGroups
    model_config: TransformerConfig      # the architecture (derived)
    execution: ExecutionConfig           # how the layers run it
    chunks: list                         # of ModelChunk (DDP or FSDP2), one per virtual pipeline stage
    optimizer: MixedPrecisionOptimizer
    scheduler: OptimizerParamScheduler
    forward_step_func: Callable          # wrapped by the test-only faults when MEGATRON_TEST_FAULTS is set
    global_batch_size: int
    num_microbatches: int
    printer: Callable
    vocab_size: int
    checkpointer: Optional[Checkpointer]
    checkpoint_to_load: Optional[tuple]  # (directory, common.json) found by --load
    batches: Optional[BatchSchedule] = None  # the global batch size of each iteration (--rampup-batch-size)
    tensorboard: TensorBoardWriter = dataclasses.field(default_factory=lambda: TensorBoardWriter(None))
    progress: Optional[ProgressLog] = None
    attention_report: str = ""
    fast_paths: str = ""                               # the start-up line naming each path that runs
    guard: Optional[StepGuard] = None                  # NaN/Inf and spike checks of every step
    failure_report: Optional[FailureReport] = None     # names dead or hung ranks (torchrun jobs)
    straggler: Optional[StragglerReport] = None        # --log-straggler
    faults: Optional[FaultInjector] = None             # test-only (MEGATRON_TEST_FAULTS)
    save_lock: Optional[SaveLock] = None               # this job's hold on --save (save_lock.py)


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def setup(config: Config, forward_step_func: Callable, vocab_size: int,
          check_inputs: Optional[Callable] = None) -> Run:
    """Validates the flags (and the checkpoint to load against them) and, with `check_inputs(config)`,
    the input files; joins the process groups, builds model, DDP and optimizer."""
    config, model_config, notes, to_load = startup_checks(config, vocab_size, world_size_from_env(), check_inputs)
    if config.logging.logging_level is not None:
        logging.basicConfig(level=config.logging.logging_level)
        logging.getLogger().setLevel(config.logging.logging_level)
    groups, rng_tracker = initialize_distributed(config)
    save_lock = hold_save_directory(config.checkpoint.save, groups, print_rank_0)
    print_rank_0(format_config(config))
    check_fits_in_memory(config, model_config, groups.world_size, groups.device)
    for note in notes:
        print_rank_0(f"NOTE: {note}")
    execution, attention_report = builders.resolve_attention(model_config, builders.execution_config(config), config,
                                                             groups)
    print_rank_0(f"> {attention_report}")
    chunks = builders.build_model_chunks(config, groups, model_config, execution, rng_tracker)
    fp8_choice = choose_fp8_linears(chunks, config.training.micro_batch_size * config.training.seq_length
                                    // groups.cp_size, groups.device) if execution.fp8 else ""
    chunks = builders.wrap_data_parallel(chunks, config, groups)
    optimizer, scheduler = builders.build_optimizer(config, chunks, groups)
    fast_paths = fast_paths_line(execution, no_torch_compile=config.model.no_torch_compile, device=groups.device,
                                 attention_report=attention_report, optimizer=optimizer,
                                 num_experts=model_config.num_experts, fp8_choice=fp8_choice)
    print_rank_0(f"> {fast_paths}")
    batches = batch_schedule(config.training, groups.dp_size)
    global_batch = batches.global_batch_size
    num_microbatches = batches.num_microbatches_at(math.inf)
    params = sum(p.numel() for c in chunks for p in c.module.parameters())
    print_rank_0(f"> parameters on (tensor, pipeline) rank ({groups.tp_rank}, {groups.pp_rank}): {params}")
    print_rank_0(f"> padded vocab size: {model_config.padded_vocab_size}, micro-batches per step: {num_microbatches}, "
                 f"data-parallel size: {groups.dp_size}, context-parallel size: {groups.cp_size}, "
                 f"device: {groups.device}")
    print_rank_0(memory_report(config, chunks, optimizer, groups, figures=_largest_over_ranks(chunks, optimizer, groups)))
    checkpointer = (Checkpointer(config, groups, rng_tracker, print_rank_0)
                    if config.checkpoint.save or to_load is not None else None)
    faults = FaultInjector.from_environment(groups.global_rank)  # test-only: wraps the step from outside
    return Run(config, groups, model_config, execution, chunks, optimizer, scheduler,
               faults.wrap(forward_step_func) if faults is not None else forward_step_func, global_batch,
               num_microbatches, print_rank_0, vocab_size, checkpointer, to_load, batches,
               attention_report=attention_report, fast_paths=fast_paths, faults=faults, save_lock=save_lock,
               **_reliability(config, groups, checkpointer))


def _reliability(config: Config, groups: ParallelGroups, checkpointer: Optional[Checkpointer]) -> dict:
    """The per-step guards, the failure report and the straggler report."""
    return dict(
        guard=StepGuard.build(config.training, groups, print_rank_0,
                              partial(_last_checkpoint, config.checkpoint, checkpointer)),
        failure_report=FailureReport.connect(groups.global_rank, groups.world_size, datetime.timedelta(
            minutes=config.parallel.distributed_timeout_minutes)),
        straggler=StragglerReport(config.logging, groups) if config.logging.log_straggler else None)


def _last_checkpoint(options, checkpointer: Optional[Checkpointer]) -> Optional[str]:
    """The directory of the newest checkpoint this run saved or loaded, if any."""
    if checkpointer is not None and checkpointer.last_saved_iteration is not None:
        return checkpoint_dir(options.save or options.load, checkpointer.last_saved_iteration)
    return None


def _largest_over_ranks(chunks: list, optimizer, groups) -> dict:
    """The theoretical memory figures, each the largest over all ranks (pipeline stages differ), so
    that one line describes the job."""
    figures = theoretical_bytes(chunks, optimizer)
    values = torch.tensor([float(v) for v in figures.values()], dtype=torch.float64, device=groups.device)
    comm.all_reduce_max(values, groups.world)
    return {name: int(value) for name, value in zip(figures, values.tolist())}


def _activation_shape(run: Run) -> tuple:
    """The [s, b, h] activation passed between pipeline stages: the sequence split over the context
    ranks, and over the tensor ranks with sequence parallelism."""
    t = run.config.training
    seq = t.seq_length // run.groups.cp_size
    seq //= run.groups.tp_size if run.execution.sequence_parallel and run.groups.tp_size > 1 else 1
    return (seq, t.micro_batch_size, run.model_config.hidden_size)


def _forward_backward(run: Run, data_iterator, forward_only: bool, num_microbatches: int) -> list:
    p = run.config.parallel
    per_token = run.config.training.calculate_per_token_loss
    schedule = get_forward_backward_func(run.groups.pp_size, len(run.chunks))
    return schedule(forward_step_func=run.forward_step_func, data_iterator=data_iterator,
                    model_chunks=run.chunks, num_microbatches=num_microbatches, groups=run.groups,
                    forward_only=forward_only, scale_loss=run.optimizer.scale_loss,
                    tensor_shape=_activation_shape(run), dtype=run.execution.params_dtype,
                    overlap_p2p_comm=p.overlap_p2p_comm, overlap_p2p_comm_warmup_flush=p.overlap_p2p_comm_warmup_flush,
                    microbatch_group_size=p.microbatch_group_size_per_vp_stage, loss_divisor=1 if per_token else None)


def local_sums(reported: list) -> dict:
    """{name: [sum, count]} of one step's reported values, summed over its micro-batches, left on
    the device (no communication). Each reported value is such a pair (count: the tokens it covers);
    only the last pipeline stage has values."""
    names = sorted(reported[0]) if reported else []
    return {name: torch.stack([r[name].detach().float() for r in reported]).sum(dim=0) for name in names}


def reduce_reported(run: Run, steps: list, token_weighted: bool = False) -> dict:
    """{name: value} over the steps' `local_sums` and the data-parallel ranks, with one all-reduce
    for all of them: the mean over steps of each step's sum/count (the training log line, as
    Megatron-LM), or with `token_weighted` the total sum over the total count (evaluation)."""
    names = sorted(steps[0]) if steps else []
    if not names:
        return {}
    pairs = torch.stack([torch.stack([step[name] for name in names]) for step in steps])  # [steps, names, 2]
    comm.all_reduce(pairs, run.groups.dp_cp)
    if token_weighted:
        totals = pairs.sum(dim=0)
        means = (totals[:, 0] / totals[:, 1]).tolist()
    else:
        means = (pairs[..., 0] / pairs[..., 1]).mean(dim=0).tolist()
    return dict(zip(names, means))


def _per_token_gradient_scale(run: Run, reported: list) -> float:
    """--calculate-per-token-loss: backward ran on loss sums, and the data-parallel reduction
    averaged them over the D data x context ranks; times D / (tokens in the global batch) this is
    the gradient of the mean over every token of the global batch. The count comes from the last
    stage's reported [sum, count] pairs and is sent to every stage."""
    groups = run.groups
    tokens = torch.zeros(1, dtype=torch.float64, device=groups.device)
    if reported:
        name = sorted(reported[0])[0]
        tokens += sum(float(r[name][1]) for r in reported)
    comm.all_reduce(tokens, groups.dp_cp)
    comm.all_reduce(tokens, groups.pp)
    return comm.size(groups.dp_cp) / max(tokens.item(), 1.0)


def train_step(run: Run, data_iterator, num_microbatches: Optional[int] = None
               ) -> tuple[dict, bool, Optional[float]]:
    """One optimizer step over `num_microbatches` (default: the full global batch's). Returns the
    step's `local_sums` (on the device: reduced only when logged), whether the update was applied,
    and the gradient norm."""
    num_microbatches = num_microbatches or run.num_microbatches
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    if run.straggler is not None:
        run.straggler.start()
    reported = _forward_backward(run, data_iterator, forward_only=False, num_microbatches=num_microbatches)
    if run.straggler is not None:
        run.straggler.stop()
    if run.guard is not None:
        run.guard.observe_losses(reported)
    finalize_model_grads(run.chunks, run.groups)
    sums = local_sums(reported)
    if run.model_config.num_experts is not None:
        finish_moe_step(run.chunks, run.groups)
        sums.update(aux_loss_log_values(run.chunks, run.model_config, run.groups, num_microbatches,
                                        per_layer=run.config.logging.moe_per_layer_logging))
    if run.config.training.calculate_per_token_loss:
        run.optimizer.scale_grads(_per_token_gradient_scale(run, reported))
    _empty_unused_memory(run, level=1)
    applied, grad_norm = run.optimizer.step(run.guard)
    if applied:
        run.scheduler.step(num_microbatches * run.config.training.micro_batch_size * run.groups.dp_size)
    _empty_unused_memory(run, level=2)
    return sums, applied, grad_norm


def _empty_unused_memory(run: Run, level: int) -> None:
    """--empty-unused-memory-level: 1 after each forward-backward, 2 also after the optimizer step."""
    if run.config.training.empty_unused_memory_level >= level:
        utils.empty_cache(run.groups.device)


def _manual_gc(run: Run, iteration: Optional[int] = None) -> None:
    """--manual-gc: collect every --manual-gc-interval iterations (`iteration` given) or around an
    evaluation (with --manual-gc-eval), on every rank at the same point."""
    t = run.config.training
    if not t.manual_gc:
        return
    if iteration is None and t.manual_gc_eval:
        gc.collect()
    elif iteration is not None and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
        gc.collect()


def evaluate(run: Run, data_iterator, eval_iters: int) -> dict:
    """Mean of each reported value over every token of `eval_iters` global batches."""
    _manual_gc(run)
    for chunk in run.chunks:
        chunk.module.eval()
    steps = []
    with torch.no_grad():
        for _ in range(eval_iters):
            steps.append(local_sums(_forward_backward(run, data_iterator, True, run.num_microbatches)))
            _empty_unused_memory(run, level=1)
    for chunk in run.chunks:
        chunk.module.train()
    _manual_gc(run)
    return reduce_reported(run, steps, token_weighted=True)


def _loader(run: Run, dataset, consumed: int):
    """One data iterator for this rank (the schedules hand each micro-batch to every model chunk
    that runs it); None without data."""
    d = run.config.data
    loader = build_loader(dataset, consumed, run.config.training.micro_batch_size, run.groups, d.num_workers,
                          d.dataloader_type, d.data_sharding)
    if loader is None:
        return None
    return endless(loader) if d.dataloader_type == "cyclic" else iter(loader)


class _Window:
    """The steps between two log lines: their local loss sums, FLOPs and tokens, and the time since
    the window began (the device synchronized at both ends). The peak memory shown is the window's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps = []  # the local loss sums of the steps whose loss counts (not NaN/Inf-vetoed ones)
        self.flops = []
        self.tokens = []
        self.restart()

    @property
    def iterations(self) -> int:
        return len(self.flops)

    def add(self, losses: Optional[dict], flops: float, tokens: int) -> None:
        if losses is not None:
            self.steps.append(losses)
        self.flops.append(flops)
        self.tokens.append(tokens)

    def restart(self) -> None:
        """Starts (or restarts, after an evaluation or a save) the clock and the peak-memory
        counter; the steps before a restart are not timed, so the averages cover the steps since."""
        utils.synchronize(self.device)
        utils.reset_peak_memory(self.device)
        self.timed_from = self.iterations
        self.start = time.perf_counter()

    def timing(self) -> tuple[float, float, int]:
        """(seconds per step, FLOPs, tokens) of the timed steps."""
        utils.synchronize(self.device)
        timed = max(1, self.iterations - self.timed_from)
        return ((time.perf_counter() - self.start) / timed, sum(self.flops[self.timed_from:]),
                sum(self.tokens[self.timed_from:]))


def train(run: Run, train_dataset, valid_dataset, state: Optional[TrainState] = None,
          exits: Optional[ExitConditions] = None) -> TrainState:
    """Runs --train-iters optimizer steps (or until an exit condition); returns the final state.
    Logs from the logging rank; evaluates every --eval-interval iterations, continuing through the
    validation set; saves checkpoints at --save-interval and before an early exit."""
    groups, t = run.groups, run.config.training
    state = state or TrainState()
    if state.iteration >= t.train_iters:
        return state
    train_iterator = _loader(run, train_dataset, state.consumed_train_samples)
    valid_iterator = _valid_iterator(run, valid_dataset, state)
    profiler = _start_training(run)
    window = _Window(groups.device)
    while state.iteration < t.train_iters:
        # No device synchronize and no host read of the loss inside a step: steps queue back to back
        # (a parameter gather left in flight overlaps the next forward); the window is timed and its
        # losses reduced at log (and TensorBoard) intervals.
        global_batch = run.batches.global_batch_size_at(state.consumed_train_samples)
        if state.iteration in t.iterations_to_skip:
            train_iterator = _skip_iteration(run, train_dataset, state, global_batch)
            continue
        _set_iteration(run, state.iteration + 1)
        profiler.before_step(state.iteration)
        losses, applied, grad_norm = train_step(run, train_iterator, global_batch // run.batches.micro_batch_times_dp)
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_train_samples += global_batch
        if not applied:
            state.skipped_iterations += 1
            if grad_norm is not None or (run.guard is not None and run.guard.vetoed):
                state.nan_iterations += 1
        flops = flops_per_iteration(run.model_config, global_batch, t.seq_length)
        state.floating_point_operations += flops
        vetoed = run.guard is not None and run.guard.vetoed  # a NaN/Inf step's loss stays out of the average
        window.add(None if vetoed else losses, flops, global_batch * t.seq_length)
        window = _report_step(run, state, window, losses, global_batch, grad_norm)
        _manual_gc(run, state.iteration)
        if valid_iterator is not None and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
            _log_evaluation(run, valid_iterator, state, f"iteration {state.iteration}")
            window.restart()
        saved = run.checkpointer.last_saved_iteration if run.checkpointer is not None else None
        state.exit_reason = _save_and_check_exit(run, state, exits)
        if run.checkpointer is not None and run.checkpointer.last_saved_iteration != saved:
            window.restart()  # the save's time is not a training step's
        if state.exit_reason is not None:
            run.printer(f"> exiting after iteration {state.iteration}: {state.exit_reason}")
            break
    return state


def _start_training(run: Run) -> StepProfiler:
    """Before the first step: the saved RNG states back, the model in training mode, Python's
    collector under --manual-gc's control; returns the profiler of the steps."""
    config, groups = run.config, run.groups
    if run.checkpointer is not None:
        run.checkpointer.restore_rng()
    profiler = StepProfiler(config.logging, groups.global_rank, groups.device)
    for chunk in run.chunks:
        chunk.module.train()
    if config.training.manual_gc:
        gc.disable()
        gc.collect()
    return profiler


def _report_step(run: Run, state: TrainState, window: _Window, losses: dict, global_batch: int,
                 grad_norm: Optional[float]) -> _Window:
    """TensorBoard and the log line at their intervals (and the straggler report with the log line);
    returns the window the next steps add to (a new one after a log line)."""
    t, log = run.config.training, run.config.logging
    to_tensorboard = log.tensorboard_dir is not None and state.iteration % log.tensorboard_log_interval == 0
    to_log = state.iteration % log.log_interval == 0 or state.iteration == t.train_iters
    if to_tensorboard or to_log:
        statistics = _step_statistics(run, global_batch, grad_norm)
    if to_tensorboard:
        _write_tensorboard(run, state, reduce_reported(run, [losses]), statistics)
    if to_log:
        _log_iteration(run, state, window, statistics)
        window = _Window(run.groups.device)
        if run.straggler is not None:
            _log_straggler(run, state.iteration)
    return window


def _valid_iterator(run: Run, valid_dataset, state: TrainState):
    """The validation loader, built once: each evaluation continues where the previous one (or
    the checkpoint's consumed validation samples) stopped, as in Megatron-LM."""
    if valid_dataset is None or run.config.training.eval_iters <= 0:
        return None
    if state.consumed_valid_samples >= len(valid_dataset):
        run.printer(f"NOTE: the validation set ({len(valid_dataset)} samples) was used up by earlier evaluations "
                    f"({state.consumed_valid_samples} samples): no further validation")
        return None
    return _loader(run, valid_dataset, state.consumed_valid_samples)


def _step_statistics(run: Run, global_batch: int, grad_norm: Optional[float]) -> dict:
    """Values of the iteration just run that the log line and TensorBoard show."""
    log = run.config.logging
    values = {"learning-rate": run.scheduler.get_lr(), "decoupled-learning-rate": run.scheduler.get_decoupled_lr(),
              "batch-size": global_batch, "grad-norm": grad_norm, "loss-scale": run.optimizer.loss_scale(),
              "params-norm": run.optimizer.params_norm() if log.log_params_norm else None,
              "num-zeros": run.optimizer.count_zeros() if log.log_num_zeros_in_grad else None}
    return values


def _set_iteration(run: Run, iteration: int) -> None:
    """The iteration about to run (1-based, as logged), for the guards' and faults' messages."""
    for hook in (run.guard, run.faults):
        if hook is not None:
            hook.iteration = iteration


def _skip_iteration(run: Run, train_dataset, state: TrainState, global_batch: int):
    """--iterations-to-skip: the step's samples are consumed untrained (Megatron's dummy step); the
    data iterator restarts past them. Returns the new iterator."""
    state.iteration += 1
    state.consumed_train_samples += global_batch
    run.printer(f"> iteration {state.iteration} skipped (--iterations-to-skip): its {global_batch} "
                "samples are not trained on")
    return _loader(run, train_dataset, state.consumed_train_samples)


def _log_straggler(run: Run, iteration: int) -> None:
    report = run.straggler.report(iteration)
    if report is not None:
        print(report, flush=True)


def _save_and_check_exit(run: Run, state: TrainState, exits: Optional[ExitConditions]) -> Optional[str]:
    """Saves at --save-interval; returns why to stop now (saving first when --save is given)."""
    options = run.config.checkpoint
    if options.save and options.save_interval and state.iteration % options.save_interval == 0:
        _save(run, state)
    reason = exits.check(state.iteration) if exits is not None else None
    if reason is not None and options.save and run.checkpointer.last_saved_iteration != state.iteration:
        _save(run, state)
    return reason


def _save(run: Run, state: TrainState) -> None:
    run.checkpointer.save(run, state, run.vocab_size)
    if run.progress is not None:
        run.progress.saved(state)


def _log_iteration(run: Run, state: TrainState, window: _Window, statistics: dict) -> None:
    """Megatron's iteration line over the window (every rank takes part in reducing the losses)."""
    groups, log = run.groups, run.config.logging
    seconds, flops, tokens = window.timing()
    losses = reduce_reported(run, window.steps)
    if not groups.is_logging_rank:
        return
    timed_steps = max(1, window.iterations - window.timed_from)
    world = groups.world_size
    tflops = flops / (seconds * timed_steps * 1e12 * world)
    tokens_per_gpu = tokens / (seconds * timed_steps) / world
    peak_gb = utils.peak_memory_bytes(groups.device) / 1e9
    print(iteration_line(iteration=state.iteration, train_iters=run.config.training.train_iters,
                         consumed_samples=state.consumed_train_samples, elapsed_ms=seconds * 1000.0,
                         throughput=(tflops, tokens_per_gpu) if log.log_throughput else None,
                         learning_rate=statistics["learning-rate"],
                         decoupled_learning_rate=statistics["decoupled-learning-rate"],
                         global_batch_size=statistics["batch-size"], losses=losses,
                         loss_scale=statistics["loss-scale"], grad_norm=statistics["grad-norm"],
                         params_norm=statistics["params-norm"], num_zeros=statistics["num-zeros"],
                         skipped=state.skipped_iterations, nan=state.nan_iterations, peak_memory_gb=peak_gb), flush=True)
    values = {"peak-memory-gb": peak_gb}
    if log.log_throughput:
        values.update({"throughput-tflops-per-gpu": tflops, "tokens-per-second-per-gpu": tokens_per_gpu})
    if log.log_timers_to_tensorboard:
        values["iteration-time"] = seconds
    run.tensorboard.scalars(state.iteration, values)


def _write_tensorboard(run: Run, state: TrainState, losses: dict, statistics: dict) -> None:
    """Megatron's scalars of one iteration, every --tensorboard-log-interval iterations."""
    if run.groups.is_logging_rank:
        run.tensorboard.scalars(state.iteration, tensorboard_scalars(
            run.config.logging, losses, statistics, run.groups.world_size, utils.memory_stats(run.groups.device)))


def _log_evaluation(run: Run, iterator, state: TrainState, label: str, split: str = "validation") -> dict:
    """Evaluates --eval-iters global batches of `iterator`; prints Megatron's validation line and
    writes TensorBoard. Validation advances `consumed_valid_samples` (saved in checkpoints)."""
    t = run.config.training
    values = evaluate(run, iterator, t.eval_iters)
    if split == "validation":
        state.consumed_valid_samples += t.eval_iters * run.global_batch_size
    if run.groups.is_logging_rank:
        text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_ppl(value):.6E}" for name, value in values.items())
        bar = "-" * (len(text) + 40)
        print(f"{bar}\n validation loss at {label} | {text} |\n{bar}", flush=True)
        scalars = {}
        for name, value in values.items():
            scalars[f"{name} {split}"] = value
            if run.config.logging.log_validation_ppl_to_tensorboard:
                scalars[f"{name} {split} ppl"] = _ppl(value)
        run.tensorboard.scalars(state.iteration, scalars)
        run.tensorboard.scalars(state.consumed_train_samples, {f"{name} vs samples": value
                                                               for name, value in scalars.items()})
    return values


def _ppl(loss: float) -> float:
    return math.exp(min(20.0, loss))


def _final_evaluations(run: Run, state: TrainState, valid_iterator, test_dataset) -> None:
    """After training (not after an early exit): the validation set, continued, then the test set,
    as Megatron-LM does."""
    if state.exit_reason is not None or run.config.training.eval_iters <= 0:
        return
    if valid_iterator is not None:
        _log_evaluation(run, valid_iterator, state, f"iteration {state.iteration} on validation set")
    test_iterator = _loader(run, test_dataset, 0) if test_dataset is not None else None
    if test_iterator is not None:
        _log_evaluation(run, test_iterator, state, f"iteration {state.iteration} on test set", split="test")


def dataset_sizes(config: Config, batches: BatchSchedule) -> tuple:
    """Samples the train, validation and test datasets must provide (Megatron-LM's counts): the
    training samples, --eval-iters global batches for each evaluation during training plus the
    final one, and one evaluation's worth of test samples."""
    t = config.training
    evaluations = t.train_iters // t.eval_interval + 1
    eval_iters = max(t.eval_iters, 0)  # 0 or negative: no evaluation, as in Megatron-LM
    train_samples = t.train_samples if t.train_samples is not None else t.train_iters * batches.global_batch_size
    return (train_samples, evaluations * eval_iters * batches.global_batch_size,
            eval_iters * batches.global_batch_size)


def pretrain(config: Config, *, forward_step_func: Callable, datasets_provider: Callable,
             vocab_size: int, check_inputs: Optional[Callable] = None) -> TrainState:
    """Validate (flags, then input files with `check_inputs(config)`), initialize, build, load a
    checkpoint, load data, train, save, and evaluate the validation and test sets at the end (as
    Megatron does)."""
    run = setup(config, forward_step_func, vocab_size, check_inputs)
    config = run.config  # with --use-checkpoint-args, the checkpoint's model flags
    state = TrainState()
    with Watch(run.failure_report, lambda: state.iteration), MemoryWatch(run, lambda: state.iteration):
        if run.checkpoint_to_load is not None:
            state = run.checkpointer.load(run, *run.checkpoint_to_load)
        t = config.training
        train_ds, valid_ds, test_ds = datasets_provider(config, run.groups, dataset_sizes(config, run.batches))
        exits = ExitConditions(t, run.groups, _JOB_START_TIME)
        run = dataclasses.replace(
            run, tensorboard=TensorBoardWriter(config.logging.tensorboard_dir if run.groups.is_logging_rank else None),
            progress=ProgressLog(config, run.groups, _JOB_START_TIME))
        run.progress.start(state)
        try:
            state = train(run, train_ds, valid_ds, state, exits)
            options = config.checkpoint
            if options.save and state.iteration > 0 and run.checkpointer.last_saved_iteration != state.iteration:
                _save(run, state)
            if run.checkpointer is not None:
                run.checkpointer.wait()
            run.progress.finished(state)
            _final_evaluations(run, state, _valid_iterator(run, valid_ds, state), test_ds)
        finally:
            exits.restore()
            run.tensorboard.close()
            gc.enable()
        if torch.distributed.is_initialized():
            comm.barrier()
    if run.save_lock is not None:
        run.save_lock.release()
    return state
