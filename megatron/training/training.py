"""The training loop: pretrain -> setup, then train (train_step, evaluate) with Megatron's log line.

`setup` builds a `Trainer` of named parts: the flags, this rank's process groups, the model as built
to train (`state.ModelBundle`), the batch schedule, the step, the reports, the `Supervisor` (every
reliability check and report, `reliability/supervisor.py`) and the `Checkpointer`. The loop's
functions take the parts they use.
"""
import dataclasses
import gc
import logging
import math
import time
from typing import Callable, Optional

import torch

from megatron.core import utils
from megatron.core.distributed import comm
from megatron.core.distributed.ddp import finalize_model_grads
from megatron.core.parallel_state import ParallelGroups
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.fp8 import choose_fp8_linears
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.wgrad_choice import choose_expert_wgrad, rows_per_expert
from megatron.core.transformer.moe.router import aux_loss_log_values, finish_moe_step
from megatron.training import builders
from megatron.training.arguments import format_config
from megatron.training.checkpointing import Checkpointer
from megatron.training.config import Config
from megatron.training.data import build_loader, endless
from megatron.training.initialize import initialize_distributed, world_size_from_env
from megatron.training.memory import memory_report, theoretical_bytes
from megatron.training.reliability.supervisor import Supervisor
from megatron.training.reporting.fast_paths import fast_paths_line
from megatron.training.reporting.logging import (TensorBoardWriter, flops_per_iteration, iteration_line,
                                                 tensorboard_scalars)
from megatron.training.reporting.profiling import StepProfiler
from megatron.training.reporting.progress import ProgressLog
from megatron.training.startup import check_fits_in_memory, startup_checks
from megatron.training.state import BatchSchedule, ModelBundle, TrainState, batch_schedule

_JOB_START_TIME = time.time()  # --exit-duration-in-mins counts from here (module import ~ job start)


