"""The checkpoint I/O interface: how a checkpoint dict becomes bytes at a path, and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from os import PathLike
from typing import Any, Union

PathType = Union[str, "PathLike[str]"]
#: fsspec's options for the filesystem of a URL (endpoint, credentials, ...); None for its defaults.
StorageOptions = Mapping[str, Any] | None


class CheckpointIO(ABC):
    """Reads and writes whole checkpoints. Strategies decide *what* goes in; this decides *how*."""

    @abstractmethod
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathType, storage_options: StorageOptions = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` so that a crash never leaves a half-written file there."""

    @abstractmethod
    def load_checkpoint(
        self, path: PathType, *, weights_only: bool = True, storage_options: StorageOptions = None
    ) -> Any:
        """Read what :meth:`save_checkpoint` wrote; raise :class:`CheckpointError` if it cannot."""

    @abstractmethod
    def remove_checkpoint(self, path: PathType, storage_options: StorageOptions = None) -> None:
        """Delete the checkpoint at ``path``."""
