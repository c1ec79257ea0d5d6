"""Sharded checkpoints: directories written by ``torch.distributed.checkpoint`` (DCP), one file per rank.

Every rank writes its own shards straight to the destination, a local (or mounted) disk or an fsspec URL
(``s3://...``); DCP's coordinator writes the ``.metadata`` file, which lists every shard, last. A save is
complete, and loadable, only once every shard it lists is present:

- on a local disk the ranks write into a temporary sibling directory that rank 0 renames over the
  target once every rank finished, so a crash never damages the checkpoint already there;
- on an object store, which cannot rename a directory, the ranks write into the target itself, under shard
  names of this save's own (a *generation*: ``__<rank>_<generation>_<n>.distcp``), so the checkpoint already
  there keeps every file its ``.metadata`` lists. DCP writes the new ``.metadata`` last, in one request: that is
  the switch, atomic on an object store. Only then are the previous checkpoint's shards deleted (and those that
  killed saves left, once an hour old); a save killed at any moment leaves the previous checkpoint loadable, or
  the new one complete. A directory without ``.metadata`` is an unfinished save that no load takes for one.

Either way rank 0 checks that every shard the metadata lists is there before the save returns, so a path
that is not shared by all nodes (each node's own ``/tmp``) fails loudly instead of leaving a checkpoint with
a shard missing. A checkpoint can be read back whole in one process without a process group
(:func:`read_whole`, ``fabric consolidate``), in which case optimizer states, saved keyed by parameter
name, are given back in the plain ``optimizer.state_dict()`` form (parameters numbered in parameter-group
order).

``torch.distributed.checkpoint`` is imported on first use: it is heavy and most jobs never need it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import posixpath
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.storage import filesystem, fsspec_options, is_remote, require_bucket
from fabric.plugins.io.temporaries import (
    ABANDONED_AFTER,
    create_locked,
    last_written,
    release_lock,
    remove_abandoned,
    remove_temporary,
    temporary_sibling,
)
from fabric.plugins.io.write_errors import disk_full_error, is_disk_full
from fabric.utilities.exceptions import CheckpointError

#: The file DCP writes last, listing every shard: a directory is a complete checkpoint once it is there.
METADATA_FILE = ".metadata"
#: How DCP's shard files end.
SHARD_SUFFIX = ".distcp"


def _without_process_group() -> bool:
    """Whether this process works alone: DCP then reads and writes without collectives (and does not warn
    that it assumes so)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_warning_silenced() -> Iterator[None]:
    """torch 2.13's DCP warns that it "assumes the intent" to work in one process even when told so
    (``no_dist=True``); one process is a case Fabric supports on purpose (loading on fewer ranks)."""
    # torch-workaround(dcp-single-process-warning): DCP warns about one process even when told so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


#: The locks this process (rank 0) holds on the temporary directories of its sharded saves, from their creation
#: until :func:`publish`, so that a concurrent save never takes one for abandoned.
_LOCKS: dict[Path, int | None] = {}


def temporary_directory(target: Path) -> Path:
    """A fresh sibling of ``target`` to write into before the rename, created and locked until :func:`publish`
    (call on one rank, then broadcast)."""
    for discarded in [path for path in _LOCKS if not path.exists()]:  # of failed saves, which removed them
        release_lock(_LOCKS.pop(discarded))
    temporary = temporary_sibling(target)
    _LOCKS[temporary] = create_locked(temporary, directory=True)
    return temporary


def new_generation() -> str:
    """A name part of one remote save's shards (made on rank 0, broadcast to the others)."""
    return uuid.uuid4().hex[:16]


def write_shards(
    state: dict[str, Any],
    location: PathType,
    storage_options: StorageOptions = None,
    target: PathType | None = None,
    process_group: Any = None,
    generation: str | None = None,
) -> None:
    """Every rank writes its shards of ``state`` into the directory ``location`` (a collective, on
    ``process_group``: the default one unless given); at a URL, named with ``generation`` (required there).

    Failures (a full disk, a refused upload) on any rank are one :class:`CheckpointError` on every rank,
    naming ``target`` (the checkpoint's path, when ``location`` is a temporary directory for it).
    """
    target = location if target is None else target
    from torch.distributed.checkpoint.state_dict_saver import save

    if is_remote(location):
        if generation is None:
            raise ValueError("A sharded save to a URL needs its generation (new_generation()).")
        require_bucket(*filesystem(location, storage_options), target)
        writer = _remote_writer(location, storage_options, generation)
    else:
        writer = _local_writer(location)
    with written_or_checkpoint_error(target), _single_process_warning_silenced(), warnings.catch_warnings():
        # Replacing the checkpoint there is the point; its files stay until the new .metadata is written.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint in")
        save(state, storage_writer=writer, process_group=process_group, no_dist=_without_process_group())


