"""Checkpoints: this framework's layout-independent format (logical tensors saved and loaded as
boxes with torch.distributed.checkpoint) and imports from other frameworks' formats."""


class CheckpointFormatError(ValueError):
    """A checkpoint directory that is missing, incomplete, corrupt or of another model."""
