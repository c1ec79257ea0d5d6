"""``fabric.save(path, {"model": model}, format="huggingface")`` and loading such a folder, for every strategy that
holds its module's parameters itself (one device, DDP, FSDP2 and HSDP, tensor parallelism).

DCP's ``get_model_state_dict`` gives each rank what it holds (DTensor shards under FSDP2 and TP, full tensors
otherwise), so one path serves them all: every rank writes its part into a temporary sibling of the destination,
rank 0 merges the parts into Hugging Face's files, and the folder is renamed into place only when complete (a
previous folder at the destination stays until then). Loading checks every name and shape against the files'
headers first, so a mismatch changes nothing. A folder at a URL loads from a copy in each node's temporary directory,
made by the node's first rank and removed after the load; saving to an object store URL, rank 0 gathers the weights
whole, writes the folder locally and uploads it, its index last.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.distributed_checkpoint import temporary_directory
from fabric.plugins.io.huggingface import (
    check_upload_target,
    compile_key_mapping,
    config_files,
    download_weights,
    finish_folder,
    names_to_read,
    read_huggingface,
    removed_on_failure,
    tied_names,
    write_huggingface,
    write_huggingface_to_url,
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
) -> None:
    """Write ``module``'s weights (in ``dtype`` when given) to the folder ``path`` in Hugging Face's layout, with a
    ``transformers`` model's config and ``files`` (a tokenizer's) beside them (a collective; call
    :func:`check_supported` first). For a URL, rank 0 gathers the weights whole, writes the folder in its temporary
    directory and uploads it (:func:`~fabric.plugins.io.huggingface.upload_folder`)."""
    if is_remote(path):
        check_upload_target(path)
        files = {**config_files(module), **(files or {})}
        _save_to_url(strategy, path, module, max_file_bytes, dtype, files, storage_options)
        return
    state_dict = _weights(module)
    target = Path(path)
    temporary: Path = strategy.broadcast(temporary_directory(target) if strategy.is_global_zero else None)
    with removed_on_failure(temporary, owner=strategy.is_global_zero):
        write_huggingface(state_dict, temporary, max_file_bytes, dtype)
        strategy.barrier("huggingface_written")
        if strategy.is_global_zero:
            finish_folder(temporary, target, {**config_files(module), **(files or {})})
    strategy.barrier("huggingface_published")


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
    """Rank 0 gathers every tensor whole (CPU memory for the model), writes the folder locally and uploads it; the
    other ranks wait for the outcome, which they raise too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    tied = tied_names(_weights(module))  # a gathered copy no longer shares its tensor: read the ties before
    whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = ""
    if strategy.is_global_zero:
        weights = {name: value for name, value in whole.items() if isinstance(value, torch.Tensor) and name not in tied}
        try:
            write_huggingface_to_url(weights, url, max_file_bytes, files, dtype, storage_options)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
    failure = strategy.broadcast(failure)
    if failure:
        raise CheckpointError(
            f"Saving the Hugging Face folder {os.fspath(url)!r} failed on rank 0 ({failure}); a folder there is as "
            "it was."
        )
