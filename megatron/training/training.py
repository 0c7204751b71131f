"""The training loop: pretrain -> train (train_step, evaluate) with Megatron's log line."""
import dataclasses
import datetime
import time
from functools import partial
from typing import Callable, Optional

import torch

from megatron.core import utils
from megatron.core.distributed import comm
from megatron.core.distributed.ddp import finalize_model_grads
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training import builders
from megatron.training.arguments import format_config
from megatron.training.checkpointing import (
    Checkpointer,
    apply_checkpoint_args,
    architecture,
    checkpoint_dir,
    check_architecture,
    locate,
    read_common,
)
from megatron.training.config import Config
from megatron.training.data import build_loader
from megatron.training.exits import ExitConditions
from megatron.training.failures import FailureReport, Watch
from megatron.training.fault_injection import FaultInjector
from megatron.training.guards import StepGuard
from megatron.training.initialize import initialize_distributed, world_size_from_env
from megatron.training.logging import TensorBoardWriter, flops_per_iteration, iteration_line
from megatron.training.memory import memory_report
from megatron.training.oom import MemoryWatch
from megatron.training.profiling import StepProfiler
from megatron.training.straggler import StragglerReport
from megatron.training.validation import validate

_JOB_START_TIME = time.time()  # --exit-duration-in-mins counts from here (module import ~ job start)


@dataclasses.dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    exit_reason: Optional[str] = None  # why training stopped before --train-iters (not saved)


@dataclasses.dataclass
class Run:
    """Everything a step needs, built once by `setup`."""

    config: Config
    groups: object
    model_config: object
    chunks: list
    optimizer: object
    scheduler: object
    forward_step_func: Callable
    global_batch_size: int
    num_microbatches: int
    printer: Callable
    vocab_size: int
    checkpointer: Optional[Checkpointer]
    checkpoint_to_load: Optional[tuple]  # (directory, common.json) found by --load
    guard: Optional[StepGuard] = None                  # NaN/Inf and spike checks of every step
    failure_report: Optional[FailureReport] = None     # names dead or hung ranks (torchrun jobs)
    straggler: Optional[StragglerReport] = None        # --log-straggler
    faults: Optional[FaultInjector] = None             # test-only (MEGATRON_TEST_FAULTS)


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def setup(config: Config, forward_step_func: Callable, vocab_size: int) -> Run:
    """Validates the flags (and the checkpoint to load against them), joins the process groups,
    builds model, DDP and optimizer."""
    notes, to_load = _find_checkpoint(config)
    notes += validate(config, world_size_from_env())
    groups, rng_tracker = initialize_distributed(config)
    print_rank_0(format_config(config))
    model_config = builders.transformer_config(config, vocab_size)
    if to_load is not None:
        notes += check_architecture(to_load[0], to_load[1]["model"], architecture(model_config, vocab_size))
    for note in notes:
        print_rank_0(f"NOTE: {note}")
    chunks = builders.build_model_chunks(config, groups, model_config, rng_tracker)
    chunks = builders.wrap_data_parallel(chunks, config, groups)
    optimizer, scheduler = builders.build_optimizer(config, chunks, groups)
    t = config.training
    global_batch = t.global_batch_size or t.micro_batch_size * groups.dp_size
    num_microbatches = global_batch // (t.micro_batch_size * groups.dp_size)
    params = sum(p.numel() for c in chunks for p in c.module.parameters())
    print_rank_0(f"> parameters on (tensor, pipeline) rank ({groups.tp_rank}, {groups.pp_rank}): {params}")
    print_rank_0(f"> padded vocab size: {model_config.vocab_size}, micro-batches per step: {num_microbatches}, "
                 f"data-parallel size: {groups.dp_size}, context-parallel size: {groups.cp_size}, "
                 f"device: {groups.device}")
    report = memory_report(config, chunks, optimizer, groups)
    if groups.dp_rank == 0 and groups.cp_rank == 0:
        print(report, flush=True)
    checkpointer = (Checkpointer(config, groups, rng_tracker, print_rank_0)
                    if config.checkpoint.save or to_load is not None else None)
    run = Run(config, groups, model_config, chunks, optimizer, scheduler, forward_step_func, global_batch,
              num_microbatches, print_rank_0, vocab_size, checkpointer, to_load)
    _add_reliability(run)
    return run


