"""Composer's file helpers (``composer.utils.parse_uri`` and ``get_file``) on fsspec: a URL or a local path, read
the same way as checkpoints are (``s3://`` through s3fs, ``memory://``, local files)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from fabric.plugins.io.checkpoint_io import StorageOptions
from fabric.plugins.io.storage import filesystem
from fabric.plugins.io.temporaries import owned_temporary


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(backend, bucket, path)`` of ``uri``, as Composer splits it: ``"s3://bucket/a/b.pt"`` gives
    ``("s3", "bucket", "a/b.pt")``; a local path gives ``("", "", path)`` unchanged."""
    parsed = urlparse(uri)
    bucket = parsed.netloc.split("@")[0]
    if not parsed.scheme and not bucket:
        return "", "", parsed.path
    return parsed.scheme, bucket, parsed.path.lstrip("/")


def get_file(
    path: str,
    destination: str | os.PathLike[str],
    object_store: object = None,
    overwrite: bool = False,
    progress_bar: bool = True,
    storage_options: StorageOptions = None,
) -> None:
    """Copy the file at ``path`` (a URL such as ``s3://bucket/a/b.pt``, or a local path) to the local file
    ``destination``, atomically: a failed copy leaves no file there. An existing ``destination`` is a
    ``FileExistsError`` unless ``overwrite``. ``object_store`` (Composer's client objects) is refused: the URL says
    where the file is, and ``storage_options`` go to fsspec (endpoint, credentials). ``progress_bar`` is accepted for
    Composer's signature and shows nothing."""
    if object_store is not None:
        raise ValueError(
            f"get_file(object_store={type(object_store).__name__}): object stores are fsspec URLs here; pass the "
            "file's URL as path (e.g. 's3://bucket/key') and storage_options= for the endpoint or credentials."
        )
    target = Path(destination)
    if target.exists() and not overwrite:
        raise FileExistsError(f"get_file: {target} exists; pass overwrite=True to replace it.")
    fs, inner = filesystem(path, storage_options)
    if not fs.isfile(inner):
        raise FileNotFoundError(f"get_file: {path!r} is not a file.")
    target.parent.mkdir(parents=True, exist_ok=True)
    with owned_temporary(target) as temporary:
        fs.get_file(inner, os.fspath(temporary))
        os.replace(temporary, target)


def maybe_create_remote_uploader_downloader_from_uri(uri: str, loggers: object = None) -> None:
    """``None`` for a local path (nothing to upload: the files are written there); a URL is refused, naming what
    writes there instead (Composer's uploader objects do not exist here: writers take the URL itself)."""
    backend, _, _ = parse_uri(uri)
    if backend:
        raise ValueError(
            f"{uri!r}: remote folders are written through fsspec URLs here (save_folder='{uri}', with "
            "storage_options=); there is no RemoteUploaderDownloader. Give a local folder to this callback."
        )
    return None
