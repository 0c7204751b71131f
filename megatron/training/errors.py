"""The errors that stop a run with a message instead of a traceback. They live here, below every
other training module, so that any module (and the exit handling in `reliability/exits.py`) can name
them without importing the module that raises them."""


class ConfigError(ValueError):
    """Bad flags or inputs, found at start-up; the message names the flag and how to fix it (exit 2)."""


class CheckpointSaveError(RuntimeError):
    """A save failed (on any rank); the message says what survives and what to do."""


class NonFiniteError(RuntimeError):
    """Training stopped on a NaN/Inf loss or gradient; the message names the iteration and ranks."""


class DistributedFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering; the message names it."""


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory; the message says how much was estimated, used, and what to change."""