def _add_reliability(run: Run) -> None:
    """The per-step guards, the failure report, the straggler report and the test-only faults."""
    config, groups = run.config, run.groups
    run.guard = StepGuard.build(config.training, groups, print_rank_0, partial(_last_checkpoint, run))
    run.failure_report = FailureReport.connect(groups.global_rank, groups.world_size, datetime.timedelta(
        minutes=config.parallel.distributed_timeout_minutes))
    run.straggler = StragglerReport(config.logging, groups) if config.logging.log_straggler else None
    run.faults = FaultInjector.from_environment(groups.global_rank)
    if run.faults is not None:
        run.forward_step_func = run.faults.wrap(run.forward_step_func)


def _last_checkpoint(run: Run) -> Optional[str]:
    """The directory of the newest checkpoint this run saved or loaded, if any."""
    options, checkpointer = run.config.checkpoint, run.checkpointer
    if checkpointer is not None and checkpointer.last_saved_iteration is not None:
        return checkpoint_dir(options.save or options.load, checkpointer.last_saved_iteration)
    return None


def _find_checkpoint(config: Config) -> tuple[list, Optional[tuple]]:
    """(notes, (directory, common.json) of the checkpoint --load names, or None). With
    --use-checkpoint-args the model flags are taken from it here, before validation."""
    options = config.checkpoint
    if not options.load:
        return [], None
    directory, note = locate(options.load, options.ckpt_step)
    if directory is None:
        return [note], None
    common = read_common(directory)
    notes = apply_checkpoint_args(config, common) if options.use_checkpoint_args else []
    return notes, (directory, common)


def _activation_shape(run: Run) -> tuple:
    """The [s, b, h] activation passed between pipeline stages: the sequence split over the context
    ranks, and over the tensor ranks with sequence parallelism."""
    t = run.config.training
    seq = t.seq_length // run.groups.cp_size
    seq //= run.groups.tp_size if run.model_config.sequence_parallel and run.groups.tp_size > 1 else 1
    return (seq, t.micro_batch_size, run.model_config.hidden_size)


def _forward_backward(run: Run, data_iterators: list, forward_only: bool) -> list:
    schedule = get_forward_backward_func(run.groups.pp_size, len(run.chunks))
    return schedule(forward_step_func=run.forward_step_func, data_iterator=data_iterators,
                    model_chunks=run.chunks, num_microbatches=run.num_microbatches, groups=run.groups,
                    forward_only=forward_only, scale_loss=run.optimizer.scale_loss,
                    tensor_shape=_activation_shape(run), dtype=run.model_config.params_dtype)


def reduce_reported(run: Run, reported: list) -> dict:
    """{name: value} averaged over micro-batches and data-parallel ranks. Each reported value is a
    tensor [sum, count]; the result is sum/count. Only the last pipeline stage has values; the
    result is then sent to every rank of the pipeline (so any rank can log it)."""
    names = sorted(reported[0]) if reported else []
    totals = {}
    for name in names:
        pair = torch.stack([r[name].detach().float() for r in reported]).sum(dim=0)
        comm.all_reduce(pair, run.groups.dp_cp)
        totals[name] = (pair[0] / pair[1]).item()
    return totals


def train_step(run: Run, data_iterators: list) -> tuple[dict, bool, Optional[float]]:
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    if run.straggler is not None:
        run.straggler.start()
    reported = _forward_backward(run, data_iterators, forward_only=False)
    if run.straggler is not None:
        run.straggler.stop()
    if run.guard is not None:
        run.guard.observe_losses(reported)
    finalize_model_grads(run.chunks, run.groups)
    applied, grad_norm = run.optimizer.step(run.guard)
    if applied:
        run.scheduler.step()
    return reduce_reported(run, reported), applied, grad_norm


def evaluate(run: Run, data_iterators: list, eval_iters: int) -> dict:
    for chunk in run.chunks:
        chunk.module.eval()
    sums = {}
    with torch.no_grad():
        for _ in range(eval_iters):
            for name, value in reduce_reported(run, _forward_backward(run, data_iterators, True)).items():
                sums[name] = sums.get(name, 0.0) + value / eval_iters
    for chunk in run.chunks:
        chunk.module.train()
    return sums