@dataclasses.dataclass(frozen=True)
class Reports:
    """What the run tells its user besides the log line's numbers."""

    printer: Callable[[str], None]       # prints on global rank 0
    attention_report: str = ""           # the start-up line naming the attention kernel
    fast_paths: str = ""                 # the start-up line naming each path that runs
    tensorboard: TensorBoardWriter = dataclasses.field(default_factory=lambda: TensorBoardWriter(None))
    progress: Optional[ProgressLog] = None  # --log-progress


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The run as `setup` built it, in named parts (never changed: `pretrain` adds its TensorBoard
    writer and progress log to the reports with `dataclasses.replace`)."""

    config: Config
    groups: ParallelGroups
    model: ModelBundle
    batches: BatchSchedule               # the global batch size of each iteration (--rampup-batch-size)
    forward_step_func: Callable          # wrapped by the test-only faults when MEGATRON_TEST_FAULTS is set
    reports: Reports
    supervisor: Supervisor
    checkpointer: Optional[Checkpointer]  # with --save or a checkpoint to --load


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def setup(config: Config, forward_step_func: Callable, vocab_size: int,
          check_inputs: Optional[Callable] = None) -> Trainer:
    """Validates the flags (and the checkpoint to load against them) and, with `check_inputs(config)`,
    the input files; joins the process groups, builds model, DDP and optimizer."""
    config, model_config, notes, to_load = startup_checks(config, vocab_size, world_size_from_env(), check_inputs)
    if config.logging.logging_level is not None:
        logging.basicConfig(level=config.logging.logging_level)
        logging.getLogger().setLevel(config.logging.logging_level)
    Supervisor.before_start()
    groups, rng_tracker = initialize_distributed(config)
    checkpointer = (Checkpointer(config, groups, rng_tracker, print_rank_0, to_load)
                    if config.checkpoint.save or to_load is not None else None)
    supervisor = Supervisor.start(config, groups, print_rank_0,
                                  checkpointer.last_directory if checkpointer is not None else lambda: None)
    print_rank_0(format_config(config))
    check_fits_in_memory(config, model_config, groups.world_size, groups.device)
    for note in notes:
        print_rank_0(f"NOTE: {note}")
    model, reports = _build(config, groups, model_config, rng_tracker, vocab_size)
    batches = batch_schedule(config.training, groups.dp_size)
    _print_built(config, groups, model, batches.num_microbatches)
    return Trainer(config, groups, model, batches, supervisor.wrap(forward_step_func), reports, supervisor,
                   checkpointer)


def _build(config: Config, groups: ParallelGroups, model_config, rng_tracker, vocab_size: int
           ) -> tuple[ModelBundle, Reports]:
    """The model chunks, their data-parallel wrappers and the optimizer (in the builders' order),
    and the start-up lines naming the attention kernel and the paths that run."""
    execution, attention_report = builders.resolve_attention(model_config, builders.execution_config(config), config,
                                                             groups)
    print_rank_0(f"> {attention_report}")
    chunks = builders.build_model_chunks(config, groups, model_config, execution, rng_tracker)
    fp8_choice = choose_fp8_linears(chunks, config.training.micro_batch_size * config.training.seq_length
                                    // groups.cp_size, groups.device) if execution.fp8 else ""
    execution, wgrad_choice = _choose_expert_wgrad(chunks, config, groups, model_config, execution)
    chunks = builders.wrap_data_parallel(chunks, config, groups)
    optimizer, scheduler = builders.build_optimizer(config, chunks, groups)
    fast_paths = fast_paths_line(execution, no_torch_compile=config.model.no_torch_compile, device=groups.device,
                                 attention_report=attention_report, optimizer=optimizer,
                                 num_experts=model_config.num_experts, fp8_choice=fp8_choice,
                                 wgrad_choice=wgrad_choice)
    print_rank_0(f"> {fast_paths}")
    model = ModelBundle(chunks, optimizer, scheduler, model_config, execution, vocab_size)
    return model, Reports(print_rank_0, attention_report=attention_report, fast_paths=fast_paths)


def _choose_expert_wgrad(chunks: list, config: Config, groups: ParallelGroups, model_config, execution):
    """--moe-grouped-wgrad auto: the routed experts' weight-gradient path timed at start-up
    (moe/wgrad_choice.py) on the rows each local expert gets from a micro-batch under balanced
    routing. Returns (the execution config naming the chosen path where every module took the same
    one, the report for the fast-paths line)."""
    if execution.moe_grouped_wgrad != "auto" or not model_config.num_experts:
        return execution, ""
    tokens = config.training.micro_batch_size * config.training.seq_length // groups.cp_size
    if execution.sequence_parallel and groups.tp_size > 1:
        tokens //= groups.tp_size
    rows = rows_per_expert(tokens, model_config.moe_router_topk, model_config.num_experts,
                           groups.ep_size * groups.etp_size)
    report = choose_expert_wgrad(chunks, rows, groups.device)
    chosen = {module.per_expert_wgrad for chunk in chunks for module in chunk.modules()
              if isinstance(module, GroupedMLP) and module.wgrad_auto}
    if report and len(chosen) == 1:
        execution = dataclasses.replace(execution, moe_grouped_wgrad="per-expert" if chosen.pop() else "grouped-mm")
    return execution, report


def _print_built(config: Config, groups: ParallelGroups, model: ModelBundle, num_microbatches: int) -> None:
    """The parameters on this rank, the layout and the memory report of the built run."""
    params = sum(p.numel() for c in model.chunks for p in c.module.parameters())
    print_rank_0(f"> parameters on (tensor, pipeline) rank ({groups.tp_rank}, {groups.pp_rank}): {params}")
    print_rank_0(f"> padded vocab size: {model.config.padded_vocab_size}, micro-batches per step: {num_microbatches}, "
                 f"data-parallel size: {groups.dp_size}, context-parallel size: {groups.cp_size}, "
                 f"device: {groups.device}")
    figures = _largest_over_ranks(model.chunks, model.optimizer, groups)
    print_rank_0(memory_report(config, model.chunks, model.optimizer, groups, figures=figures))


def _largest_over_ranks(chunks: list, optimizer, groups: ParallelGroups) -> dict:
    """The theoretical memory figures, each the largest over all ranks (pipeline stages differ), so
    that one line describes the job."""
    figures = theoretical_bytes(chunks, optimizer)
    values = torch.tensor([float(v) for v in figures.values()], dtype=torch.float64, device=groups.device)
    comm.all_reduce_max(values, groups.world)
    return {name: int(value) for name, value in zip(figures, values.tolist())}


def _activation_shape(training_config, groups: ParallelGroups, model: ModelBundle) -> tuple:
    """The [s, b, h] activation passed between pipeline stages: the sequence split over the context
    ranks, and over the tensor ranks with sequence parallelism."""
    seq = training_config.seq_length // groups.cp_size
    seq //= groups.tp_size if model.execution.sequence_parallel and groups.tp_size > 1 else 1
    return (seq, training_config.micro_batch_size, model.config.hidden_size)


def _forward_backward(trainer: Trainer, data_iterator, forward_only: bool, num_microbatches: int) -> list:
    p, t, model = trainer.config.parallel, trainer.config.training, trainer.model
    schedule = get_forward_backward_func(trainer.groups.pp_size, len(model.chunks))
    return schedule(forward_step_func=trainer.forward_step_func, data_iterator=data_iterator,
                    model_chunks=model.chunks, num_microbatches=num_microbatches, groups=trainer.groups,
                    forward_only=forward_only, scale_loss=model.optimizer.scale_loss,
                    tensor_shape=_activation_shape(t, trainer.groups, model), dtype=model.execution.params_dtype,
                    overlap_p2p_comm=p.overlap_p2p_comm, overlap_p2p_comm_warmup_flush=p.overlap_p2p_comm_warmup_flush,
                    microbatch_group_size=p.microbatch_group_size_per_vp_stage,
                    loss_divisor=1 if t.calculate_per_token_loss else None)


def local_sums(reported: list) -> dict:
    """{name: [sum, count]} of one step's reported values, summed over its micro-batches, left on
    the device (no communication). Each reported value is such a pair (count: the tokens it covers);
    only the last pipeline stage has values."""
    names = sorted(reported[0]) if reported else []
    return {name: torch.stack([r[name].detach().float() for r in reported]).sum(dim=0) for name in names}


def reduce_reported(groups: ParallelGroups, steps: list, token_weighted: bool = False) -> dict:
    """{name: value} over the steps' `local_sums` and the data-parallel ranks, with one all-reduce
    for all of them: the mean over steps of each step's sum/count (the training log line, as
    Megatron-LM), or with `token_weighted` the total sum over the total count (evaluation)."""
    names = sorted(steps[0]) if steps else []
    if not names:
        return {}
    pairs = torch.stack([torch.stack([step[name] for name in names]) for step in steps])  # [steps, names, 2]
    comm.all_reduce(pairs, groups.dp_cp)
    if token_weighted:
        totals = pairs.sum(dim=0)
        means = (totals[:, 0] / totals[:, 1]).tolist()
    else:
        means = (pairs[..., 0] / pairs[..., 1]).mean(dim=0).tolist()
    return dict(zip(names, means))


def _per_token_gradient_scale(groups: ParallelGroups, reported: list) -> float:
    """--calculate-per-token-loss: backward ran on loss sums, and the data-parallel reduction
    averaged them over the D data x context ranks; times D / (tokens in the global batch) this is
    the gradient of the mean over every token of the global batch. The count comes from the last
    stage's reported [sum, count] pairs and is sent to every stage."""
    tokens = torch.zeros(1, dtype=torch.float64, device=groups.device)
    if reported:
        name = sorted(reported[0])[0]
        tokens += sum(float(r[name][1]) for r in reported)
    comm.all_reduce(tokens, groups.dp_cp)
    comm.all_reduce(tokens, groups.pp)
    return comm.size(groups.dp_cp) / max(tokens.item(), 1.0)


