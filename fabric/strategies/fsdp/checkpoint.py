"""Checkpoints of FSDP-sharded modules and their optimizers: functions the FSDP strategies call.

- Sharded (default): every rank writes its own shards into a DCP directory on a shared disk or at an
  fsspec URL, complete only once every rank's shards are there (see
  :mod:`fabric.plugins.io.distributed_checkpoint`). Any number of ranks can load it back, and one
  process can read it whole (``fabric consolidate``).
- Full: the state gathered on rank 0 and written as one ``torch.save`` file, optimizer states in the
  plain ``optimizer.state_dict()`` form, so a single-device run loads it directly.

Model and optimizer states go through ``torch.distributed.checkpoint.state_dict`` (``get_*``/``set_*``).
A load reads into copies first and touches the user's objects only once everything has been read.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from fabric.plugins.io.background_saves import BackgroundSaves, finished
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.distributed_checkpoint import (
    listed_shards,
    load_shards,
    missing_shards,
    named_optimizer_state,
    new_generation,
    numbered_optimizer_state,
    publish,
    read_metadata_keys,
    read_whole,
    remove_generation,
    remove_superseded_shards,
    temporary_directory,
    unshared_storage_error,
    write_shards,
)
from fabric.plugins.io.storage import is_remote
from fabric.plugins.precision.precision import Precision
from fabric.strategies.strategy import (
    FRAMEWORK_KEYS,
    PRECISION_STATE_KEY,
    entries_to_load,
    load_unvalidated_state,
)
from fabric.utilities.checkpoint_state import Stateful, loaded_value, rebuilt_loaders, saved_form
from fabric.utilities.exceptions import CheckpointError

#: ``owner_of(optimizer)``: the set-up module whose sharded parameters the optimizer updates.
OwnerOf = Callable[[Optimizer], nn.Module]

#: Gather everything on rank 0, in CPU memory (the other ranks get empty dicts).
_FULL_ON_RANK_ZERO = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Ranks(Protocol):
    """The collectives a sharded save needs (a strategy provides them)."""

    @property
    def is_global_zero(self) -> bool: ...

    def barrier(self, name: str | None = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


# --- full state (one file) ----------------------------------------------------------------------------


def full_module_state(module: nn.Module) -> dict[str, Any]:
    """The unsharded state dict, gathered on rank 0 (other ranks get an empty dict)."""
    return get_model_state_dict(module, options=_FULL_ON_RANK_ZERO)


def full_optimizer_state(owner: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's full state in ``optimizer.state_dict()`` form, gathered on rank 0."""
    state = get_optimizer_state_dict(owner, optimizer, options=_FULL_ON_RANK_ZERO)
    return numbered_optimizer_state(state) if state else {}


