"""Checkpoints as ``torch.save`` files on any fsspec filesystem, written atomically."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
import uuid
import zipfile
from typing import Any

import torch

from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType
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
        temporary = f"{parent}/{_temporary_prefix(filename)}{uuid.uuid4().hex}"
        started = time.time()
        try:
            if _is_local(fs):
                _save_local(checkpoint, temporary, target)
                _remove_stale_temporaries(parent or ".", filename, older_than=started)
            else:
                buffer = io.BytesIO()  # remote writers are often not seekable, which torch.save needs
                torch.save(checkpoint, buffer)
                fs.pipe_file(temporary, buffer.getvalue())
                fs.mv(temporary, target)
        except BaseException:
            if fs.exists(temporary):
                fs.rm(temporary)
            raise

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


def _temporary_prefix(filename: str) -> str:
    return f".{filename}.tmp-"


def _remove_stale_temporaries(directory: str, filename: str, older_than: float) -> None:
    """Delete what saves of the same file that were killed half way left behind.

    Only files last written before this save began are removed, so a save still running elsewhere
    keeps its temporary file.
    """
    prefix = _temporary_prefix(filename)
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.stat().st_mtime < older_than:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def _save_local(checkpoint: dict[str, Any], temporary: str, target: str) -> None:
    with open(temporary, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, target)  # atomic on POSIX and Windows
    directory = os.open(os.path.dirname(target) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def _filesystem(path: PathType) -> tuple[Any, str]:
    """The fsspec filesystem holding ``path`` and the path within it (fsspec loads on first use)."""
    import fsspec

    return fsspec.core.url_to_fs(os.fspath(path))  # type: ignore[no-any-return]


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