@contextlib.contextmanager
def written_or_checkpoint_error(target: PathType) -> Iterator[None]:
    """DCP's failure to write ``target`` (its ``CheckpointException``, a ``BaseException`` that ``except Exception``
    misses, holding each failing rank's error) as one :class:`CheckpointError` naming it, the same on every rank; a
    full disk as the disk-full error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        if any(is_disk_full(cause) for cause, _ in error.failures.values()):
            raise disk_full_error(target) from error
        raise _checkpoint_error(error, f"{os.fspath(target)!r} could not be written") from error


def _remote_writer(location: PathType, storage_options: StorageOptions, generation: str) -> Any:
    """DCP's fsspec writer, naming the shards ``__<rank>_<generation>_<n>.distcp`` (DCP's names with this save's
    generation), so that they never overwrite the shards of the checkpoint already at ``location``."""
    import dataclasses

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class Writer(FsspecWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            # DCP names shards by rank only (``__<rank>_<n>``): the same names as the checkpoint already there
            return [
                dataclasses.replace(
                    plan,
                    storage_data=dataclasses.replace(
                        plan.storage_data, prefix=f"{plan.storage_data.prefix}{generation}_"
                    ),
                )
                for plan in super().prepare_global_plan(plans)
            ]

    # An object is durable once its upload finished: nothing to fsync (DCP would sync the whole local disk).
    return Writer(os.fspath(location), sync_files=False, **fsspec_options(location, storage_options))


def _local_writer(location: PathType) -> Any:
    """DCP's file writer, reporting a full disk as an ``OSError`` with its errno.

    ``torch.save`` turns a failed write into ``RuntimeError: unexpected pos``, keeping the ``OSError`` only
    as its context, which is lost when DCP gathers every rank's error (pickling drops it).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except Exception as error:
                if is_disk_full(error):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from error
                raise

    return Writer(os.fspath(location))


def missing_shards(location: PathType, storage_options: StorageOptions = None) -> list[str]:
    """The shard files the metadata at ``location`` lists that are not there (as this process sees it)."""
    listed = listed_shards(location, storage_options)
    fs, root = filesystem(location, storage_options)
    present = {posixpath.basename(entry.rstrip("/")) for entry in fs.ls(root, detail=False)}
    return sorted(name for name in listed if name not in present)


def listed_shards(location: PathType, storage_options: StorageOptions = None) -> set[str]:
    """The shard files the ``.metadata`` at ``location`` lists (none when there is no checkpoint there)."""
    fs, root = filesystem(location, storage_options)
    if not fs.exists(posixpath.join(root, METADATA_FILE)):
        return set()
    storage_data = _reader(location, True, storage_options).read_metadata().storage_data or {}
    return {str(info.relative_path) for info in storage_data.values()}


def remove_superseded_shards(location: PathType, previous: set[str], storage_options: StorageOptions = None) -> None:
    """After a remote save at ``location`` is complete: delete the shards that ``.metadata`` no longer lists, those
    of the checkpoint it replaced (``previous``) and those of saves killed over an hour ago (a younger one may
    belong to a save still being written)."""
    current = listed_shards(location, storage_options)
    fs, root = filesystem(location, storage_options)
    now = time.time()
    for entry in fs.ls(root, detail=True):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if not name.endswith(SHARD_SUFFIX) or name in current:
            continue
        modified = last_written(fs, entry)
        if name in previous or (modified is not None and now - modified > ABANDONED_AFTER):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(entry["name"])