def _loaders(run: Run, dataset, consumed: int) -> Optional[list]:
    loaders = [build_loader(dataset, consumed, run.config.training.micro_batch_size, run.groups,
                            run.config.data.num_workers) for _ in run.chunks]
    return None if loaders[0] is None else [iter(loader) for loader in loaders]


def train(run: Run, train_dataset, valid_dataset, state: Optional[TrainState] = None,
          exits: Optional[ExitConditions] = None) -> TrainState:
    """Runs --train-iters optimizer steps (or until an exit condition); returns the final state.
    Logs from the logging rank; saves checkpoints at --save-interval and before an early exit."""
    config, groups = run.config, run.groups
    t, log = config.training, config.logging
    state = state or TrainState()
    if state.iteration >= t.train_iters:
        return state
    train_iterators = _loaders(run, train_dataset, state.consumed_train_samples)
    if run.checkpointer is not None:
        run.checkpointer.restore_rng()
    tensorboard = TensorBoardWriter(log.tensorboard_dir if groups.is_logging_rank else None)
    flops = flops_per_iteration(run.model_config, run.global_batch_size, t.seq_length)
    tokens = run.global_batch_size * t.seq_length
    window = {"time": 0.0, "iters": 0, "loss_iters": 0, "losses": {}}
    profiler = StepProfiler(log, groups.global_rank, groups.device)
    for chunk in run.chunks:
        chunk.module.train()
    while state.iteration < t.train_iters:
        if state.iteration in t.iterations_to_skip:
            train_iterators = _skip_iteration(run, train_dataset, state)
            continue
        _set_iteration(run, state.iteration + 1)
        profiler.before_step(state.iteration)
        utils.reset_peak_memory(groups.device)
        utils.synchronize(groups.device)
        start = time.perf_counter()
        losses, applied, grad_norm = train_step(run, train_iterators)
        utils.synchronize(groups.device)
        elapsed = time.perf_counter() - start
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_train_samples += run.global_batch_size
        if not applied:
            state.skipped_iterations += 1
            if grad_norm is not None or (run.guard is not None and run.guard.vetoed):
                state.nan_iterations += 1
        window["time"] += elapsed
        window["iters"] += 1
        if run.guard is None or not run.guard.vetoed:  # a NaN/Inf step's loss stays out of the average
            window["loss_iters"] += 1
            for name, value in losses.items():
                window["losses"][name] = window["losses"].get(name, 0.0) + value
        if state.iteration % log.log_interval == 0 or state.iteration == t.train_iters:
            _log_iteration(run, state, window, flops, tokens, grad_norm, tensorboard)
            window = {"time": 0.0, "iters": 0, "loss_iters": 0, "losses": {}}
            if run.straggler is not None:
                _log_straggler(run, state.iteration)
        if valid_dataset is not None and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
            _log_evaluation(run, valid_dataset, state, "iteration " + str(state.iteration), tensorboard)
        state.exit_reason = _save_and_check_exit(run, state, exits)
        if state.exit_reason is not None:
            run.printer(f"> exiting after iteration {state.iteration}: {state.exit_reason}")
            break
    tensorboard.close()
    return state


def _set_iteration(run: Run, iteration: int) -> None:
    """The iteration about to run (1-based, as logged), for the guards' and faults' messages."""
    for hook in (run.guard, run.faults):
        if hook is not None:
            hook.iteration = iteration


def _skip_iteration(run: Run, train_dataset, state: TrainState):
    """--iterations-to-skip: the step's samples are consumed untrained (Megatron's dummy step); the
    data iterators restart past them. Returns the new iterators."""
    state.iteration += 1
    state.consumed_train_samples += run.global_batch_size
    run.printer(f"> iteration {state.iteration} skipped (--iterations-to-skip): its {run.global_batch_size} "
                "samples are not trained on")
    return _loaders(run, train_dataset, state.consumed_train_samples)


def _log_straggler(run: Run, iteration: int) -> None:
    report = run.straggler.report(iteration)
    if report is not None:
        print(report, flush=True)


def _save_and_check_exit(run: Run, state: TrainState, exits: Optional[ExitConditions]) -> Optional[str]:
    """Saves at --save-interval; returns why to stop now (saving first when --save is given)."""
    options = run.config.checkpoint
    if options.save and options.save_interval and state.iteration % options.save_interval == 0:
        run.checkpointer.save(run, state, run.vocab_size)
    reason = exits.check(state.iteration) if exits is not None else None
    if reason is not None and options.save and run.checkpointer.last_saved_iteration != state.iteration:
        run.checkpointer.save(run, state, run.vocab_size)
    return reason


