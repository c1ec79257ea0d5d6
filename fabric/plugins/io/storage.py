"""Where checkpoint bytes live: the local disk or an fsspec URL (``s3://``, ``memory://``), and what
each kind of storage guarantees about a write."""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import TYPE_CHECKING, Any

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.s3_requests import bounded_options, is_s3
from fabric.utilities.exceptions import CheckpointError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def filesystem(path: PathType, storage_options: StorageOptions = None) -> tuple[Any, str]:
    """The fsspec filesystem holding ``path`` and the path within it (fsspec loads on first use).

    Its cached listings of ``path`` are dropped: other ranks and processes write there, and a stale
    listing (s3fs keeps them) would hide a shard or a newer checkpoint.
    """
    import fsspec

    fs, inner = fsspec.core.url_to_fs(os.fspath(path), **fsspec_options(path, storage_options))
    fs.invalidate_cache(inner)
    return fs, inner


def fsspec_options(path: PathType, storage_options: StorageOptions = None) -> dict[str, Any]:
    """The options every fsspec filesystem of ``path`` is made with: ``storage_options``, and for ``s3://`` URLs
    bounded, announced requests where they leave them out (:mod:`fabric.plugins.io.s3_requests`)."""
    if is_s3(os.fspath(path)):
        return bounded_options(dict(storage_options or {}))
    return dict(storage_options or {})


#: fsspec protocols of object stores: an object written in one request (single or multipart upload)
#: appears whole or not at all, so it needs no temporary name and rename.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oci", "memory"})


#: Object stores whose first path component is a bucket (a container): never created by a save, since s3fs's
#: ``makedirs`` (which DCP's writer calls) would create a misspelled one and the run would save into it.
BUCKET_PROTOCOLS = OBJECT_STORE_PROTOCOLS - {"memory"}


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def writes_objects_whole(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` (an fsspec filesystem) is an object store, whose writes are atomic per object."""
    return bool(OBJECT_STORE_PROTOCOLS.intersection(_protocols(fs)))


def require_bucket(fs: AbstractFileSystem, inner: str, url: PathType) -> None:
    """Raise a :class:`CheckpointError` naming the bucket of ``inner`` (``url`` on ``fs``) if it does not exist;
    call before writing there, which would create it."""
    if not BUCKET_PROTOCOLS.intersection(_protocols(fs)):
        return
    bucket = inner.lstrip("/").split("/", 1)[0]
    try:
        fs.info(bucket)  # unlike exists(), says why when the store cannot be asked (a timeout is not "missing")
    except (FileNotFoundError, PermissionError) as error:
        raise CheckpointError(
            f"Cannot save to {os.fspath(url)!r}: the bucket {bucket!r} does not exist (or these credentials cannot "
            "see it). Fabric never creates a bucket: correct the URL, or create the bucket first."
        ) from error
    except Exception as error:
        raise CheckpointError(
            f"Cannot save to {os.fspath(url)!r}: the bucket {bucket!r} could not be checked: "
            f"{type(error).__name__}: {error}"
        ) from error


def check_writable_folder(url: str, storage_options: StorageOptions = None) -> None:
    """Write and delete a probe object in the folder ``url`` (created if local), so that a destination that does not
    exist or refuses writes fails before a run trains rather than at its first save. Never creates a bucket."""
    fs, inner = filesystem(url, storage_options)
    require_bucket(fs, inner, url)
    probe = posixpath.join(inner, f".fabric-write-check-{uuid.uuid4().hex}")
    try:
        if not writes_objects_whole(fs):
            fs.makedirs(inner, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as error:
        raise CheckpointError(f"Checkpoints cannot be written to {url!r}: {type(error).__name__}: {error}") from error


def is_remote(path: PathType) -> bool:
    """Whether ``path`` is a URL of a filesystem other than the local disk (``file://`` is local)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")
