"""Checkpoints as ``torch.save`` files on any fsspec filesystem, written atomically."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType, StorageOptions
from fabric.plugins.io.storage import filesystem, require_bucket, writes_objects_whole
from fabric.plugins.io.temporaries import (
    owned_temporary,
    remove_abandoned,
    remove_abandoned_remote,
    temporary_sibling,
)
from fabric.plugins.io.write_errors import disk_full_error, is_disk_full
from fabric.utilities import checkpoint_state  # noqa: F401 - lets weights_only loads read a saved loader
from fabric.utilities.exceptions import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


class TorchCheckpointIO(CheckpointIO):
    """Saves with ``torch.save`` and loads with ``torch.load(weights_only=True)`` by default.

    A save goes to a temporary sibling file first and is renamed over the target only once complete,
    so an interrupted save (crash, kill, full disk) leaves the previous checkpoint intact. Paths may be
    local or any fsspec URL (``memory://``, ``s3://`` with s3fs installed, ...). On object stores an
    object written in one request appears whole or not at all, so the checkpoint is written in place.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathType, storage_options: StorageOptions = None
    ) -> None:
        fs, target = filesystem(path, storage_options)
        require_bucket(fs, target, path)
        parent, _, filename = target.rstrip("/").rpartition("/")
        if parent:
            fs.makedirs(parent, exist_ok=True)
        try:
            if _is_local(fs):
                _save_local(checkpoint, target)
            elif writes_objects_whole(fs):  # an object appears whole or not at all: no temporary needed
                fs.pipe_file(target, _serialized(checkpoint))
                remove_abandoned_remote(fs, target)  # what killed saves of earlier versions left
            else:
                _save_remote(fs, checkpoint, parent, filename)
        except BaseException as error:
            if is_disk_full(error):
                raise disk_full_error(path) from error
            raise

    @override
    def load_checkpoint(
        self, path: PathType, *, weights_only: bool = True, storage_options: StorageOptions = None
    ) -> Any:
        fs, target = filesystem(path, storage_options)
        if not fs.exists(target):
            raise CheckpointNotFoundError(f"No checkpoint at {os.fspath(path)!r}.")
        if fs.isdir(target):
            raise CheckpointError(f"{os.fspath(path)!r} is a directory, not a checkpoint file.")
        with fs.open(target, "rb") as file:
            return read_torch_file(file, os.fspath(path), weights_only)

    @override
    def remove_checkpoint(self, path: PathType, storage_options: StorageOptions = None) -> None:
        fs, target = filesystem(path, storage_options)
        if fs.exists(target):
            fs.rm(target, recursive=True)


def read_torch_file(file: Any, name: str, weights_only: bool = True, mmap: bool = False) -> Any:
    """``torch.load`` of ``file`` (an open binary file, or a local path with ``mmap``) onto the CPU, every failure a
    :class:`CheckpointError` naming ``name``: refused objects (with the only safe advice), foreign or truncated bytes.

    ``mmap`` maps the file only when it is in the zip format; torch's legacy format cannot be mapped and is read whole.
    """
    if mmap and not zipfile.is_zipfile(file):
        mmap = False
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as error:
        if not weights_only or not _starts_like_torch_save(file):
            # Garbage also fails the safe unpickler; never advise unsafe loading for it.
            raise CheckpointError(
                f"{name!r} is not a readable checkpoint (corrupt or not written by torch.save): {refusal_detail(error)}"
            ) from error
        raise CheckpointError(
            f"{name!r} holds objects that safe loading (weights_only=True) refuses. Only if you trust where this "
            f"file came from, load it with weights_only=False. Details: {refusal_detail(error)}"
        ) from error
    except Exception as error:  # foreign bytes fail torch's readers in many ways (KeyError, IndexError)
        raise CheckpointError(
            f"{name!r} is not a readable checkpoint (truncated, corrupt or not written by torch.save): "
            f"{str(error) or type(error).__name__}"
        ) from error


def _starts_like_torch_save(file: Any) -> bool:
    """Whether the file begins as ``torch.save`` output does: a zip archive, or (legacy format) a pickle."""
    try:
        if isinstance(file, (str, os.PathLike)):
            with open(file, "rb") as opened:
                head = opened.read(4)
        else:
            file.seek(0)
            head = file.read(4)
    except (OSError, ValueError):
        return True  # cannot tell: keep the safe-loading advice
    return bool(head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"))


def refusal_detail(error: BaseException) -> str:
    """The line of torch's long weights-only message that says what was refused (e.g. the class)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            detail = line.split("WeightsUnpickler error:", 1)[1].strip()
            detail = detail or (lines[index + 1] if index + 1 < len(lines) else line)
            # torch goes on to advise allow-listing the global: wrong advice for an untrusted file.
            return detail.split(" Please use `torch.serialization", 1)[0].rstrip(".")
    return lines[0] if lines else type(error).__name__


def _save_local(checkpoint: dict[str, Any], target: str) -> None:
    """Write a locked temporary sibling, rename it over ``target``, then remove what killed saves left."""
    with owned_temporary(Path(target)) as temporary:  # locked until renamed: never taken for abandoned
        _write_local(checkpoint, os.fspath(temporary))
        _publish_local(os.fspath(temporary), target)
    remove_abandoned(Path(target))


def _save_remote(fs: AbstractFileSystem, checkpoint: dict[str, Any], parent: str, filename: str) -> None:
    """On a remote filesystem without atomic writes: a temporary sibling, moved over the target once whole;
    temporaries that killed saves left are removed by their age (no lock can be checked there)."""
    temporary = f"{parent}/{temporary_sibling(Path(filename)).name}"
    try:
        fs.pipe_file(temporary, _serialized(checkpoint))
        fs.mv(temporary, f"{parent}/{filename}")
    except BaseException:
        _discard(fs, temporary)
        raise
    remove_abandoned_remote(fs, f"{parent}/{filename}")


def _serialized(checkpoint: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()  # pipe_file sends the whole object at once
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def _write_local(checkpoint: dict[str, Any], temporary: str) -> None:
    with open(temporary, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())


def _publish_local(temporary: str, target: str) -> None:
    os.replace(temporary, target)  # atomic on POSIX and Windows
    directory = os.open(os.path.dirname(target) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def _discard(fs: AbstractFileSystem, temporary: str) -> None:
    if fs.exists(temporary):
        fs.rm(temporary)


def _is_local(fs: AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
