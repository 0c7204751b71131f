"""Checkpoint flags (Megatron-LM names and meanings, plus --ckpt-keep-latest of our own)."""
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints to (one iter_NNNNNNN directory per save, plus latest_checkpointed_iteration.txt)."""
    load: Optional[str] = None
    """Directory to load the latest checkpoint from (or --ckpt-step's); a directory without one starts from scratch."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and always at the end of training when --save is given)."""
    ckpt_format: Literal["torch_dist", "torch", "torch_dcp", "zarr", "fsdp_dtensor"] = "torch_dist"
    """Checkpoint format: torch_dist (layout-independent, torch.distributed.checkpoint); torch and torch_dcp write the same format."""
    async_save: bool = False
    """Write checkpoints in the background: training waits only while tensors are copied to host memory."""
    no_save_optim: bool = False
    """Do not save the optimizer state (masters, moments, scheduler, loss scale)."""
    no_save_rng: bool = False
    """Do not save the random number generator states."""
    no_load_optim: bool = False
    """Do not load the optimizer state: masters start from the loaded weights, moments from zero."""
    no_load_rng: bool = False
    """Do not load the random number generator states."""
    finetune: bool = False
    """Load the weights only: iteration, consumed samples, optimizer and RNG start afresh."""
    use_checkpoint_args: bool = False
    """Take the model's shape flags (layers, sizes, heads, norm, positions, ...) from the checkpoint in --load."""
    ckpt_step: Optional[int] = None
    """Load the checkpoint of this iteration instead of the latest one."""
    ckpt_keep_latest: Optional[int] = None
    """Keep only this many most recent checkpoints in --save, deleting older ones after each save (this framework's own flag)."""
    exit_on_missing_checkpoint: bool = False
    """With --load: stop with an error when it holds no checkpoint, instead of starting from scratch."""
