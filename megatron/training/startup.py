"""The start-up checks `setup` and `--dry-run` share, before anything is built: the checkpoint to
load (and, with --use-checkpoint-args, the model flags taken from it), the flags, the input files,
the architecture against the checkpoint's, and whether the model fits in memory (the planner's
figures: `megatron.training.planning`)."""
import math
import os
from typing import Callable, Optional

import torch

from megatron.core import utils
from megatron.core.checkpointing.architecture import record_of_checkpoint
from megatron.training import builders
from megatron.training.state import batch_schedule
from megatron.training.checkpointing import apply_checkpoint_args, architecture, check_architecture, locate, read_common
from megatron.training.config import Config
from megatron.training.initialize import world_size_from_env
from megatron.training.planning.startup import (check_device_fits, persistent_bytes, persistent_hints,
                                                print_dry_run_plan)
from megatron.training.errors import ConfigError
from megatron.training.validation import resolve


def check_fits_in_memory(config: Config, model_config, world_size: int, device: torch.device) -> None:
    """Stops before anything is allocated when the model's parameters, gradients and optimizer state
    (the planner's persistent terms) exceed the free memory of this rank's GPU (or, on CPU, the RAM
    all local processes share)."""
    estimate = persistent_bytes(config, model_config, world_size)
    processes = 1 if device.type != "cpu" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    where = f"{device}" if device.type != "cpu" else "this machine's RAM"
    try:
        check_device_fits(estimate, utils.available_memory(device), where, persistent_hints(config), processes)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def dry_run(config: Config, vocab_size: int, check_inputs: Optional[Callable] = None) -> None:
    """--dry-run: the start-up checks of a WORLD_SIZE-process run (flags, input files, the checkpoint
    to load), in this one process; prints the layout and the plan for --dry-run-gpu (memory per GPU
    term by term with a verdict, predicted step time), and stops when the plan does not fit. Builds
    nothing, joins no process group, and never looks at this machine's memory."""
    world_size = world_size_from_env()
    config, model_config, notes, _ = startup_checks(config, vocab_size, world_size, check_inputs)
    for note in notes:
        print(f"NOTE: {note}", flush=True)
    p, t = config.parallel, config.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = world_size // (tp * pp * cp)
    batches = batch_schedule(t, dp)
    print(f"> layout: {world_size} processes = TP {tp} x CP {cp} x PP {pp} x DP {dp}; global batch "
          f"{batches.global_batch_size} = {batches.num_microbatches_at(math.inf)} micro-batches of {t.micro_batch_size} "
          f"x DP {dp}; {t.train_iters} iterations; padded vocabulary {model_config.padded_vocab_size}", flush=True)
    print_dry_run_plan(config, vocab_size, world_size, ConfigError)
    print(f"> dry run: the flags are valid for {world_size} processes; nothing was built", flush=True)


def startup_checks(config: Config, vocab_size: int, world_size: int, check_inputs: Optional[Callable]) -> tuple:
    """The checks of `setup` and `--dry-run`, before anything is built: (config, with the model
    flags of the checkpoint under --use-checkpoint-args and what the flags imply made explicit
    (`validation.resolve`); the derived architecture; notes; the checkpoint to load as
    (directory, common.json), or None)."""
    config, notes, to_load = _find_checkpoint(config)
    config, resolved_notes = resolve(config, world_size)
    notes += resolved_notes
    if check_inputs is not None:
        check_inputs(config)
    model_config = builders.transformer_config(config, vocab_size)
    if to_load is not None:
        notes += check_architecture(to_load[0], record_of_checkpoint(to_load[1]), architecture(model_config, vocab_size))
    return config, model_config, notes, to_load


def _find_checkpoint(config: Config) -> tuple[Config, list, Optional[tuple]]:
    """(config, notes, (directory, common.json) of the checkpoint --load names, or None). With
    --use-checkpoint-args the model flags are taken from it here, before validation."""
    options = config.checkpoint
    if not options.load:
        return config, [], None
    directory, note = locate(options.load, options.ckpt_step)
    if directory is None and options.exit_on_missing_checkpoint:
        raise ConfigError(f"{note.split(';')[0]}, and --exit-on-missing-checkpoint is given")
    if directory is None:
        return config, [note], None
    common = read_common(directory)
    notes = []
    if options.use_checkpoint_args:
        config, notes = apply_checkpoint_args(config, common)
    return config, notes, (directory, common)
