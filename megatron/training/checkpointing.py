"""--save / --load: checkpoint directories, the tracker file, atomic commits, async saves, resume.

A save directory holds one directory per checkpoint and Megatron's tracker file:

    <save>/iter_0000100/      .metadata, __<rank>_0.distcp (torch.distributed.checkpoint), common.json
    <save>/latest_checkpointed_iteration.txt    "100"

Tensors (model, optimizer, RNG) are saved by `megatron.core.checkpointing` as logical, full-shape
tensors, so any layout loads any checkpoint. `common.json` holds what is the same on every rank:
the iteration, consumed samples, counters, scheduler and loss-scaler state, the step count, and the
flags, whose model-shape part is checked against the run that loads it before anything is built.

A save is atomic: every rank writes into `iter_NNNNNNN.incomplete`; once all have finished, rank 0
adds common.json, renames the directory to `iter_NNNNNNN` and only then rewrites the tracker
(itself through a temporary file and a rename). A crash at any instant leaves the tracker naming a
complete checkpoint; leftovers of an interrupted save are removed by the next save.
"""
import dataclasses
import datetime
import errno
import os
import shutil
import threading
import time
from typing import Optional

import torch

from megatron.core.checkpointing import CheckpointFormatError, checksums
from megatron.core.checkpointing import architecture as ckpt_architecture
from megatron.core.checkpointing.directory import (  # noqa: F401 (the format's names, used by callers of this module)
    COMMON_FILE,
    FORMAT,
    FORMAT_VERSION,
    ITERATION_DIR,
    TRACKER_FILE,
    checkpoint_dir,
    fsync_directory,
    read_common,
    tracked_iteration,
    write_json_atomically,
    write_text_atomically,
)
from megatron.core.checkpointing import state as ckpt_state
from megatron.core.checkpointing.safe_pickle import check_dcp_files, read_dcp_metadata
from megatron.core.checkpointing.sharded import ShardedState
from megatron.core.distributed import comm
from megatron.training.errors import CheckpointSaveError, ConfigError
from megatron.training.state import ModelBundle, TrainState


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by `root`'s tracker file, or None when there is no tracker."""
    try:
        return tracked_iteration(root)
    except CheckpointFormatError as error:
        raise ConfigError(str(error)) from None


def locate(load: str, ckpt_step: Optional[int]) -> tuple[Optional[str], Optional[str]]:
    """(checkpoint directory to load, or None; a note to print). --ckpt-step names an iteration
    that must exist; otherwise the tracker's, and a directory with no checkpoint starts fresh."""
    if ckpt_step is not None:
        directory = checkpoint_dir(load, ckpt_step)
        if not os.path.isdir(directory):
            found = sorted(name for name in os.listdir(load) if ITERATION_DIR.match(name)) if os.path.isdir(load) else []
            raise ConfigError(f"--ckpt-step {ckpt_step}: {directory} does not exist (checkpoints in --load: "
                              f"{', '.join(found) or 'none'})")
        return directory, None
    iteration = read_tracker(load) if os.path.isdir(load) else None
    if iteration is None:
        return None, (f"--load {load}: no checkpoint found (no {TRACKER_FILE}); training starts from "
                      "randomly initialized weights")
    directory = checkpoint_dir(load, iteration)
    if not os.path.isdir(directory):
        raise ConfigError(f"{os.path.join(load, TRACKER_FILE)} names iteration {iteration}, but {directory} "
                          "does not exist; restore it, or point the tracker at an existing iteration")
    return directory, None


def _storage():
    """torch.distributed.checkpoint takes seconds to import: only runs that save or load pay it."""
    from megatron.core.checkpointing import storage

    return storage


def apply_checkpoint_args(config, common: dict) -> tuple:
    """--use-checkpoint-args: (config with the model's architecture taken from the checkpoint, notes)."""
    model, notes = ckpt_architecture.restore(config.model, common["args"]["model"])
    return dataclasses.replace(config, model=model), notes


def architecture(model_config, vocab_size: int) -> dict:
    """What a checkpoint must match: every field that defines the model (a derived
    TransformerConfig's), plus the vocabulary."""
    return ckpt_architecture.record(model_config, vocab_size)


