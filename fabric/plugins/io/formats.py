"""The one place that tells a checkpoint's format and hands it to that format's reader.

A checkpoint is one of three things, on a local disk or at an fsspec URL (``s3://``, ``memory://``):

- a file (``torch.save``, written by :class:`~fabric.plugins.io.torch_io.TorchCheckpointIO` or a
  user's own :class:`~fabric.plugins.io.checkpoint_io.CheckpointIO`);
- a sharded directory written by ``torch.distributed.checkpoint`` (DCP): complete once its
  ``.metadata`` file is there, which DCP writes last, after every rank's shards;
- a DeepSpeed directory: complete once its ``latest`` file names a tag, which Fabric writes last;
- a folder in Hugging Face's layout (``fabric.save(..., format="huggingface")`` or ``save_pretrained``): read only
  into a model (``fabric.load(path, {"model": model})``).

A directory holding neither marker is an unfinished save (or not a checkpoint at all) and never loads.
"""

from __future__ import annotations

import enum
import os
import posixpath
from typing import Any

from fabric.plugins.io import deepspeed_checkpoint, distributed_checkpoint
from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType, StorageOptions
from fabric.plugins.io.deepspeed_checkpoint import LATEST as DEEPSPEED_LATEST
from fabric.plugins.io.distributed_checkpoint import METADATA_FILE as DCP_METADATA
from fabric.plugins.io.huggingface import INDEX_FILE as HUGGINGFACE_INDEX
from fabric.plugins.io.huggingface import SINGLE_FILE as HUGGINGFACE_SINGLE_FILE
from fabric.plugins.io.storage import filesystem
from fabric.utilities.exceptions import CheckpointError


class CheckpointFormat(enum.Enum):
    FILE = "file"
    DCP = "dcp"
    DEEPSPEED = "deepspeed"
    #: A folder in Hugging Face's layout (``model.safetensors.index.json`` or ``model.safetensors``).
    HUGGINGFACE = "huggingface"
    #: A directory without a completion marker: a save that did not finish, or not a checkpoint.
    INCOMPLETE = "incomplete"


def recognise(path: PathType, storage_options: StorageOptions = None) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; anything that is not a directory counts as a file
    (a missing one too: its reader reports it, as a user's own ``CheckpointIO`` may know paths fsspec does not)."""
    fs, root = filesystem(path, storage_options)
    if not fs.isdir(root):
        return CheckpointFormat.FILE
    if fs.isfile(posixpath.join(root, DCP_METADATA)):
        return CheckpointFormat.DCP
    if fs.isfile(posixpath.join(root, DEEPSPEED_LATEST)):
        return CheckpointFormat.DEEPSPEED
    if any(fs.isfile(posixpath.join(root, name)) for name in (HUGGINGFACE_INDEX, HUGGINGFACE_SINGLE_FILE)):
        return CheckpointFormat.HUGGINGFACE
    return CheckpointFormat.INCOMPLETE


def is_complete_directory(path: PathType, storage_options: StorageOptions = None) -> bool:
    """Whether ``path`` is a sharded checkpoint directory whose save finished."""
    return recognise(path, storage_options) in (CheckpointFormat.DCP, CheckpointFormat.DEEPSPEED)


def incomplete_error(path: PathType) -> CheckpointError:
    return CheckpointError(
        f"{os.fspath(path)!r} is a directory but not a complete checkpoint: it has neither DCP's "
        f"{DCP_METADATA!r} nor DeepSpeed's {DEEPSPEED_LATEST!r} file, which a sharded save writes last "
        "(a save that did not finish, or not a checkpoint)."
    )


def read_whole(
    path: PathType,
    checkpoint_io: CheckpointIO,
    *,
    weights_only: bool = True,
    storage_options: StorageOptions = None,
) -> Any:
    """Read the checkpoint at ``path`` whole into this process, whatever its format (no process group needed).

    Sharded optimizer states come back in the plain ``optimizer.state_dict()`` form; a DeepSpeed
    checkpoint gives its float32 weights and client entries (its optimizer shards cannot be rebuilt).
    """
    form = recognise(path, storage_options)
    if form is CheckpointFormat.DCP:
        return distributed_checkpoint.read_whole(path, weights_only=weights_only, storage_options=storage_options)
    if form is CheckpointFormat.DEEPSPEED:
        return deepspeed_checkpoint.read_whole(path, weights_only=weights_only, storage_options=storage_options)
    if form is CheckpointFormat.INCOMPLETE:
        raise incomplete_error(path)
    if form is CheckpointFormat.HUGGINGFACE:
        raise CheckpointError(
            f"{os.fspath(path)!r} is a Hugging Face folder (weights only): load it into a model, "
            "fabric.load(path, {'model': model})."
        )
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only, storage_options=storage_options)