def train_step(trainer: Trainer, data_iterator, num_microbatches: Optional[int] = None
               ) -> tuple[dict, bool, Optional[float]]:
    """One optimizer step over `num_microbatches` (default: the full global batch's). Returns the
    step's `local_sums` (on the device: reduced only when logged), whether the update was applied,
    and the gradient norm."""
    t, groups, model, supervisor = trainer.config.training, trainer.groups, trainer.model, trainer.supervisor
    num_microbatches = num_microbatches or trainer.batches.num_microbatches
    for chunk in model.chunks:
        chunk.zero_grad_buffer()
    supervisor.before_forward_backward()
    reported = _forward_backward(trainer, data_iterator, forward_only=False, num_microbatches=num_microbatches)
    supervisor.after_forward_backward(reported)
    finalize_model_grads(model.chunks, groups)
    sums = local_sums(reported)
    if model.config.num_experts is not None:
        finish_moe_step(model.chunks, groups)
        sums.update(aux_loss_log_values(model.chunks, model.config, groups, num_microbatches,
                                        per_layer=trainer.config.logging.moe_per_layer_logging))
    if t.calculate_per_token_loss:
        model.optimizer.scale_grads(_per_token_gradient_scale(groups, reported))
    _empty_unused_memory(t, groups.device, level=1)
    applied, grad_norm = model.optimizer.step(supervisor.guard)
    if applied:
        model.scheduler.step(num_microbatches * t.micro_batch_size * groups.dp_size)
    _empty_unused_memory(t, groups.device, level=2)
    return sums, applied, grad_norm