def check_architecture(directory: str, saved: dict, current: dict) -> list:
    """Raises ConfigError naming the flag and both values when the checkpoint is of another model;
    returns notes for numerics that differ without changing a shape."""
    try:
        return ckpt_architecture.check(directory, saved, current)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def layout_of(groups, num_chunks: int) -> dict:
    return {"world_size": groups.world_size, "tp": groups.tp_size, "cp": groups.cp_size, "dp": groups.dp_size,
            "pp": groups.pp_size, "vpp": num_chunks}


def fp8_layout_of(groups, num_chunks: int) -> dict:
    """The layout a rank's FP8 amax histories belong to: with the experts' own scaling slots, the
    expert layout too (another EP size gives a rank other experts)."""
    return {**layout_of(groups, num_chunks), "ep": groups.ep_size, "etp": groups.etp_size}


# ---------------------------------------------------------------------------------------------
def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def _root_cause(error: BaseException, rank: int) -> tuple:
    """(rank, exception): the first failing rank's own exception inside torch.distributed.checkpoint's
    CheckpointException (which every rank raises), else this rank's."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return min(failures), first[0] if isinstance(first, tuple) else first
    return rank, error


class Checkpointer:
    """Saves and loads the run's checkpoints (see the module docstring)."""

    def __init__(self, config, groups, rng_tracker, printer, to_load: Optional[tuple] = None):
        self.config = config
        self.to_load = to_load  # (directory, its common.json) that --load found, or None
        self.groups = groups
        self.rng_tracker = rng_tracker
        self.print = printer
        self.options = config.checkpoint
        self.last_saved_iteration = None
        self.loaded_rng: Optional[dict] = None  # restored by `restore_rng` when training resumes
        self._pending: Optional[threading.Thread] = None
        self._pending_error: Optional[BaseException] = None
        # DCP plans and commits over a gloo group of every rank: also usable from the background
        # thread of an async save while training keeps its own groups busy.
        timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
        self.group = comm.new_gloo_group(timeout) if groups.world_size > 1 else None

    def last_directory(self) -> Optional[str]:
        """The directory of the newest checkpoint this run saved or loaded, if any."""
        if self.last_saved_iteration is None:
            return None
        return checkpoint_dir(self.options.save or self.options.load, self.last_saved_iteration)

    # -- saving --------------------------------------------------------------------------------
    def build_state(self, model: ModelBundle) -> ShardedState:
        options = self.options
        for chunk in model.chunks:
            chunk.finish_param_sync()  # the distributed optimizer's gather may still be in flight
        state = ShardedState()
        ckpt_state.add_model(state, model.chunks, self.groups)
        for key, bias in ckpt_state.router_biases(model.chunks).items():
            state.add_whole(key, bias)
        if not options.no_save_optim:
            optimizer = model.optimizer
            ckpt_state.add_optimizer(state, optimizer, model.chunks, masters=optimizer.separate_masters(),
                                     moments=optimizer.num_applied_steps > 0)
        if not options.no_save_rng:
            ckpt_state.add_per_rank(state, "rng", self.groups.global_rank,
                                    ckpt_state.rng_tensors(self.rng_tracker, self.groups.device))
        ckpt_state.add_per_rank(state, "fp8", self.groups.global_rank, ckpt_state.fp8_tensors(model.chunks))
        return state

    def common(self, model: ModelBundle, train_state: TrainState) -> dict:
        optimizer = None
        if not self.options.no_save_optim:
            optimizer = {"kind": self.config.optimizer.optimizer, "num_applied_steps": model.optimizer.num_applied_steps,
                         "grad_scaler": model.optimizer.scaler_state(), "scheduler": model.scheduler.state_dict()}
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "iteration": train_state.iteration,
            "train_state": {name: value for name, value in dataclasses.asdict(train_state).items()
                            if name != "exit_reason"},
            "optimizer": optimizer,
            "rng_layout": None if self.options.no_save_rng else layout_of(self.groups, len(model.chunks)),
            "fp8_layout": (fp8_layout_of(self.groups, len(model.chunks)) if ckpt_state.fp8_tensors(model.chunks)
                           else None),
            "model": architecture(model.config, model.vocab_size),
            "args": dataclasses.asdict(self.config),  # its "model" part: what --use-checkpoint-args restores
        }

    def save(self, model: ModelBundle, train_state: TrainState) -> None:
        """Saves the checkpoint of `train_state.iteration` (asynchronously with --async-save)."""
        self.wait()
        root = self.options.save
        iteration = train_state.iteration
        final = checkpoint_dir(root, iteration)
        incomplete = final + ".incomplete"
        start = time.perf_counter()
        if self.groups.global_rank == 0:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # leftovers of interrupted saves
                if name.endswith(".incomplete"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        self._barrier()
        state = self.build_state(model)
        common = self.common(model, train_state)
        self.last_saved_iteration = iteration
        if not self.options.async_save:
            self._write(state, common, incomplete, final, start)
            return
        state = _host_copy(state)
        blocked = time.perf_counter() - start
        self.print(f"> async checkpoint of iteration {iteration}: training resumes after {blocked:.2f} s; "
                   "writing in the background")
        self._pending = threading.Thread(target=self._write_in_background, args=(state, common, incomplete, final, start),
                                         name="checkpoint-writer", daemon=True)
        self._pending.start()

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # re-raised by wait() in the training thread
            self._pending_error = error

    def _write(self, state: ShardedState, common: dict, incomplete: str, final: str, start: float) -> None:
        """Writes, then commits on rank 0. A failure on any rank (a full disk: ENOSPC) is agreed by
        every rank, the partial directory is removed, and the previous checkpoint stays the latest."""
        failure, failed_rank = None, self.groups.global_rank
        try:
            _storage().save_state(state, incomplete, process_group=self.group)
        except BaseException as error:  # CheckpointException (a BaseException), on every rank when one rank's write fails
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            failed_rank, failure = _root_cause(error, failed_rank)
        written = not self._any_rank_failed(failure is not None)
        if written:
            try:  # every rank checksums what it wrote (collective); recorded in common.json
                common["checksums"] = checksums.gather(incomplete, self.group)
            except OSError as error:
                failure = error
        if written and failure is None and self.groups.global_rank == 0:
            try:
                self._commit(common, incomplete, final, start)
            except OSError as error:
                failure = error
        if self._any_rank_failed(failure is not None):
            if self.groups.global_rank == 0:
                shutil.rmtree(incomplete, ignore_errors=True)
            raise CheckpointSaveError(self._save_failure(common["iteration"], final, failure, failed_rank))

    def _commit(self, common: dict, incomplete: str, final: str, start: float) -> None:
        """Rank 0: common.json, the rename to iter_N, then the tracker (see the module docstring)."""
        write_json_atomically(os.path.join(incomplete, COMMON_FILE), common)
        fsync_directory(incomplete)
        if os.path.exists(final):  # an older save of the same iteration (a re-run after resume)
            stale = final + ".replaced"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(incomplete, final)
        fsync_directory(os.path.dirname(final))
        write_text_atomically(os.path.join(self.options.save, TRACKER_FILE), str(common["iteration"]))
        self._remove_old_checkpoints(common["iteration"])
        size = _directory_bytes(final)
        self.print(f"> saved checkpoint of iteration {common['iteration']} to {final} "
                   f"({size / 1e6:.1f} MB) in {time.perf_counter() - start:.2f} s")

    def _any_rank_failed(self, failed: bool) -> bool:
        """Collective over the checkpoint group (it also ends the save on every rank together)."""
        if self.group is None:
            return failed
        flag = torch.tensor([float(failed)])
        comm.all_reduce_max(flag, self.group)
        return bool(flag.item() > 0)

    def _save_failure(self, iteration: int, final: str, failure: Optional[BaseException], rank: int) -> str:
        tracker = os.path.join(self.options.save, TRACKER_FILE)
        previous = read_tracker(self.options.save)
        kept = (f"{tracker} still names iteration {previous}, which is complete" if previous is not None
                else "no earlier checkpoint exists")
        cause = f"on rank {rank}: {failure}" if failure is not None else "on another rank (see that rank's error)"
        hint = ("free space (or keep fewer checkpoints with --ckpt-keep-latest) and resume with --load "
                f"{self.options.save}" if isinstance(failure, OSError) and failure.errno == errno.ENOSPC
                else f"fix the cause and resume with --load {self.options.save}")
        return (f"saving the checkpoint of iteration {iteration} to {final} failed {cause}. The partial checkpoint was "
                f"removed and {kept}; {hint}")

    def _remove_old_checkpoints(self, newest: int) -> None:
        keep = self.options.ckpt_keep_latest
        if not keep:
            return
        root = self.options.save
        iterations = sorted(int(m.group(1)) for m in map(ITERATION_DIR.match, os.listdir(root)) if m)
        for iteration in iterations[:-keep]:
            if iteration != newest:
                shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)

    def wait(self) -> None:
        """Waits for the async save in flight (if any); raises its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    def _barrier(self) -> None:
        if self.group is not None:
            comm.barrier(self.group)

    # -- loading -------------------------------------------------------------------------------
    def resume(self, model: ModelBundle) -> TrainState:
        """The train state to continue from: the checkpoint --load found, loaded into `model`, or a
        fresh start."""
        return self.load(model, *self.to_load) if self.to_load is not None else TrainState()

    def load(self, model: ModelBundle, directory: str, common: dict) -> TrainState:
        """Loads `directory` into the built model; returns the train state to continue from."""
        options = self.options
        optimizer_info = common.get("optimizer")
        load_optimizer = not (options.finetune or options.no_load_optim)
        if load_optimizer and optimizer_info is None:
            self.print(f"NOTE: {directory} holds no optimizer state (saved with --no-save-optim or converted); "
                       "the optimizer starts from the loaded weights")
            load_optimizer = False
        if load_optimizer and optimizer_info["kind"] != self.config.optimizer.optimizer:
            raise ConfigError(f"the checkpoint {directory} was trained with --optimizer {optimizer_info['kind']}, this "
                              f"run uses --optimizer {self.config.optimizer.optimizer}; pass --no-load-optim to start "
                              "the optimizer afresh")
        start = time.perf_counter()
        state = ShardedState()
        if load_optimizer:
            self._add_optimizer_targets(state, model, directory, optimizer_info["num_applied_steps"])
        else:
            ckpt_state.add_model(state, model.chunks, self.groups)
        rng = self._rng_targets(state, len(model.chunks), directory, common)
        fp8 = self._fp8_targets(state, model.chunks, directory, common)
        saved = _storage().saved_shapes(directory)
        for key, bias in ckpt_state.router_biases(model.chunks).items():
            if key in saved:  # absent from checkpoints of runs without --moe-router-enable-expert-bias
                state.add_whole(key, bias)
        self._verify_checksums(directory, common)
        _storage().load_state(state, directory, process_group=self.group)
        if fp8 is not None:
            ckpt_state.restore_fp8(model.chunks, fp8)
        optimizer = model.optimizer
        if load_optimizer:
            optimizer.copy_masters_to_model()
            optimizer.load_scaler_state(optimizer_info["grad_scaler"])
            model.scheduler.load_state_dict(optimizer_info["scheduler"])
        else:
            optimizer.reload_model_params()
        for chunk in model.chunks:
            chunk.finish_param_sync()
        self.loaded_rng = rng
        train_state = TrainState() if options.finetune else TrainState(**common["train_state"])
        if not options.finetune:
            self.last_saved_iteration = train_state.iteration  # already on disk: not saved again
        what = "weights" if not load_optimizer else "weights and optimizer state"
        self.print(f"> loaded {what} of iteration {common['iteration']} from {directory} in "
                   f"{time.perf_counter() - start:.2f} s" + ("; --finetune: starting at iteration 0" if options.finetune else ""))
        return train_state

    def _verify_checksums(self, directory: str, common: dict) -> None:
        """Every rank checks its share of the files against the checksums saved with them; all ranks
        stop with the same message naming the first damaged file (one max-reduction of its index)."""
        check_dcp_files(directory, read_dcp_metadata(directory))  # a missing or truncated file is named as such
        recorded = common.get("checksums")
        if recorded is None:
            self.print(f"NOTE: {directory} was saved without checksums: its files are not verified")
            return
        names = sorted(recorded["files"])
        mismatch = checksums.first_mismatch(directory, recorded, self.groups.global_rank, self.groups.world_size)
        bad = torch.tensor([float(names.index(mismatch[1]) + 1 if mismatch else 0)])
        if self.group is not None:
            comm.all_reduce_max(bad, self.group)
        if bad.item() > 0:
            name = names[int(bad.item()) - 1]
            description = mismatch[0] if mismatch and mismatch[1] == name else f"{os.path.join(directory, name)} is damaged"
            raise checksums.corruption_error(directory, common["iteration"], description)

    def restore_rng(self) -> None:
        """Puts the loaded generator states in place. Called when the training loop resumes (after
        the data loaders are built, which draw from the generators as they did in the saving run)."""
        if self.loaded_rng is not None:
            ckpt_state.restore_rng(self.loaded_rng, self.rng_tracker, self.groups.device)
            self.loaded_rng = None

    def _add_optimizer_targets(self, state: ShardedState, model: ModelBundle, directory: str,
                               num_applied_steps: int) -> None:
        """The masters (from the saved masters, or the saved weights when those were the masters)
        and, once the optimizer had stepped, its moments."""
        optimizer = model.optimizer
        has_masters = any(key.startswith(ckpt_state.MASTER + "/") for key in _storage().saved_shapes(directory))
        source = ckpt_state.MASTER if has_masters else ckpt_state.MODEL
        if num_applied_steps:
            optimizer.prepare_state_for_load(num_applied_steps)
        else:
            optimizer.num_applied_steps = 0
        names = ckpt_state.global_names(model.chunks)
        keys = optimizer.moment_keys() if num_applied_steps else ()
        for param, start, end, master in optimizer.state_regions():
            name = names[param]
            state.add_range(source, name, param, start, end, master.detach().view(-1))
            for key in keys:
                state.add_range(ckpt_state.moment_prefix(key), name, param, start, end,
                                optimizer.optimizer.state[master][key].view(-1))

    def _rng_targets(self, state: ShardedState, num_chunks: int, directory: str, common: dict) -> Optional[dict]:
        options = self.options
        if options.finetune or options.no_load_rng or common.get("rng_layout") is None:
            return None
        layout = layout_of(self.groups, num_chunks)
        if common["rng_layout"] != layout:
            self.print(f"NOTE: {directory} was saved at layout {common['rng_layout']}, this run is {layout}: "
                       "random number generator states are not restored (weights, optimizer and data order are)")
            return None
        targets = {name: tensor.clone() for name, tensor in
                   ckpt_state.rng_tensors(self.rng_tracker, self.groups.device).items()}
        ckpt_state.add_per_rank(state, "rng", self.groups.global_rank, targets)
        return targets

    def _fp8_targets(self, state: ShardedState, chunks: list, directory: str, common: dict) -> Optional[dict]:
        """The FP8 delayed-scaling amax histories, restored at the same layout; elsewhere the scales
        warm up again over --fp8-amax-history-len steps (with a note)."""
        current = ckpt_state.fp8_tensors(chunks)
        if not current or self.options.finetune or common.get("fp8_layout") is None:
            return None
        layout = fp8_layout_of(self.groups, len(chunks))
        if {**layout, **common["fp8_layout"]} != layout:  # checkpoints before "ep" and "etp" were kept lack them
            self.print(f"NOTE: {directory} was saved at another layout: the FP8 amax histories start afresh")
            return None
        targets = {name: tensor.clone() for name, tensor in current.items()}
        ckpt_state.add_per_rank(state, "fp8", self.groups.global_rank, targets)
        return targets


def _host_copy(state: ShardedState) -> ShardedState:
    """A copy of every tensor of `state` in host memory (what an async save writes from)."""
    copy = ShardedState()
    for key, boxes in state.sharded.items():
        entry = copy.sharded[key] = dataclasses.replace(boxes, pieces=[])
        for offsets, tensor in boxes.pieces:
            entry.add(offsets, tensor.detach().to("cpu", copy=True))
    for key, tensor in state.whole.items():
        copy.add_whole(key, tensor.detach().to("cpu", copy=True))
    return copy
