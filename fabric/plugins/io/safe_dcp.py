"""Reading sharded (DCP) checkpoint directories without running code from them (``weights_only=True``).

``torch.distributed.checkpoint`` reads a directory's ``.metadata`` file with plain ``pickle`` and every
non-tensor entry (``"step"``, byte blobs, ...) with ``torch.load(weights_only=False)``, so a crafted
directory runs arbitrary code on load. Here the metadata is read by an unpickler that builds only DCP's
own metadata classes and plain values, storage files must be plain relative names inside the directory
(checked as strings, so the rule holds for fsspec URLs too), and non-tensor
entries are read with ``torch.load(weights_only=True)``. Anything refused is a :class:`CheckpointError`
naming the entry.
"""

from __future__ import annotations

import io
import ntpath
import os
import pickle
import posixpath
from typing import IO, Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

from fabric.plugins.io.torch_io import refusal_detail
from fabric.utilities.exceptions import CheckpointError

_METADATA_ENTRY = ".metadata"
_TRUST_ADVICE = "Only if you trust where this checkpoint came from, load it with weights_only=False."

#: What a ``.metadata`` file may name: DCP's metadata records and the plain values inside them.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    # DCP records the path a checkpoint was saved to (``storage_meta.checkpoint_id``, never read from) as
    # given, often a ``Path``; storage file names must be plain strings (checked after unpickling).
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _dtype_names() -> set[str]:
    """``float32``, ``bfloat16``, ...: tensor dtypes pickle as ``torch.<name>``."""
    return {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata, refusing every other class or function the file names."""

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _dtype_names()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's checkpoint metadata")

    @override
    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not part of DCP's checkpoint metadata")


def read_safe_metadata(file: IO[bytes] | io.IOBase) -> Metadata:
    """Unpickle a ``.metadata`` file, allowing only DCP's own records."""
    try:
        metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"entry {_METADATA_ENTRY!r} holds objects that safe loading (weights_only=True) refuses: "
            f"{error}. {_TRUST_ADVICE}"
        ) from error
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"entry {_METADATA_ENTRY!r} is truncated or corrupt: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"entry {_METADATA_ENTRY!r} holds a {type(metadata).__name__}, not DCP metadata.")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        problem = _storage_file_problem(relative)
        if problem:
            raise CheckpointError(
                f"entry {_METADATA_ENTRY!r} names the storage file {relative!r}, which {problem}; "
                "a storage file must be a plain relative file name (str) inside the checkpoint directory."
            )
    return metadata


def _storage_file_problem(relative: object) -> str | None:
    """Why the storage file name ``relative`` must not be read, or ``None`` if it lies inside the directory.

    DCP writes plain strings; any other object (a ``PosixPath`` with forged private slots says one path in
    ``str()`` and joins as another) is refused. The check is on the string alone, so it holds for fsspec URLs.
    """
    if not isinstance(relative, str):
        return f"is a {type(relative).__name__}, not a str"
    if not relative.strip() or "\0" in relative:
        return "is empty or holds a NUL byte"
    portable = relative.replace("\\", "/")  # a Windows reader takes a backslash for a separator
    joined = posixpath.normpath(posixpath.join("/checkpoint", portable))
    if ntpath.splitdrive(relative)[0] or not joined.startswith("/checkpoint/"):
        return "is not inside the checkpoint directory"
    return None


class _SafeMetadataReader(FileSystemReader):
    """DCP's reader with the metadata read by :func:`read_safe_metadata`.

    The metadata is read when the reader is made, so a refused file fails here with its own error
    (DCP would log it and go on to look for per-rank metadata files).
    """

    def _read_safe_metadata(self) -> None:
        with self.fs.create_stream(self._get_metadata_path(), "rb") as file:
            self._metadata = read_safe_metadata(file)

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{os.fspath(self.path)!r} has no global {_METADATA_ENTRY!r} entry.")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeFileSystemReader(_SafeMetadataReader):
    """The safe reader of a checkpoint on a local (or mounted) disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._read_safe_metadata()


class SafeFsspecReader(FsspecReader, _SafeMetadataReader):
    """The safe reader of a checkpoint at an fsspec URL (``s3://...``); ``storage_options`` go to fsspec."""

    def __init__(self, path: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self._read_safe_metadata()


def load_entry(value: io.BytesIO, entry: str) -> Any:
    """A non-tensor entry, read with ``torch.load(weights_only=True)``."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"entry {entry!r} holds objects that safe loading (weights_only=True) refuses: "
            f"{refusal_detail(error)}. {_TRUST_ADVICE}"
        ) from error


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by :func:`load_entry`."""

    @override
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_entry(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeWholeLoadPlanner(_EmptyStateDictLoadPlanner, SafeLoadPlanner):
    """The planner that reads a whole checkpoint into an empty dict, with safe non-tensor entries."""
