"""Where checkpoint bytes live: the local disk or an fsspec URL (``s3://``, ``memory://``), and what
each kind of storage guarantees about a write."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def filesystem(path: PathType, storage_options: StorageOptions = None) -> tuple[Any, str]:
    """The fsspec filesystem holding ``path`` and the path within it (fsspec loads on first use).

    Its cached listings of ``path`` are dropped: other ranks and processes write there, and a stale
    listing (s3fs keeps them) would hide a shard or a newer checkpoint.
    """
    import fsspec

    fs, inner = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
    fs.invalidate_cache(inner)
    return fs, inner


#: fsspec protocols of object stores: an object written in one request (single or multipart upload)
#: appears whole or not at all, so it needs no temporary name and rename.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oci", "memory"})


def writes_objects_whole(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` (an fsspec filesystem) is an object store, whose writes are atomic per object."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))


def is_remote(path: PathType) -> bool:
    """Whether ``path`` is a URL of a filesystem other than the local disk (``file://`` is local)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")
