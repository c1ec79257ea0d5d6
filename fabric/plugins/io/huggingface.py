"""Hugging Face's checkpoint layout, written and read sharded through DCP's ``HuggingFaceStorageWriter``/``Reader``.

The layout is what ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads: weight files
``model-0000i-of-0000N.safetensors`` and ```model.safetensors.index.json`` mapping each tensor to its file (a lone
``model.safetensors`` is the one-file form). Writing, every rank saves only its own shards (a DTensor's local piece,
or its share of replicated tensors) into a staging folder; the coordinating rank then merges them, one output file at
a time, into the standard files and the index, and the staging folder goes. Reading, every rank reads only the slices
its own shards cover. Nothing in these files executes on load (safetensors holds tensors and a JSON header only).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fabric.plugins.io.checkpoint_io import PathType
from fabric.plugins.io.distributed_checkpoint import _single_process_warning_silenced, _without_process_group
from fabric.utilities.exceptions import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: ``transformers``' default largest weight file (``max_shard_size="5GB"``).
DEFAULT_MAX_FILE_BYTES = 5 * 10**9
#: Where DCP's writer stages each rank's shards before merging them (removed after a save).
STAGING_FOLDER = "sharded"
CONFIG_FILE = "config.json"


def is_huggingface_directory(path: PathType) -> bool:
    """Whether ``path`` is a folder in Hugging Face's layout (an index, or the one-file form)."""
    folder = Path(path)
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()


def file_numbers(sizes: Mapping[str, int], max_file_bytes: int) -> dict[str, int]:
    """Each tensor's file (1 to N), in name order, starting a new file before one would pass ``max_file_bytes``
    (a tensor larger than that gets a file of its own), as ``save_pretrained`` splits them."""
    numbers: dict[str, int] = {}
    number, used = 1, 0
    for name in sorted(sizes):
        if used and used + sizes[name] > max_file_bytes:
            number, used = number + 1, 0
        numbers[name] = number
        used += sizes[name]
    return numbers


def tensor_bytes(value: torch.Tensor) -> int:
    """The full tensor's size in bytes (a DTensor's global size, not its local piece)."""
    return value.numel() * value.element_size()


def write_huggingface(state_dict: dict[str, torch.Tensor], folder: Path, max_file_bytes: int) -> None:
    """Every rank writes its shards of ``state_dict`` into ``folder`` (a collective); the coordinator merges them
    into the Hugging Face files. Call :func:`remove_staging` on rank 0 once every rank returned."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    sizes = {name: tensor_bytes(value) for name, value in state_dict.items()}
    writer = HuggingFaceStorageWriter(
        str(folder),
        fqn_to_index_mapping=file_numbers(sizes, max_file_bytes),
        save_distributed=True,
        enable_consolidation=True,
    )
    with _single_process_warning_silenced():
        save(state_dict, storage_writer=writer, no_dist=_without_process_group())


def remove_staging(folder: Path) -> None:
    shutil.rmtree(folder / STAGING_FOLDER, ignore_errors=True)


def saved_tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor of a Hugging Face folder: its shape and safetensors dtype, read from the files' headers alone.
    Raises :class:`CheckpointError` for an index naming a missing file or a tensor its file lacks."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = dict.fromkeys(_header(folder / SINGLE_FILE, folder), SINGLE_FILE)
    headers = {name: _header(folder / name, folder) for name in sorted(set(weight_map.values()))}
    tensors = {}
    for key, file in weight_map.items():
        entry = headers[file].get(key)
        if entry is None:
            raise CheckpointError(f"{folder}: {INDEX_FILE} puts {key!r} in {file}, which does not hold it.")
        tensors[key] = (tuple(entry["shape"]), entry["dtype"])
    return tensors


def _header(file: Path, folder: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{folder}: its index names {file.name}, which is not there.")
    with file.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header: dict[str, Any] = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    return header


def names_to_read(folder: Path, expected: Mapping[str, tuple[int, ...]], strict: bool) -> set[str]:
    """Compare the folder's tensors with the model's (name -> full shape) before anything is read and return the
    names both have. Raises one :class:`CheckpointError` naming the first problem: a shape that differs, and with
    ``strict`` a tensor the model has and the folder lacks, or the other way round."""
    saved = saved_tensors(folder)
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    retry = "nothing was loaded. Pass strict=False to load the tensors both have."
    if strict and missing:
        raise CheckpointError(
            f"{folder} has no {missing[0]!r} ({len(missing)} of the model's tensors are missing: {missing[:5]}); "
            f"{retry}"
        )
    if strict and unexpected:
        raise CheckpointError(
            f"{folder} holds {unexpected[0]!r}, which the model does not have ({len(unexpected)} such: "
            f"{unexpected[:5]}); {retry}"
        )
    common = set(expected) & set(saved)
    for name in sorted(common):
        if saved[name][0] != tuple(expected[name]):
            raise CheckpointError(
                f"{folder}: {name!r} has shape {list(saved[name][0])} there and {list(expected[name])} in the model; "
                "nothing was loaded."
            )
    return common


def read_huggingface(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill ``state_dict``'s tensors in place from the folder, each rank reading only its shards (a collective)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load

    with _single_process_warning_silenced():
        load(state_dict, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=_without_process_group())


def write_config(module: torch.nn.Module, folder: Path) -> None:
    """A ``transformers`` model's ``config.json`` beside its weights, so ``from_pretrained(folder)`` needs nothing
    else (other modules have no config to write)."""
    config = getattr(module, "config", None)
    if config is not None and callable(getattr(config, "to_json_file", None)):
        config.to_json_file(os.fspath(folder / CONFIG_FILE))