def remove_generation(location: PathType, generation: str, storage_options: StorageOptions = None) -> None:
    """Delete the shards a failed remote save of ``generation`` wrote (the checkpoint there keeps its own)."""
    fs, root = filesystem(location, storage_options)
    with contextlib.suppress(FileNotFoundError):
        for entry in fs.ls(root, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            if name.endswith(SHARD_SUFFIX) and f"_{generation}_" in name:
                fs.rm(entry)


def unshared_storage_error(location: PathType, missing: list[str]) -> CheckpointError:
    return CheckpointError(
        f"The sharded checkpoint {os.fspath(location)!r} is missing shards other ranks wrote ({', '.join(missing)}): "
        "their nodes wrote them to a path rank 0 does not see. Save sharded checkpoints to storage every node "
        "shares (a shared file system, or an object store URL such as s3://bucket/folder); nothing was saved."
    )


def publish(temporary: Path, target: Path) -> None:
    """Replace ``target`` by the finished ``temporary`` directory (rank 0, after every rank wrote).

    A previous checkpoint at ``target`` is moved aside first and deleted only after the new one is in
    place, so a crash at any moment leaves one complete checkpoint at ``target`` or beside it. What
    killed saves left beside ``target`` (half-written or set-aside directories) is deleted then too.
    """
    previous = None
    try:
        if target.exists():
            previous = temporary_sibling(target, "old")
            os.replace(target, previous)
        os.replace(temporary, target)
    finally:
        release_lock(_LOCKS.pop(temporary, None))
    if previous is not None:
        remove_temporary(previous)
    remove_abandoned(target, kinds=("tmp", "old"))


def _reader(path: PathType, weights_only: bool, storage_options: StorageOptions = None) -> Any:
    """DCP's reader for a local path or URL; under ``weights_only`` the one that refuses anything but DCP's
    own metadata."""
    from fabric.plugins.io import safe_dcp

    if is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        remote = safe_dcp.SafeFsspecReader if weights_only else FsspecReader
        return remote(os.fspath(path), **fsspec_options(path, storage_options))
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return (safe_dcp.SafeFileSystemReader if weights_only else FileSystemReader)(os.fspath(path))


def read_metadata_keys(path: PathType, weights_only: bool = True, storage_options: StorageOptions = None) -> set[str]:
    """The top-level entries (``"model"``, ``"step"``, ...) a sharded checkpoint holds."""
    with _as_checkpoint_error(path, "is not a readable sharded checkpoint"):
        metadata = _reader(path, weights_only, storage_options).read_metadata()
    planner_data = metadata.planner_data or {}
    return {str(planner_data[key][0]) if key in planner_data else key for key in metadata.state_dict_metadata}


def load_shards(
    state: dict[str, Any],
    path: PathType,
    strict: bool = True,
    weights_only: bool = True,
    storage_options: StorageOptions = None,
) -> None:
    """Fill the tensors and values of ``state`` in place from the checkpoint (a collective)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    from fabric.plugins.io.safe_dcp import SafeLoadPlanner

    planner = (SafeLoadPlanner if weights_only else DefaultLoadPlanner)(allow_partial_load=not strict)
    with _as_checkpoint_error(path, "could not be loaded"), _single_process_warning_silenced():
        reader = _reader(path, weights_only, storage_options)
        load(state, storage_reader=reader, planner=planner, no_dist=_without_process_group())


def read_whole(
    path: PathType, keys: set[str] | None = None, weights_only: bool = True, storage_options: StorageOptions = None
) -> dict[str, Any]:
    """Read a sharded checkpoint (or only its top-level ``keys``) whole into this process.

    Needs no process group. Optimizer states come back in the plain ``optimizer.state_dict()`` form.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from fabric.plugins.io.safe_dcp import SafeWholeLoadPlanner

    # torch-workaround(dcp-load-fills-a-copy): ``dcp.load`` would fill a copy of ``checkpoint``; the private loader
    # fills it itself, as torch's own ``format_utils.dcp_to_torch_save`` does.
    checkpoint: dict[str, Any] = {}
    planner = (SafeWholeLoadPlanner if weights_only else _EmptyStateDictLoadPlanner)(keys=keys)  # type: ignore[no-untyped-call]
    with _as_checkpoint_error(path, "is not a readable sharded checkpoint"):
        reader = _reader(path, weights_only, storage_options)
        _load_state_dict(checkpoint, storage_reader=reader, planner=planner, no_dist=True)
    return {key: numbered_optimizer_state(value) for key, value in checkpoint.items()}


@contextlib.contextmanager
def _as_checkpoint_error(path: PathType, what: str) -> Iterator[None]:
    """Report DCP's errors (its ``CheckpointException`` is a ``BaseException`` holding each rank's own
    error) as one :class:`CheckpointError`: ``path``, ``what`` went wrong, and the causes."""
    from torch.distributed.checkpoint.api import CheckpointException

    prefix = f"{os.fspath(path)!r} {what}"
    try:
        yield
    except CheckpointException as error:
        raise _checkpoint_error(error, prefix) from error
    except CheckpointError as error:
        raise CheckpointError(f"{prefix}: {error}") from error
    except (OSError, ValueError, RuntimeError, KeyError, AssertionError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{prefix}: {_describe(error)}") from error


def _checkpoint_error(error: Any, prefix: str) -> CheckpointError:
    """DCP's ``CheckpointException`` (each failing rank's error and traceback) as one line after ``prefix``."""
    causes = sorted({_describe(cause) for cause, _ in error.failures.values()})
    return CheckpointError(f"{prefix}: {'; '.join(causes)}")


def _describe(cause: BaseException) -> str:
    """One rank's error; ours (a refused entry, ...) say what they are without their type name."""
    return str(cause) if isinstance(cause, CheckpointError) else f"{type(cause).__name__}: {cause}"


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"state", "param_groups"}


def numbered_optimizer_state(value: Any) -> Any:
    """Turn an optimizer state keyed by parameter names into the plain form keyed by position.

    Other values are returned unchanged.
    """
    if not _is_optimizer_state(value):
        return value
    names = [name for group in value["param_groups"] for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        return value  # already numbered
    index = {name: position for position, name in enumerate(names)}
    groups, position = [], 0
    for group in value["param_groups"]:
        groups.append({**group, "params": list(range(position, position + len(group["params"])))})
        position += len(group["params"])
    return {"state": {index[name]: entry for name, entry in value["state"].items()}, "param_groups": groups}


def named_optimizer_state(value: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`numbered_optimizer_state`, given the parameter names in group order."""
    numbered = [position for group in value["param_groups"] for position in group["params"]]
    if len(numbered) != len(names):
        raise CheckpointError(
            f"The optimizer state lists {len(numbered)} parameters, but the optimizer has {len(names)}."
        )
    name_of = dict(zip(numbered, names, strict=True))
    groups, cursor = [], 0
    for group in value["param_groups"]:
        groups.append({**group, "params": names[cursor : cursor + len(group["params"])]})
        cursor += len(group["params"])
    return {"state": {name_of[position]: entry for position, entry in value["state"].items()}, "param_groups": groups}