def _empty_unused_memory(training_config, device: torch.device, level: int) -> None:
    """--empty-unused-memory-level: 1 after each forward-backward, 2 also after the optimizer step."""
    if training_config.empty_unused_memory_level >= level:
        utils.empty_cache(device)


def _manual_gc(training_config, iteration: Optional[int] = None) -> None:
    """--manual-gc: collect every --manual-gc-interval iterations (`iteration` given) or around an
    evaluation (with --manual-gc-eval), on every rank at the same point."""
    t = training_config
    if not t.manual_gc:
        return
    if iteration is None and t.manual_gc_eval:
        gc.collect()
    elif iteration is not None and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
        gc.collect()


def evaluate(trainer: Trainer, data_iterator, eval_iters: int) -> dict:
    """Mean of each reported value over every token of `eval_iters` global batches."""
    t, chunks = trainer.config.training, trainer.model.chunks
    _manual_gc(t)
    for chunk in chunks:
        chunk.module.eval()
    steps = []
    with torch.no_grad():
        for _ in range(eval_iters):
            steps.append(local_sums(_forward_backward(trainer, data_iterator, True, trainer.batches.num_microbatches)))
            _empty_unused_memory(t, trainer.groups.device, level=1)
    for chunk in chunks:
        chunk.module.train()
    _manual_gc(t)
    return reduce_reported(trainer.groups, steps, token_weighted=True)


