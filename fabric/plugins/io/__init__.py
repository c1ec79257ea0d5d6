"""Checkpoint I/O plugins."""

from fabric.plugins.io.checkpoint_io import CheckpointIO
from fabric.plugins.io.torch_io import TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]
