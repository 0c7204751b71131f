"""The training loop: pretrain -> train (train_step, evaluate) with Megatron's log line."""
import dataclasses
import time
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
    check_architecture,
    locate,
    read_common,
)
from megatron.training.config import Config
from megatron.training.data import build_loader
from megatron.training.exits import ExitConditions
from megatron.training.initialize import initialize_distributed, world_size_from_env
from megatron.training.logging import TensorBoardWriter, flops_per_iteration, iteration_line
from megatron.training.memory import memory_report
from megatron.training.profiling import StepProfiler
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
    attention_report: str = ""


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
    model_config, attention_report = builders.resolve_attention(model_config, config, groups)
    print_rank_0(f"> {attention_report}")
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
    return Run(config, groups, model_config, chunks, optimizer, scheduler, forward_step_func, global_batch,
               num_microbatches, print_rank_0, vocab_size, checkpointer, to_load, attention_report)


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


def _forward_backward(run: Run, data_iterator, forward_only: bool) -> list:
    p = run.config.parallel
    schedule = get_forward_backward_func(run.groups.pp_size, len(run.chunks))
    return schedule(forward_step_func=run.forward_step_func, data_iterator=data_iterator,
                    model_chunks=run.chunks, num_microbatches=run.num_microbatches, groups=run.groups,
                    forward_only=forward_only, scale_loss=run.optimizer.scale_loss,
                    tensor_shape=_activation_shape(run), dtype=run.model_config.params_dtype,
                    overlap_p2p_comm=p.overlap_p2p_comm, overlap_p2p_comm_warmup_flush=p.overlap_p2p_comm_warmup_flush,
                    microbatch_group_size=p.microbatch_group_size_per_vp_stage)


def local_sums(reported: list) -> dict:
    """{name: [sum, count]} of one step's reported values, summed over its micro-batches, left on
    the device (no communication)."""
    names = sorted(reported[0]) if reported else []
    return {name: torch.stack([r[name].detach().float() for r in reported]).sum(dim=0) for name in names}


def reduce_reported(run: Run, steps: list) -> dict:
    """{name: value}: each step's sum/count over micro-batches and data-parallel ranks, averaged over
    the steps. `steps` holds `local_sums` of each step; one all-reduce for all of them. Only the last
    pipeline stage has values (the logging rank is one of them)."""
    names = sorted(steps[0]) if steps else []
    if not names:
        return {}
    pairs = torch.stack([torch.stack([step[name] for name in names]) for step in steps])  # [steps, names, 2]
    comm.all_reduce(pairs, run.groups.dp_cp)
    means = (pairs[..., 0] / pairs[..., 1]).mean(dim=0).tolist()
    return dict(zip(names, means))


def train_step(run: Run, data_iterator) -> tuple[dict, bool, Optional[float]]:
    """One optimizer step. Returns the step's `local_sums` (on the device: reduced only when
    logged), whether the update was applied, and the gradient norm."""
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    reported = _forward_backward(run, data_iterator, forward_only=False)
    finalize_model_grads(run.chunks, run.groups)
    applied, grad_norm = run.optimizer.step()
    if applied:
        run.scheduler.step()
    return local_sums(reported), applied, grad_norm


def evaluate(run: Run, data_iterator, eval_iters: int) -> dict:
    for chunk in run.chunks:
        chunk.module.eval()
    with torch.no_grad():
        steps = [local_sums(_forward_backward(run, data_iterator, True)) for _ in range(eval_iters)]
    for chunk in run.chunks:
        chunk.module.train()
    return reduce_reported(run, steps)


def _loader(run: Run, dataset, consumed: int):
    """One data iterator for this rank (the schedules hand each micro-batch to every model chunk
    that runs it); None without data."""
    loader = build_loader(dataset, consumed, run.config.training.micro_batch_size, run.groups,
                          run.config.data.num_workers)
    return None if loader is None else iter(loader)