def _loader(config: Config, groups: ParallelGroups, dataset, consumed: int):
    """One data iterator for this rank (the schedules hand each micro-batch to every model chunk
    that runs it); None without data."""
    d = config.data
    loader = build_loader(dataset, consumed, config.training.micro_batch_size, groups, d.num_workers,
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


def train(trainer: Trainer, train_dataset, valid_dataset, state: Optional[TrainState] = None) -> TrainState:
    """Runs --train-iters optimizer steps (or until an exit condition); returns the final state.
    Logs from the logging rank; evaluates every --eval-interval iterations, continuing through the
    validation set; saves checkpoints at --save-interval and before an early exit."""
    config, t, supervisor = trainer.config, trainer.config.training, trainer.supervisor
    state = state or TrainState()
    if state.iteration >= t.train_iters:
        return state
    train_iterator = _loader(config, trainer.groups, train_dataset, state.consumed_train_samples)
    valid_iterator = _valid_iterator(trainer, valid_dataset, state)
    profiler = _start_training(trainer)
    window = _Window(trainer.groups.device)
    while state.iteration < t.train_iters:
        # No device synchronize and no host read of the loss inside a step: steps queue back to back
        # (a parameter gather left in flight overlaps the next forward); the window is timed and its
        # losses reduced at log (and TensorBoard) intervals.
        global_batch = trainer.batches.global_batch_size_at(state.consumed_train_samples)
        if state.iteration in t.iterations_to_skip:
            train_iterator = _skip_iteration(trainer, train_dataset, state, global_batch)
            continue
        supervisor.before_step(state.iteration + 1)
        profiler.before_step(state.iteration)
        losses, applied, grad_norm = train_step(trainer, train_iterator,
                                                global_batch // trainer.batches.micro_batch_times_dp)
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_train_samples += global_batch
        counted = supervisor.after_step(state, applied, grad_norm)  # a NaN/Inf step's loss stays out of the average
        flops = flops_per_iteration(trainer.model.config, global_batch, t.seq_length)
        state.floating_point_operations += flops
        window.add(losses if counted else None, flops, global_batch * t.seq_length)
        window = _report_step(trainer, state, window, losses, global_batch, grad_norm)
        _manual_gc(t, state.iteration)
        if valid_iterator is not None and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
            _log_evaluation(trainer, valid_iterator, state, f"iteration {state.iteration}")
            window.restart()
        state.exit_reason = _save_and_check_exit(trainer, state, window)
        if state.exit_reason is not None:
            trainer.reports.printer(f"> exiting after iteration {state.iteration}: {state.exit_reason}")
            break
    return state


def _start_training(trainer: Trainer) -> StepProfiler:
    """Before the first step: the saved RNG states back, the model in training mode, Python's
    collector under --manual-gc's control; returns the profiler of the steps."""
    config, groups = trainer.config, trainer.groups
    if trainer.checkpointer is not None:
        trainer.checkpointer.restore_rng()
    profiler = StepProfiler(config.logging, groups.global_rank, groups.device)
    for chunk in trainer.model.chunks:
        chunk.module.train()
    if config.training.manual_gc:
        gc.disable()
        gc.collect()
    return profiler


def _report_step(trainer: Trainer, state: TrainState, window: _Window, losses: dict, global_batch: int,
                 grad_norm: Optional[float]) -> _Window:
    """TensorBoard and the log line at their intervals (and the straggler report with the log line);
    returns the window the next steps add to (a new one after a log line)."""
    t, log = trainer.config.training, trainer.config.logging
    to_tensorboard = log.tensorboard_dir is not None and state.iteration % log.tensorboard_log_interval == 0
    to_log = state.iteration % log.log_interval == 0 or state.iteration == t.train_iters
    if to_tensorboard or to_log:
        statistics = _step_statistics(log, trainer.model, global_batch, grad_norm)
    if to_tensorboard:
        _write_tensorboard(trainer, state, reduce_reported(trainer.groups, [losses]), statistics)
    if to_log:
        _log_iteration(trainer, state, window, statistics)
        window = _Window(trainer.groups.device)
        trainer.supervisor.at_log_line(state.iteration)
    return window


def _valid_iterator(trainer: Trainer, valid_dataset, state: TrainState):
    """The validation loader, built once: each evaluation continues where the previous one (or
    the checkpoint's consumed validation samples) stopped, as in Megatron-LM."""
    if valid_dataset is None or trainer.config.training.eval_iters <= 0:
        return None
    if state.consumed_valid_samples >= len(valid_dataset):
        trainer.reports.printer(f"NOTE: the validation set ({len(valid_dataset)} samples) was used up by earlier "
                                f"evaluations ({state.consumed_valid_samples} samples): no further validation")
        return None
    return _loader(trainer.config, trainer.groups, valid_dataset, state.consumed_valid_samples)


def _step_statistics(logging_config, model: ModelBundle, global_batch: int, grad_norm: Optional[float]) -> dict:
    """Values of the iteration just run that the log line and TensorBoard show."""
    log, optimizer = logging_config, model.optimizer
    return {"learning-rate": model.scheduler.get_lr(), "decoupled-learning-rate": model.scheduler.get_decoupled_lr(),
            "batch-size": global_batch, "grad-norm": grad_norm, "loss-scale": optimizer.loss_scale(),
            "params-norm": optimizer.params_norm() if log.log_params_norm else None,
            "num-zeros": optimizer.count_zeros() if log.log_num_zeros_in_grad else None}


def _skip_iteration(trainer: Trainer, train_dataset, state: TrainState, global_batch: int):
    """--iterations-to-skip: the step's samples are consumed untrained (Megatron's dummy step); the
    data iterator restarts past them. Returns the new iterator."""
    state.iteration += 1
    state.consumed_train_samples += global_batch
    trainer.reports.printer(f"> iteration {state.iteration} skipped (--iterations-to-skip): its {global_batch} "
                            "samples are not trained on")
    return _loader(trainer.config, trainer.groups, train_dataset, state.consumed_train_samples)


def _save_and_check_exit(trainer: Trainer, state: TrainState, window: _Window) -> Optional[str]:
    """Saves at --save-interval; returns why to stop now (saving first when --save is given). A
    save restarts the window's clock: its time is not a training step's."""
    options, checkpointer = trainer.config.checkpoint, trainer.checkpointer
    saved = checkpointer.last_saved_iteration if checkpointer is not None else None
    if options.save and options.save_interval and state.iteration % options.save_interval == 0:
        _save(trainer, state)
    reason = trainer.supervisor.exit_reason(state.iteration)
    if reason is not None and options.save and checkpointer.last_saved_iteration != state.iteration:
        _save(trainer, state)
    if checkpointer is not None and checkpointer.last_saved_iteration != saved:
        window.restart()
    return reason


def _save(trainer: Trainer, state: TrainState) -> None:
    trainer.checkpointer.save(trainer.model, state)
    if trainer.reports.progress is not None:
        trainer.reports.progress.saved(state)


def _log_iteration(trainer: Trainer, state: TrainState, window: _Window, statistics: dict) -> None:
    """Megatron's iteration line over the window (every rank takes part in reducing the losses)."""
    groups, log = trainer.groups, trainer.config.logging
    seconds, flops, tokens = window.timing()
    losses = reduce_reported(groups, window.steps)
    if not groups.is_logging_rank:
        return
    timed_steps = max(1, window.iterations - window.timed_from)
    world = groups.world_size
    tflops = flops / (seconds * timed_steps * 1e12 * world)
    tokens_per_gpu = tokens / (seconds * timed_steps) / world
    peak_gb = utils.peak_memory_bytes(groups.device) / 1e9
    print(iteration_line(iteration=state.iteration, train_iters=trainer.config.training.train_iters,
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
    trainer.reports.tensorboard.scalars(state.iteration, values)


def _write_tensorboard(trainer: Trainer, state: TrainState, losses: dict, statistics: dict) -> None:
    """Megatron's scalars of one iteration, every --tensorboard-log-interval iterations."""
    groups = trainer.groups
    if groups.is_logging_rank:
        trainer.reports.tensorboard.scalars(state.iteration, tensorboard_scalars(
            trainer.config.logging, losses, statistics, groups.world_size, utils.memory_stats(groups.device)))


def _log_evaluation(trainer: Trainer, iterator, state: TrainState, label: str, split: str = "validation") -> dict:
    """Evaluates --eval-iters global batches of `iterator`; prints Megatron's validation line and
    writes TensorBoard. Validation advances `consumed_valid_samples` (saved in checkpoints)."""
    t, tensorboard = trainer.config.training, trainer.reports.tensorboard
    values = evaluate(trainer, iterator, t.eval_iters)
    if split == "validation":
        state.consumed_valid_samples += t.eval_iters * trainer.batches.global_batch_size
    if trainer.groups.is_logging_rank:
        text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_ppl(value):.6E}" for name, value in values.items())
        bar = "-" * (len(text) + 40)
        print(f"{bar}\n validation loss at {label} | {text} |\n{bar}", flush=True)
        scalars = {}
        for name, value in values.items():
            scalars[f"{name} {split}"] = value
            if trainer.config.logging.log_validation_ppl_to_tensorboard:
                scalars[f"{name} {split} ppl"] = _ppl(value)
        tensorboard.scalars(state.iteration, scalars)
        tensorboard.scalars(state.consumed_train_samples, {f"{name} vs samples": value
                                                           for name, value in scalars.items()})
    return values


def _ppl(loss: float) -> float:
    return math.exp(min(20.0, loss))


def _final_evaluations(trainer: Trainer, state: TrainState, valid_iterator, test_dataset) -> None:
    """After training (not after an early exit): the validation set, continued, then the test set,
    as Megatron-LM does."""
    if state.exit_reason is not None or trainer.config.training.eval_iters <= 0:
        return
    if valid_iterator is not None:
        _log_evaluation(trainer, valid_iterator, state, f"iteration {state.iteration} on validation set")
    test_iterator = _loader(trainer.config, trainer.groups, test_dataset, 0) if test_dataset is not None else None
    if test_iterator is not None:
        _log_evaluation(trainer, test_iterator, state, f"iteration {state.iteration} on test set", split="test")


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
    trainer = setup(config, forward_step_func, vocab_size, check_inputs)
    config = trainer.config  # with --use-checkpoint-args, the checkpoint's model flags
    state = TrainState()
    try:
        if trainer.checkpointer is not None:
            state = trainer.checkpointer.resume(trainer.model)
        datasets = datasets_provider(config, trainer.groups, dataset_sizes(config, trainer.batches))
        state = _train_and_finish(trainer, state, *datasets)
        if torch.distributed.is_initialized():
            comm.barrier()
    except Exception as error:  # the Supervisor raises what it means for the run (out of memory, a dead rank)
        trainer.supervisor.on_error(error, state.iteration, trainer.model.chunks, trainer.model.optimizer)
    trainer.supervisor.release()
    return state


def _train_and_finish(trainer: Trainer, state: TrainState, train_ds, valid_ds, test_ds) -> TrainState:
    """Trains from `state`; then saves the last iteration (unless it was just saved), waits for an
    async save in flight, and evaluates the validation and test sets (after a run that was not
    stopped early)."""
    config = trainer.config
    trainer.supervisor.before_training(_JOB_START_TIME)
    trainer = dataclasses.replace(trainer, reports=dataclasses.replace(
        trainer.reports, tensorboard=TensorBoardWriter(config.logging.tensorboard_dir if trainer.groups.is_logging_rank
                                                       else None),
        progress=ProgressLog(config, trainer.groups, _JOB_START_TIME)))
    trainer.reports.progress.start(state)
    try:
        state = train(trainer, train_ds, valid_ds, state)
        checkpointer = trainer.checkpointer
        if config.checkpoint.save and state.iteration > 0 and checkpointer.last_saved_iteration != state.iteration:
            _save(trainer, state)
        if checkpointer is not None:
            checkpointer.wait()
        trainer.reports.progress.finished(state)
        _final_evaluations(trainer, state, _valid_iterator(trainer, valid_ds, state), test_ds)
    finally:
        trainer.supervisor.after_training()
        trainer.reports.tensorboard.close()
        gc.enable()
    return state
