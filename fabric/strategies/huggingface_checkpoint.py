"""``fabric.save(path, {"model": model}, format="huggingface")`` and loading such a folder, for every strategy that
holds its module's parameters itself (one device, DDP, FSDP2 and HSDP, tensor parallelism).

DCP's ``get_model_state_dict`` gives each rank what it holds (DTensor shards under FSDP2 and TP, full tensors
otherwise), so one path serves them all: every rank writes its part into a temporary sibling of the destination,
rank 0 merges the parts into Hugging Face's files, and the folder is renamed into place only when complete (a
previous folder at the destination stays until then). Loading checks every name and shape against the files'
headers first, so a mismatch changes nothing. A folder at a URL loads from a copy in each node's temporary directory,
made by the node's first rank and removed after the load. Saving to an object store URL, the weight files are shared
out among the ranks: each makes the tensors of its own files whole (one file's on its CPU at a time) and uploads them,
and rank 0 publishes the folder with its index last.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from fabric.plugins.io.background_saves import finished
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.distributed_checkpoint import new_generation, temporary_directory
from fabric.plugins.io.huggingface import (
    FolderUpload,
    check_upload_target,
    compile_key_mapping,
    config_files,
    download_weights,
    finish_folder,
    names_to_read,
    read_huggingface,
    removed_on_failure,
    tied_names,
    upload_weight_files,
    write_huggingface,
)
from fabric.plugins.io.storage import is_remote
from fabric.plugins.io.temporaries import remove_temporary
from fabric.utilities.exceptions import CheckpointError

if TYPE_CHECKING:
    from fabric.strategies.strategy import Strategy


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """What this rank holds of each of ``module``'s tensors: a DTensor's shard under FSDP2 and TP, else the tensor."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # DCP and DTensor: 0.4 s to import

    state_dict = get_model_state_dict(module)
    weights = {name: value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}
    if len(weights) != len(state_dict):
        others = sorted(set(state_dict) - set(weights))
        raise ValueError(f"A Hugging Face folder holds tensors only; {type(module).__name__} also has {others}.")
    return weights


def check_supported(strategy: Strategy, action: str) -> None:
    """Refuse, in one line, a strategy that cannot hold a Hugging Face folder."""
    if strategy.huggingface_refusal is not None:
        raise ValueError(f"{action} a Hugging Face folder: {strategy.huggingface_refusal}")


def save_huggingface(
    strategy: Strategy,
    path: PathType,
    module: nn.Module,
    max_file_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    files: Mapping[str, bytes] | None = None,
    storage_options: StorageOptions = None,
    async_save: bool = False,
) -> Future[None]:
    """Write ``module``'s weights (in ``dtype`` when given) to the folder ``path`` in Hugging Face's layout, with a
    ``transformers`` model's config and ``files`` (a tokenizer's) beside them (a collective; call
    :func:`check_supported` first). For a URL, every rank uploads the weight files it owns, and rank 0 then the index
    (:class:`~fabric.plugins.io.huggingface.FolderUpload`). ``async_save`` (to a folder on a file system): each rank's
    shards copied now, written on its save thread; the future completes once the folder is in place."""
    files = {**config_files(module), **(files or {})}
    if is_remote(path):
        if async_save:
            raise ValueError(
                f"async_save=True writes a Hugging Face folder on a file system; {os.fspath(path)!r} is a URL, where "
                "the ranks make their files' tensors whole (collectives of training's): save it synchronously."
            )
        check_upload_target(path)
        _save_to_url(strategy, path, module, max_file_bytes, dtype, files, storage_options)
        return finished()
    state_dict = _weights(module)
    target = Path(path)
    owner = strategy.is_global_zero
    temporary: Path = strategy.broadcast(temporary_directory(target) if owner else None)
    if async_save:
        snapshot = strategy.background_saves.snapshot(state_dict)

        def write_part(group: object) -> None:
            with removed_on_failure(temporary, owner=owner):  # the shards' writes fail on every rank alike (DCP)
                write_huggingface(snapshot, temporary, max_file_bytes, dtype, process_group=group, target=target)

        def publish() -> None:
            with removed_on_failure(temporary):
                finish_folder(temporary, target, files)

        return strategy.write_parts_in_background(write_part, publish if owner else None, repr(os.fspath(path)))
    with removed_on_failure(temporary, owner=owner):
        write_huggingface(state_dict, temporary, max_file_bytes, dtype, target=target)
        strategy.barrier("huggingface_written")
        if owner:
            finish_folder(temporary, target, files)
    strategy.barrier("huggingface_published")
    return finished()


