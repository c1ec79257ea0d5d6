"""Exceptions users may want to catch by type."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the objects it was meant for are unchanged."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the path (also a ``FileNotFoundError``, as a missing file is)."""
