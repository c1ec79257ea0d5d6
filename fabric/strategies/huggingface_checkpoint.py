"""``fabric.save(path, {"model": model}, format="huggingface")`` and loading such a folder, for every strategy that
holds its module's parameters itself (one device, DDP, FSDP2 and HSDP, tensor parallelism).

DCP's ``get_model_state_dict`` gives each rank what it holds (DTensor shards under FSDP2 and TP, full tensors
otherwise), so one path serves them all: every rank writes its part into a temporary sibling of the destination,
rank 0 merges the parts into Hugging Face's files, and the folder is renamed into place only when complete (a
previous folder at the destination stays until then). Loading checks every name and shape against the files'
headers first, so a mismatch changes nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from fabric.plugins.io.checkpoint_io import PathType
from fabric.plugins.io.distributed_checkpoint import publish, temporary_directory
from fabric.plugins.io.huggingface import (
    names_to_read,
    read_huggingface,
    remove_staging,
    write_config,
    write_huggingface,
)
from fabric.plugins.io.storage import is_remote
from fabric.plugins.io.temporaries import remove_temporary

if TYPE_CHECKING:
    from fabric.strategies.strategy import Strategy


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """What this rank holds of each of ``module``'s tensors: a DTensor's shard under FSDP2 and TP, else the tensor."""
    state_dict = get_model_state_dict(module)
    weights = {name: value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}
    if len(weights) != len(state_dict):
        others = sorted(set(state_dict) - set(weights))
        raise ValueError(f"A Hugging Face folder holds tensors only; {type(module).__name__} also has {others}.")
    return weights


def check_supported(strategy: Strategy, path: PathType, action: str) -> None:
    """Refuse, in one line, a strategy or a path that cannot hold a Hugging Face folder."""
    if strategy.huggingface_refusal is not None:
        raise ValueError(f"{action} a Hugging Face folder: {strategy.huggingface_refusal}")
    if is_remote(path):
        raise ValueError(
            f"{action} a Hugging Face folder at a URL ({os.fspath(path)!r}) is not provided yet: write it to a local "
            "or shared file system path."
        )


def save_huggingface(strategy: Strategy, path: PathType, module: nn.Module, max_file_bytes: int) -> None:
    """Write ``module``'s weights to the folder ``path`` in Hugging Face's layout (a collective; call
    :func:`check_supported` first)."""
    state_dict = _weights(module)
    target = Path(path)
    temporary: Path = strategy.broadcast(temporary_directory(target) if strategy.is_global_zero else None)
    with _removed_on_failure(temporary, strategy.is_global_zero):
        write_huggingface(state_dict, temporary, max_file_bytes)
        strategy.barrier("huggingface_written")
        if strategy.is_global_zero:
            remove_staging(temporary)
            write_config(module, temporary)
            publish(temporary, target)
    strategy.barrier("huggingface_published")


@contextlib.contextmanager
def _removed_on_failure(temporary: Path, is_global_zero: bool) -> Iterator[None]:
    try:
        yield
    except BaseException:
        if is_global_zero and temporary.exists():
            remove_temporary(temporary)
        raise


def load_huggingface(strategy: Strategy, path: PathType, module: nn.Module, strict: bool) -> None:
    """Fill ``module`` from the Hugging Face folder ``path``, each rank reading its shards (a collective)."""
    check_supported(strategy, path, "Loading")
    state_dict = _weights(module)
    names = names_to_read(Path(path), {name: tuple(value.shape) for name, value in state_dict.items()}, strict)
    wanted = {name: value for name, value in state_dict.items() if name in names}
    read_huggingface(wanted, Path(path))
    set_model_state_dict(module, dict(wanted), options=StateDictOptions(strict=False))
