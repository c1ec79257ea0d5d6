"""Sharded checkpoints: directories written by ``torch.distributed.checkpoint`` (DCP), one file per rank.

A sharded checkpoint is written atomically: every rank writes into a temporary sibling directory,
and only once all ranks have finished does rank 0 rename it over the target. It can be read back
whole in one process without a process group (:func:`read_checkpoint`, ``fabric consolidate``), in
which case optimizer states, saved keyed by parameter name, are given back in the plain
``optimizer.state_dict()`` form (parameters numbered in parameter-group order).

``torch.distributed.checkpoint`` is imported on first use: it is heavy and most jobs never need it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fabric.plugins.io.checkpoint_io import CheckpointIO, PathType
from fabric.plugins.io.temporaries import remove_abandoned, temporary_sibling
from fabric.utilities.exceptions import CheckpointError

#: The file DCP writes last, listing every shard; its presence is what makes a directory a checkpoint.
METADATA_FILE = ".metadata"


def is_distributed_checkpoint(path: PathType) -> bool:
    """Whether ``path`` is a local directory holding a DCP checkpoint."""
    return (Path(os.fspath(path)) / METADATA_FILE).is_file()


def local_directory(path: PathType) -> Path:
    """``path`` as a local directory path; sharded checkpoints are written to local (or mounted) disks only."""
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(
            f"Sharded checkpoints are written to local paths; got {text!r}. "
            "Use FSDPStrategy(state_dict_type='full') to save one file to an fsspec URL."
        )
    return Path(text)


def _without_process_group() -> bool:
    """Whether this process works alone: DCP then reads and writes without collectives (and does not warn
    that it assumes so)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_warning_silenced() -> Iterator[None]:
    """torch 2.13's DCP warns that it "assumes the intent" to work in one process even when told so
    (``no_dist=True``); one process is a case Fabric supports on purpose (loading on fewer ranks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def temporary_directory(target: Path) -> Path:
    """A fresh sibling of ``target`` to write into before the rename (call on one rank, then broadcast)."""
    return temporary_sibling(target)


def write_shards(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its shards of ``state`` into ``directory`` (a collective)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with _single_process_warning_silenced():
        save(state, checkpoint_id=directory, no_dist=_without_process_group())


def publish(temporary: Path, target: Path) -> None:
    """Replace ``target`` by the finished ``temporary`` directory (rank 0, after every rank wrote).

    A previous checkpoint at ``target`` is moved aside first and deleted only after the new one is in
    place, so a crash at any moment leaves one complete checkpoint at ``target`` or beside it. What
    killed saves left beside ``target`` (half-written or set-aside directories) is deleted then too.
    """
    previous = None
    if target.exists():
        previous = temporary_sibling(target, "old")
        os.replace(target, previous)
    os.replace(temporary, target)
    if previous is not None:
        shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
    remove_abandoned(target, kinds=("tmp", "old"))


def _reader(path: PathType, weights_only: bool) -> Any:
    """DCP's file reader; under ``weights_only`` the one that refuses anything but DCP's own metadata."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from fabric.plugins.io.safe_dcp import SafeFileSystemReader

    return (SafeFileSystemReader if weights_only else FileSystemReader)(os.fspath(path))


def read_metadata_keys(path: PathType, weights_only: bool = True) -> set[str]:
    """The top-level entries (``"model"``, ``"step"``, ...) a sharded checkpoint holds."""
    with _as_checkpoint_error(path, "is not a readable sharded checkpoint"):
        metadata = _reader(path, weights_only).read_metadata()
    planner_data = metadata.planner_data or {}
    return {str(planner_data[key][0]) if key in planner_data else key for key in metadata.state_dict_metadata}


def load_shards(state: dict[str, Any], path: PathType, strict: bool = True, weights_only: bool = True) -> None:
    """Fill the tensors and values of ``state`` in place from the checkpoint (a collective)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    from fabric.plugins.io.safe_dcp import SafeLoadPlanner

    planner = (SafeLoadPlanner if weights_only else DefaultLoadPlanner)(allow_partial_load=not strict)
    with _as_checkpoint_error(path, "could not be loaded"), _single_process_warning_silenced():
        load(state, storage_reader=_reader(path, weights_only), planner=planner, no_dist=_without_process_group())


def read_whole(path: PathType, keys: set[str] | None = None, weights_only: bool = True) -> dict[str, Any]:
    """Read a sharded checkpoint (or only its top-level ``keys``) whole into this process.

    Needs no process group. Optimizer states come back in the plain ``optimizer.state_dict()`` form.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from fabric.plugins.io.safe_dcp import SafeWholeLoadPlanner

    # The private loader fills ``checkpoint`` itself (``dcp.load`` would fill a copy): what torch's own
    # ``format_utils.dcp_to_torch_save`` does.
    checkpoint: dict[str, Any] = {}
    planner = (SafeWholeLoadPlanner if weights_only else _EmptyStateDictLoadPlanner)(keys=keys)  # type: ignore[no-untyped-call]
    with _as_checkpoint_error(path, "is not a readable sharded checkpoint"):
        _load_state_dict(checkpoint, storage_reader=_reader(path, weights_only), planner=planner, no_dist=True)
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
        causes = sorted({_describe(cause) for cause, _ in error.failures.values()})
        raise CheckpointError(f"{prefix}: {'; '.join(causes)}") from error
    except CheckpointError as error:
        raise CheckpointError(f"{prefix}: {error}") from error
    except (OSError, ValueError, RuntimeError, KeyError, AssertionError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{prefix}: {_describe(error)}") from error


def _describe(cause: BaseException) -> str:
    """One rank's error; ours (a refused entry, ...) say what they are without their type name."""
    return str(cause) if isinstance(cause, CheckpointError) else f"{type(cause).__name__}: {cause}"


def read_checkpoint(checkpoint_io: CheckpointIO, path: PathType, *, weights_only: bool = True) -> Any:
    """Read a checkpoint file with ``checkpoint_io``, or a whole sharded checkpoint directory."""
    if is_distributed_checkpoint(path):
        return read_whole(path, weights_only=weights_only)
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


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