def train(run: Run, train_dataset, valid_dataset, state: Optional[TrainState] = None,
          exits: Optional[ExitConditions] = None) -> TrainState:
    """Runs --train-iters optimizer steps (or until an exit condition); returns the final state.
    Logs from the logging rank; saves checkpoints at --save-interval and before an early exit."""
    config, groups = run.config, run.groups
    t, log = config.training, config.logging
    state = state or TrainState()
    if state.iteration >= t.train_iters:
        return state
    train_iterator = _loader(run, train_dataset, state.consumed_train_samples)
    if run.checkpointer is not None:
        run.checkpointer.restore_rng()
    tensorboard = TensorBoardWriter(log.tensorboard_dir if groups.is_logging_rank else None)
    flops = flops_per_iteration(run.model_config, run.global_batch_size, t.seq_length)
    tokens = run.global_batch_size * t.seq_length
    profiler = StepProfiler(log, groups.global_rank, groups.device)
    for chunk in run.chunks:
        chunk.module.train()
    window = _Window(groups.device)
    while state.iteration < t.train_iters:
        # No device synchronize and no host read of the loss inside a step: steps queue back to back
        # (a parameter gather left in flight overlaps the next forward); the window is timed and its
        # losses reduced at log intervals.
        profiler.before_step(state.iteration)
        losses, applied, grad_norm = train_step(run, train_iterator)
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_train_samples += run.global_batch_size
        if not applied:
            state.skipped_iterations += 1
            if grad_norm is not None:
                state.nan_iterations += 1
        window.steps.append(losses)
        if state.iteration % log.log_interval == 0 or state.iteration == t.train_iters:
            _log_iteration(run, state, window, flops, tokens, grad_norm, tensorboard)
            window = _Window(groups.device)
        if valid_dataset is not None and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
            _log_evaluation(run, valid_dataset, state, "iteration " + str(state.iteration), tensorboard)
            window.restart()
        saved = run.checkpointer.last_saved_iteration if run.checkpointer is not None else None
        state.exit_reason = _save_and_check_exit(run, state, exits)
        if run.checkpointer is not None and run.checkpointer.last_saved_iteration != saved:
            window.restart()  # the save's time is not a training step's
        if state.exit_reason is not None:
            run.printer(f"> exiting after iteration {state.iteration}: {state.exit_reason}")
            break
    tensorboard.close()
    return state


def _save_and_check_exit(run: Run, state: TrainState, exits: Optional[ExitConditions]) -> Optional[str]:
    """Saves at --save-interval; returns why to stop now (saving first when --save is given)."""
    options = run.config.checkpoint
    if options.save and options.save_interval and state.iteration % options.save_interval == 0:
        run.checkpointer.save(run, state, run.vocab_size)
    reason = exits.check(state.iteration) if exits is not None else None
    if reason is not None and options.save and run.checkpointer.last_saved_iteration != state.iteration:
        run.checkpointer.save(run, state, run.vocab_size)
    return reason


class _Window:
    """The steps between two log lines: their local loss sums, and the time since the window began
    (the device synchronized at both ends). The peak memory shown is the window's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps = []
        self.restart()

    def restart(self) -> None:
        """Starts (or restarts, after an evaluation) the clock and the peak-memory counter; the time
        of steps before a restart is lost, so the average covers the steps since."""
        utils.synchronize(self.device)
        utils.reset_peak_memory(self.device)
        self.timed_from = len(self.steps)
        self.start = time.perf_counter()

    def seconds_per_step(self) -> float:
        utils.synchronize(self.device)
        return (time.perf_counter() - self.start) / max(1, len(self.steps) - self.timed_from)


def _log_iteration(run: Run, state: TrainState, window: _Window, flops: float, tokens: int,
                   grad_norm: Optional[float], tensorboard: TensorBoardWriter) -> None:
    groups = run.groups
    seconds = window.seconds_per_step()
    tflops = flops / (seconds * 1e12 * groups.world_size)
    tokens_per_gpu = tokens / seconds / groups.world_size
    peak_gb = utils.peak_memory_bytes(groups.device) / 1e9
    losses = reduce_reported(run, window.steps)
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
    iterator = _loader(run, dataset, 0)
    if iterator is None:
        return {}
    values = evaluate(run, iterator, run.config.training.eval_iters)
    if run.groups.is_logging_rank:
        text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_ppl(value):.6E}" for name, value in values.items())
        bar = "-" * (len(text) + 40)
        print(f"{bar}\n validation loss at {label} | {text}\n{bar}", flush=True)
        tensorboard.scalars(state.iteration, {f"validation/{name}": value for name, value in values.items()})
    return values


def _ppl(loss: float) -> float:
    import math

    return math.exp(min(20.0, loss))


def pretrain(config: Config, *, forward_step_func: Callable, datasets_provider: Callable,
             vocab_size: int) -> TrainState:
    """Validate, initialize, build, load a checkpoint, load data, train, save, and evaluate at the
    end (as Megatron does)."""
    run = setup(config, forward_step_func, vocab_size)
    state = TrainState()
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
    options = config.checkpoint
    if options.save and state.iteration > 0 and run.checkpointer.last_saved_iteration != state.iteration:
        run.checkpointer.save(run, state, vocab_size)
    if run.checkpointer is not None:
        run.checkpointer.wait()
    if (state.exit_reason is None and valid_ds is not None and t.eval_iters > 0
            and state.iteration % t.eval_interval != 0):
        _log_evaluation(run, valid_ds, state, "the end of training", TensorBoardWriter(None))
    if torch.distributed.is_initialized():
        comm.barrier()
    return state