def load_full_module_state(module: nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    with _sharding_renamed_entries(module):
        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


@contextlib.contextmanager
def _sharding_renamed_entries(module: nn.Module) -> Iterator[None]:
    """While a whole state dict loads: an entry that reaches a sharded parameter whole is sharded as it, locally.

    torch shards the entries named as the model's state dict names them; a module whose ``_load_from_state_dict``
    renames entries of an older layout (litgpt's LoRA layers: ``qkv.weight`` into ``qkv.linear.weight``) hands the
    parameter a whole tensor, which ``copy_`` refuses beside a DTensor. Every rank holds the whole state dict here,
    so each takes its own shard without a collective.
    """

    def shard_whole_entries(owner: nn.Module, entries: dict[str, Any], prefix: str, *rest: Any) -> None:
        for name, parameter in [*owner._parameters.items(), *owner._buffers.items()]:
            entry = entries.get(prefix + name)
            if isinstance(parameter, DTensor) and isinstance(entry, torch.Tensor) and not isinstance(entry, DTensor):
                entries[prefix + name] = distribute_tensor(
                    entry.to(parameter.device), parameter.device_mesh, parameter.placements, src_data_rank=None
                )

    handles = [
        child.register_load_state_dict_pre_hook(shard_whole_entries)  # type: ignore[no-untyped-call]
        for child in module.modules()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def load_full_optimizer_state(owner: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    if not state_dict.get("state"):
        # No per-parameter state (SGD without momentum): only the groups' settings. torch's full-state load finds
        # the device in the local state and stops with "Expected device to be set" when there is none.
        optimizer.load_state_dict(state_dict)
        return
    named = named_optimizer_state(state_dict, _parameter_names(owner, optimizer))
    set_optimizer_state_dict(owner, optimizer, named, options=StateDictOptions(full_state_dict=True))


# --- sharded state (a directory) ----------------------------------------------------------------------


def save_sharded(
    path: PathType,
    state: dict[str, Any],
    owner_of: OwnerOf,
    precision: Precision,
    ranks: Ranks,
    storage_options: StorageOptions = None,
    background: tuple[BackgroundSaves, ProcessGroup] | None = None,
) -> Future[None]:
    """Every rank writes its shards; the save counts only once rank 0 sees all of them at the destination.

    With ``background`` (the saves in flight and a process group of their own, so that their collectives
    never interleave with training's), each rank writes a CPU snapshot of its shards on a background thread.
    """
    checkpoint = {key: _sharded_state_of(value, owner_of) for key, value in state.items()}
    precision_state = precision.state_dict()
    if precision_state:
        checkpoint[PRECISION_STATE_KEY] = precision_state
    plan = None
    if is_remote(path):
        # Written beside the checkpoint there under names of its own, which stays loadable until the switch.
        destination: PathType = os.fspath(path)
        plan = ranks.broadcast(_remote_plan(path, storage_options) if ranks.is_global_zero else None)
    else:
        destination = ranks.broadcast(temporary_directory(Path(path)) if ranks.is_global_zero else None)
        if ranks.is_global_zero:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    ranks.barrier("save_sharded_start")
    if background is None:
        _write_and_commit(checkpoint, destination, path, ranks, storage_options, plan)
        return finished()
    saves, group = background
    snapshot = saves.snapshot(checkpoint)
    group_ranks = _GroupRanks(group, ranks.is_global_zero)
    write = functools.partial(_write_and_commit, snapshot, destination, path, group_ranks, storage_options, plan, group)
    return saves.submit(write, repr(os.fspath(path)))


class _RemotePlan(NamedTuple):
    """A remote save's shard names (its generation) and the shards of the checkpoint it replaces."""

    generation: str
    previous: set[str]


def _remote_plan(location: PathType, storage_options: StorageOptions) -> _RemotePlan:
    return _RemotePlan(new_generation(), listed_shards(location, storage_options))


def _write_and_commit(
    checkpoint: dict[str, Any],
    destination: PathType,
    path: PathType,
    ranks: Ranks,
    storage_options: StorageOptions,
    remote: _RemotePlan | None = None,
    group: ProcessGroup | None = None,
) -> None:
    """Write every rank's shards to ``destination``; once rank 0 sees all of them, publish it as ``path`` (a local
    temporary directory is renamed; at a URL the new ``.metadata`` was the switch, and the replaced shards go)."""
    generation = None if remote is None else remote.generation
    try:
        write_shards(checkpoint, destination, storage_options, target=path, process_group=group, generation=generation)
        ranks.barrier("save_sharded_written")
        missing = ranks.broadcast(missing_shards(destination, storage_options) if ranks.is_global_zero else None)
        if missing:
            raise unshared_storage_error(path, missing)
    except BaseException:
        _discard(destination, generation, ranks, storage_options)
        raise
    if ranks.is_global_zero:
        if remote is None:
            publish(Path(destination), Path(path))
        else:
            remove_superseded_shards(destination, remote.previous, storage_options)


class _GroupRanks:
    """The collectives of a background save, on the process group it was given."""

    def __init__(self, group: ProcessGroup, is_global_zero: bool) -> None:
        self.group = group
        self.is_global_zero = is_global_zero

    def barrier(self, name: str | None = None) -> None:
        dist.barrier(group=self.group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def _discard(destination: PathType, generation: str | None, ranks: Ranks, storage_options: StorageOptions) -> None:
    """Remove what a failed save wrote: at a URL its generation's shards (rank 0; the checkpoint there keeps its
    own), or the temporary directory as each rank sees it (on disks that are not shared, each node wrote its own)."""
    if generation is not None:
        if ranks.is_global_zero:
            remove_generation(destination, generation, storage_options)
    else:
        shutil.rmtree(destination, ignore_errors=True)


def load_sharded(
    path: PathType,
    state: dict[str, Any],
    owner_of: OwnerOf,
    precision: Precision,
    *,
    strict: bool,
    weights_only: bool,
    storage_options: StorageOptions = None,
) -> dict[str, Any]:
    """Load into the sharded objects of ``state``; return the checkpoint entries not asked for."""
    available = read_metadata_keys(path, weights_only=weights_only, storage_options=storage_options)
    keys = entries_to_load(path, state, available, strict)
    optimizers = [state[key] for key in keys if isinstance(state[key], Optimizer)]
    backups = [(optimizer, copy.deepcopy(optimizer.state_dict())) for optimizer in optimizers]
    targets = {key: _copy_tensors(_sharded_state_of(state[key], owner_of)) for key in keys}
    if PRECISION_STATE_KEY in available and precision.state_dict():
        targets[PRECISION_STATE_KEY] = _copy_tensors(precision.state_dict())
    try:
        load_shards(targets, path, strict=strict, weights_only=weights_only, storage_options=storage_options)
    except CheckpointError as error:
        for optimizer, backup in backups:  # reading the state dict may have initialised the optimizer
            optimizer.load_state_dict(backup)
        raise CheckpointError(f"{error} Nothing was changed.") from error
    load_unvalidated_state(path, precision, state, targets, keys)
    for key in keys:
        target = state[key]
        if isinstance(target, nn.Module):
            set_model_state_dict(target, targets[key], options=StateDictOptions(strict=strict))
        elif isinstance(target, Optimizer):
            set_optimizer_state_dict(owner_of(target), target, targets[key])
        elif not isinstance(target, Stateful):
            state[key] = loaded_value(target, targets[key], weights_only)
    rest = available - set(state) - FRAMEWORK_KEYS
    if not rest:
        return {}
    return rebuilt_loaders(
        read_whole(path, keys=rest, weights_only=weights_only, storage_options=storage_options), weights_only
    )


def _sharded_state_of(value: object, owner_of: OwnerOf) -> Any:
    if isinstance(value, nn.Module):
        return get_model_state_dict(value)
    if isinstance(value, Optimizer):
        return get_optimizer_state_dict(owner_of(value), value)
    return saved_form(value)


def _parameter_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The names in ``module`` of the optimizer's parameters, in parameter-group order."""
    name_of = {id(parameter): name for name, parameter in module.named_parameters()}
    parameters: Iterable[torch.Tensor] = (p for group in optimizer.param_groups for p in group["params"])
    return [name_of[id(parameter)] for parameter in parameters]


def _copy_tensors(value: object) -> Any:
    """A copy of ``value`` whose tensors (shards included) are new, so loading into it changes nothing else."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_tensors(item) for item in value)
    return value