def _log_iteration(run: Run, state: TrainState, window: dict, flops: float, tokens: int,
                   grad_norm: Optional[float], tensorboard: TensorBoardWriter) -> None:
    groups = run.groups
    iters = window["iters"]
    seconds = window["time"] / iters
    tflops = flops / (seconds * 1e12 * groups.world_size)
    tokens_per_gpu = tokens / seconds / groups.world_size
    peak_gb = utils.peak_memory_bytes(groups.device) / 1e9
    losses = {name: value / window["loss_iters"] for name, value in window["losses"].items()}
    lr = run.scheduler.get_lr()
    if groups.is_logging_rank:
        print(iteration_line(iteration=state.iteration, train_iters=run.config.training.train_iters,
                             consumed_samples=state.consumed_train_samples, elapsed_ms=seconds * 1000.0,
                             tflops_per_gpu=tflops, tokens_per_gpu=tokens_per_gpu, learning_rate=lr,
                             global_batch_size=run.global_batch_size, losses=losses,
                             loss_scale=run.optimizer.loss_scale(), grad_norm=grad_norm,
                             skipped=state.skipped_iterations, nan=state.nan_iterations,
                             peak_memory_gb=peak_gb), flush=True)
        tensorboard.scalars(state.iteration, {
            **{name: value for name, value in losses.items()}, "learning-rate": lr, "grad-norm": grad_norm,
            "loss-scale": run.optimizer.loss_scale(), "throughput-tflops-per-gpu": tflops,
            "tokens-per-second-per-gpu": tokens_per_gpu, "peak-memory-gb": peak_gb})


def _log_evaluation(run: Run, dataset, state: TrainState, label: str, tensorboard: TensorBoardWriter) -> dict:
    iterators = _loaders(run, dataset, 0)
    if iterators is None:
        return {}
    values = evaluate(run, iterators, run.config.training.eval_iters)
    if run.groups.is_logging_rank:
        text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_ppl(value):.6E}" for name, value in values.items())
        bar = "-" * (len(text) + 40)
        print(f"{bar}\n validation loss at {label} | {text}\n{bar}", flush=True)
        tensorboard.scalars(state.iteration, {f"validation/{name}": value for name, value in values.items()})
    return values


def _ppl(loss: float) -> float:
    import math

    return math.exp(min(20.0, loss))


def _final_save(run: Run, state: TrainState) -> None:
    options = run.config.checkpoint
    if options.save and state.iteration > 0 and run.checkpointer.last_saved_iteration != state.iteration:
        run.checkpointer.save(run, state, run.vocab_size)
    if run.checkpointer is not None:
        run.checkpointer.wait()


def pretrain(config: Config, *, forward_step_func: Callable, datasets_provider: Callable,
             vocab_size: int) -> TrainState:
    """Validate, initialize, build, load a checkpoint, load data, train, save, and evaluate at the
    end (as Megatron does). A failure after start-up names its cause on every rank (see `failures`
    and `oom`)."""
    run = setup(config, forward_step_func, vocab_size)
    state = TrainState()
    with Watch(run.failure_report, lambda: state.iteration), MemoryWatch(run, lambda: state.iteration):
        if run.checkpoint_to_load is not None:
            state = run.checkpointer.load(run, *run.checkpoint_to_load, TrainState)
        t = config.training
        evaluations = t.train_iters // t.eval_interval + 1
        num_samples = (t.train_iters * run.global_batch_size,
                       evaluations * t.eval_iters * run.global_batch_size,
                       t.eval_iters * run.global_batch_size)
        train_ds, valid_ds, test_ds = datasets_provider(config, run.groups, num_samples)
        exits = ExitConditions(t, run.groups, _JOB_START_TIME)
        try:
            state = train(run, train_ds, valid_ds, state, exits)
        finally:
            exits.restore()
        _final_save(run, state)
        if (state.exit_reason is None and valid_ds is not None and t.eval_iters > 0
                and state.iteration % t.eval_interval != 0):
            _log_evaluation(run, valid_ds, state, "the end of training", TensorBoardWriter(None))
        if torch.distributed.is_initialized():
            comm.barrier()
    return state
