"""Layout-independent checkpoints: logical tensors saved and loaded as boxes with torch.distributed.checkpoint."""


class CheckpointFormatError(ValueError):
    """A checkpoint directory that is missing, incomplete, corrupt or of another model."""
