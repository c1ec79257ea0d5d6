"""Checkpoints as ``torch.save`` files on any fsspec filesystem, written atomically."""

from __future__ import annotations

import errno
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType
from fabric.plugins.io.temporaries import remove_abandoned, temporary_sibling
from fabric.utilities.exceptions import CheckpointError


class TorchCheckpointIO(CheckpointIO):
    """Saves with ``torch.save`` and loads with ``torch.load(weights_only=True)`` by default.

    A save goes to a temporary sibling file first and is renamed over the target only once complete,
    so an interrupted save (crash, kill, full disk) leaves the previous checkpoint intact. Paths may be
    local or any fsspec URL (``memory://``, ``s3://`` with s3fs installed, ...).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathType) -> None:
        fs, target = _filesystem(path)
        parent, _, filename = target.rstrip("/").rpartition("/")
        if parent:
            fs.makedirs(parent, exist_ok=True)
        temporary = f"{parent}/{temporary_sibling(Path(filename)).name}"
        local = _is_local(fs)
        try:
            if local:
                _write_local(checkpoint, temporary)
            else:
                buffer = io.BytesIO()  # remote writers are often not seekable, which torch.save needs
                torch.save(checkpoint, buffer)
                fs.pipe_file(temporary, buffer.getvalue())
        except BaseException as error:
            _discard(fs, temporary)
            if _is_disk_full(error):
                raise CheckpointError(
                    f"No space left on device while writing {os.fspath(path)!r}; the previous checkpoint is intact."
                ) from error
            raise
        try:
            if local:
                _publish_local(temporary, target)
            else:
                fs.mv(temporary, target)
        except BaseException:
            _discard(fs, temporary)
            raise
        if local:
            remove_abandoned(Path(target))

    def load_checkpoint(self, path: PathType, *, weights_only: bool = True) -> Any:
        fs, target = _filesystem(path)
        if not fs.exists(target):
            raise FileNotFoundError(f"No checkpoint at {os.fspath(path)!r}.")
        if fs.isdir(target):
            raise CheckpointError(f"{os.fspath(path)!r} is a directory, not a checkpoint file.")
        with fs.open(target, "rb") as file:
            try:
                return torch.load(file, map_location="cpu", weights_only=weights_only)
            except pickle.UnpicklingError as error:
                if not weights_only or not _starts_like_torch_save(file):
                    # Garbage also fails the safe unpickler; never advise unsafe loading for it.
                    raise CheckpointError(
                        f"{os.fspath(path)!r} is not a readable checkpoint (corrupt or not written by "
                        f"torch.save): {refusal_detail(error)}"
                    ) from error
                raise CheckpointError(
                    f"{os.fspath(path)!r} holds objects that safe loading (weights_only=True) refuses. "
                    "Only if you trust where this file came from, load it with weights_only=False. "
                    f"Details: {refusal_detail(error)}"
                ) from error
            except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as error:
                raise CheckpointError(
                    f"{os.fspath(path)!r} is not a readable checkpoint (truncated, corrupt or not written by "
                    f"torch.save): {str(error) or type(error).__name__}"
                ) from error

    def remove_checkpoint(self, path: PathType) -> None:
        fs, target = _filesystem(path)
        if fs.exists(target):
            fs.rm(target, recursive=True)


def _starts_like_torch_save(file: Any) -> bool:
    """Whether the file begins as ``torch.save`` output does: a zip archive, or (legacy format) a pickle."""
    try:
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


def _is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` or what caused it is a full disk or quota (``torch.save`` reports a failed
    write as ``RuntimeError: ... unexpected pos``, with the ``OSError`` as its context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


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


def _discard(fs: Any, temporary: str) -> None:
    if fs.exists(temporary):
        fs.rm(temporary)


def _filesystem(path: PathType) -> tuple[Any, str]:
    """The fsspec filesystem holding ``path`` and the path within it (fsspec loads on first use)."""
    import fsspec

    return fsspec.core.url_to_fs(os.fspath(path))  # type: ignore[no-any-return]


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