def load_huggingface(
    strategy: Strategy,
    path: PathType,
    module: nn.Module,
    strict: bool,
    key_mapping: Mapping[str, str] | None,
    storage_options: StorageOptions = None,
) -> None:
    """Fill ``module`` from the Hugging Face folder ``path`` (a directory or a URL), each rank reading its shards (a
    collective). ``key_mapping`` renames the folder's tensors to the model's names (regex -> replacement, as
    ``transformers``); ``storage_options`` go to fsspec for a URL."""
    check_supported(strategy, "Loading")
    patterns = compile_key_mapping(key_mapping)
    state_dict = _weights(module)
    shapes = {name: tuple(value.shape) for name, value in state_dict.items()}
    with _local_folder(strategy, path, storage_options) as folder:
        names = names_to_read(folder, shapes, strict, patterns, tied_names(state_dict))
        read_huggingface({saved_name: state_dict[name] for name, saved_name in names.items()}, folder)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, {name: state_dict[name] for name in names}, options=StateDictOptions(strict=False))


@contextlib.contextmanager
def _local_folder(strategy: Strategy, path: PathType, storage_options: StorageOptions) -> Iterator[Path]:
    """``path`` itself on a file system. For a URL, a copy of its weights in this node's temporary directory, made
    by the node's first rank (the ranks of a node share it) and removed once every rank has read it; a failed copy
    on any node fails every rank with its message."""
    if not is_remote(path):
        yield Path(path)
        return
    name = strategy.broadcast(f"fabric-huggingface-{uuid.uuid4().hex}" if strategy.is_global_zero else None)
    folder = Path(tempfile.gettempdir()) / name
    copies = strategy.local_rank == 0
    failure = ""
    if copies:
        folder.mkdir()
        try:
            download_weights(path, folder, storage_options)
        except Exception as error:  # every rank must learn of it, not wait for this one at the next collective
            failure = str(error).rstrip(".") or type(error).__name__
    failed = strategy.all_reduce(torch.tensor(float(bool(failure)), device=strategy.root_device), reduce_op="sum")
    try:
        if failed.item():
            raise CheckpointError(
                f"Copying the Hugging Face folder {os.fspath(path)!r} to a local disk failed on "
                f"{int(failed.item())} node(s){': ' + failure if failure else ''}; nothing was loaded."
            )
        yield folder
        strategy.barrier("huggingface_read")
    finally:
        if copies:
            remove_temporary(folder)


def _save_to_url(
    strategy: Strategy,
    url: PathType,
    module: nn.Module,
    max_file_bytes: int,
    dtype: torch.dtype | None,
    files: Mapping[str, bytes],
    storage_options: StorageOptions = None,
) -> None:
    """Every rank puts up the weight files it owns (file ``i`` is rank ``(i - 1) % world_size``'s), the tensors of
    each made whole one at a time and kept on the CPU by their owner only; once every rank's are up, rank 0 publishes
    the folder with its index. A failure on any rank deletes this save's files and fails every rank, naming it."""
    weights = _weights(module)
    tied = tied_names(weights)  # a gathered copy no longer shares its tensor: read the ties first
    rank, world_size = strategy.global_rank, strategy.world_size
    generation = strategy.broadcast(new_generation() if strategy.is_global_zero else None)
    upload = FolderUpload(url, generation, storage_options)
    weight_map, total_size, failure = upload_weight_files(
        upload,
        {name: value for name, value in weights.items() if name not in tied},
        max_file_bytes,
        dtype,
        owns=lambda number: (number - 1) % world_size == rank,
        whole=_whole_tensor,
    )
    failed = _first_failure(strategy, _described(failure))
    if failed is None and strategy.is_global_zero:
        try:
            upload.publish(weight_map, total_size, files)
        except Exception as error:
            failed = (0, _described(error))
    failed = strategy.broadcast(failed)
    if failed is not None:
        if strategy.is_global_zero:
            upload.abandon(weight_map)
        raise CheckpointError(
            f"Saving the Hugging Face folder {os.fspath(url)!r} failed on rank {failed[0]} ({failed[1]}); a folder "
            "there is as it was."
        )


def _whole_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` whole: a DTensor gathered from its shards (a collective over its mesh), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _described(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


def _first_failure(strategy: Strategy, failure: str) -> tuple[int, str] | None:
    """The lowest rank whose ``failure`` is not empty and its message, the same on every rank; None if none failed."""
    world_size = strategy.world_size
    mine = torch.tensor(float(strategy.global_rank if failure else world_size), device=strategy.root_device)
    first = int(strategy.all_reduce(mine, reduce_op="min").item())
    return None if first == world_size else (first, strategy.broadcast(failure, src=first))
