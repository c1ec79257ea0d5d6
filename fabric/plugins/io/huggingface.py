"""Hugging Face's checkpoint layout, written and read sharded through DCP's ``HuggingFaceStorageWriter``/``Reader``.

The layout is what ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads: weight files
``model-0000i-of-0000N.safetensors`` and ```model.safetensors.index.json`` mapping each tensor to its file (a lone
``model.safetensors`` is the one-file form). Writing, every rank saves only its own shards (a DTensor's local piece,
or its share of replicated tensors) into a staging folder; the coordinating rank then merges them, one output file at
a time, into the standard files and the index, and the staging folder goes. Reading, every rank reads only the slices
its own shards cover; a folder at a URL (``s3://...``) is first copied, its index and weight files only, to a local
temporary folder, once per node (:func:`download_weights`). A folder for a URL is uploaded one weight file at a time,
each by a process holding it, and published by its index (:class:`FolderUpload`). Nothing in these files executes
on load (safetensors holds tensors and a JSON header only).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.distributed_checkpoint import (
    _single_process_warning_silenced,
    _without_process_group,
    new_generation,
    publish,
    temporary_directory,
    written_or_checkpoint_error,
)
from fabric.plugins.io.storage import OBJECT_STORE_PROTOCOLS, filesystem
from fabric.plugins.io.temporaries import ABANDONED_AFTER, last_written, remove_temporary
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


def download_weights(url: PathType, local: Path, storage_options: StorageOptions = None) -> None:
    """Copy the Hugging Face folder at ``url`` into the empty local folder ``local``: its index and the weight files
    it lists (or the one-file form), nothing else. Raises :class:`CheckpointError` naming a listed file that is not
    there."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    if fs.isfile(f"{root}/{INDEX_FILE}"):
        (local / INDEX_FILE).write_bytes(fs.cat_file(f"{root}/{INDEX_FILE}"))
        names = sorted(set(json.loads((local / INDEX_FILE).read_text())["weight_map"].values()))
    else:
        names = [SINGLE_FILE]
    for name in names:
        try:
            fs.get_file(f"{root}/{name}", str(local / name))
        except FileNotFoundError:
            raise CheckpointError(f"{url}: its index names {name}, which is not there.") from None


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


def tied_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The names of tied tensors (one tensor under two names, as a language model's head and input embedding):
    each later name -> the first name of its tensor in ``state_dict``'s order (the module's order, which puts the
    embedding before the head). Hugging Face folders hold a tied tensor once, under the name
    ``save_pretrained`` keeps; ``from_pretrained`` ties the others again."""
    first: dict[object, str] = {}
    tied: dict[str, str] = {}
    for name, value in state_dict.items():
        identity = _tensor_identity(value)
        if identity in first:
            tied[name] = first[identity]
        else:
            first[identity] = name
    return tied


def _tensor_identity(value: torch.Tensor) -> object:
    """What two names of one tensor share: its memory and view (a DTensor's local piece's), or the object on meta."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    if local.device.type == "meta" or local.numel() == 0:  # no memory to compare
        return id(value)
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(), local.dtype)


def write_huggingface(
    state_dict: dict[str, torch.Tensor],
    folder: Path,
    max_file_bytes: int,
    dtype: torch.dtype | None = None,
    alone: bool = False,
    process_group: Any = None,
    target: PathType | None = None,
) -> None:
    """Every rank writes its shards of ``state_dict`` into ``folder`` (a collective, on ``process_group`` or the
    default group, unless ``alone``: this process holds every tensor whole; a tied tensor once, under its first name;
    floating-point tensors in ``dtype`` when given); the coordinator merges them into the Hugging Face files. Call
    :func:`finish_folder` on rank 0 once every rank returned. A failure on any rank is a :class:`CheckpointError` on
    every rank, naming ``target`` (the folder this one becomes)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    tied = tied_names(state_dict)
    state_dict = {
        name: value.to(dtype) if dtype is not None and value.is_floating_point() else value
        for name, value in state_dict.items()
        if name not in tied
    }
    sizes = {name: tensor_bytes(value) for name, value in state_dict.items()}
    writer = HuggingFaceStorageWriter(
        str(folder),
        fqn_to_index_mapping=file_numbers(sizes, max_file_bytes),
        save_distributed=True,
        enable_consolidation=True,
    )
    with written_or_checkpoint_error(folder if target is None else target), _single_process_warning_silenced():
        save(state_dict, storage_writer=writer, process_group=process_group, no_dist=alone or _without_process_group())


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


def compile_key_mapping(key_mapping: Mapping[str, str] | None) -> list[tuple[re.Pattern[str], str]]:
    """``key_mapping``'s patterns compiled, in order, or a ``ValueError`` naming the one that is not a regex."""
    compiled = []
    for pattern, replacement in (key_mapping or {}).items():
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise ValueError(
                f"key_mapping maps regex strings to replacement strings; got {pattern!r}: {replacement!r}."
            )
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as error:
            raise ValueError(f"key_mapping: {pattern!r} is not a regular expression ({error}).") from None
    return compiled


def model_names(saved: Mapping[str, Any], key_mapping: list[tuple[re.Pattern[str], str]]) -> dict[str, str]:
    """Each saved tensor's name in the model (model name -> saved name), renamed as ``transformers``'
    ``from_pretrained(key_mapping=)`` renames: the first pattern that matches is substituted, the rest are not
    tried. Two saved tensors given one model name raise :class:`CheckpointError` naming both."""
    names: dict[str, str] = {}
    for saved_name in sorted(saved):
        model_name = saved_name
        for pattern, replacement in key_mapping:
            model_name, replaced = pattern.subn(replacement, saved_name)
            if replaced:
                break
        if model_name in names:
            raise CheckpointError(
                f"key_mapping renames both {names[model_name]!r} and {saved_name!r} to {model_name!r}; nothing was "
                "loaded."
            )
        names[model_name] = saved_name
    return names


def names_to_read(
    folder: Path,
    expected: Mapping[str, tuple[int, ...]],
    strict: bool,
    key_mapping: list[tuple[re.Pattern[str], str]] | None = None,
    tied: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Compare the folder's tensors (renamed by ``key_mapping``) with the model's (name -> full shape) before
    anything is read, and return the ones both have (model name -> name in the folder). The model's ``tied`` names
    (see :func:`tied_names`) are filled through the first name of their tensor: neither read nor missing. Raises one
    :class:`CheckpointError` naming the first problem: a shape that differs, and with ``strict`` a tensor the model
    has and the folder lacks, or the other way round."""
    stored = saved_tensors(folder)
    renamed = model_names(stored, key_mapping or [])
    tied = tied or {}
    saved = {model_name: stored[saved_name] for model_name, saved_name in renamed.items() if model_name not in tied}
    expected = {name: shape for name, shape in expected.items() if name not in tied}
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    retry = "nothing was loaded. Pass strict=False to load the tensors both have"
    retry += "." if key_mapping else ", or key_mapping= to rename the folder's."
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
    return {name: renamed[name] for name in common}


def read_huggingface(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill ``state_dict``'s tensors in place from the folder, each rank reading only its shards (a collective)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load

    with _single_process_warning_silenced():
        load(state_dict, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=_without_process_group())


def config_files(module: torch.nn.Module) -> dict[str, bytes]:
    """A ``transformers`` model's ``config.json``, to write beside its weights so ``from_pretrained(folder)`` needs
    nothing else (other modules have no config: no file)."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    return config_file(config.to_json_string(), type(module).__name__)


def config_file(config_json: str, model_class: str) -> dict[str, bytes]:
    """``config.json`` from a config's JSON and its model's class name (the ``architectures`` entry
    ``save_pretrained`` writes, which the ``Auto`` classes read)."""
    config = json.loads(config_json)
    config["architectures"] = [model_class]
    return {CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True).encode()}


def finish_folder(temporary: Path, target: Path, files: Mapping[str, bytes]) -> None:
    """Complete a written folder (its staging removed, ``files`` added beside the weights) and rename it to
    ``target``, replacing a previous folder only now (the coordinating rank, after every rank wrote)."""
    remove_staging(temporary)
    for name, content in files.items():
        with (temporary / name).open("xb") as file:  # never over a weight file
            file.write(content)
    publish(temporary, target)


def write_huggingface_folder(
    weights: dict[str, torch.Tensor],
    target: Path,
    max_file_bytes: int,
    files: Mapping[str, bytes],
    dtype: torch.dtype | None = None,
) -> None:
    """Write whole tensors held by this one process as the Hugging Face folder ``target``, atomically (the other
    ranks of a job, if any, take no part)."""
    temporary = temporary_directory(target)
    with removed_on_failure(temporary):
        write_huggingface(weights, temporary, max_file_bytes, dtype, alone=True, target=target)
        finish_folder(temporary, target, files)


def write_huggingface_to_url(
    weights: dict[str, torch.Tensor],
    url: PathType,
    max_file_bytes: int,
    files: Mapping[str, bytes],
    dtype: torch.dtype | None = None,
    storage_options: StorageOptions = None,
) -> None:
    """Write whole tensors held by this one process as the Hugging Face folder at ``url`` (a :class:`FolderUpload`:
    call :func:`check_upload_target` before gathering them); a failure leaves a folder there as it was."""
    tied = tied_names(weights)
    upload = FolderUpload(url, new_generation(), storage_options)
    weight_map, total_size, failure = upload_weight_files(
        upload, {name: value for name, value in weights.items() if name not in tied}, max_file_bytes, dtype
    )
    try:
        if failure is not None:
            raise failure
        upload.publish(weight_map, total_size, files)
    except BaseException:
        upload.abandon(weight_map)
        raise


def check_upload_target(url: PathType) -> None:
    """A ``ValueError`` unless ``url`` is on an object store, where one request replaces the index whole (the switch
    of :func:`upload_folder`); read from the URL alone, before any connection."""
    protocol = os.fspath(url).split("://", 1)[0]
    if protocol not in OBJECT_STORE_PROTOCOLS:
        raise ValueError(
            f"A Hugging Face folder at a URL is written to an object store ({', '.join(sorted(OBJECT_STORE_PROTOCOLS))}"
            f"), where one request replaces its index whole; {os.fspath(url)!r} is not one."
        )


class FolderUpload:
    """One save of a Hugging Face folder to an object store, replacing a folder there only at its end.

    Its weight files go up under names of this save's own (``model-<generation>-0000i-of-0000N.safetensors``), from
    whichever processes hold them (:func:`upload_weight_files`); then, from one process, :meth:`publish` writes the
    other files (config, tokenizer) and the index, which lists the new files: one request, the switch. Only then are
    the files of the folder it replaced deleted (a lone ``model.safetensors`` among them, which ``from_pretrained``
    would read before an index), and those of uploads killed before their index, once an hour old. A failure before
    the switch calls :meth:`abandon`: this save's weight files go, and the previous folder stays as it was.
    """

    def __init__(self, url: PathType, generation: str, storage_options: StorageOptions = None) -> None:
        check_upload_target(url)
        self._fs, root = filesystem(url, storage_options)
        self._root = root.rstrip("/")
        self._generation = generation

    def weight_file(self, number: int, count: int) -> str:
        """The name of weight file ``number`` of ``count`` in this save."""
        return f"model-{self._generation}-{number:05d}-of-{count:05d}.safetensors"

    def put_weights(self, tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None) -> None:
        """Upload ``tensors`` (whole, on the CPU; floating-point ones in ``dtype`` when given) as the weight file
        ``name``, written in this machine's temporary directory first (room for one file)."""
        with tempfile.TemporaryDirectory(prefix="fabric-huggingface-") as scratch:
            folder = Path(scratch) / "file"
            write_huggingface(tensors, folder, max_file_bytes=sys.maxsize, dtype=dtype, alone=True)
            (written,) = folder.glob("*.safetensors")
            self._fs.put_file(str(written), f"{self._root}/{name}")

    def publish(self, weight_map: Mapping[str, str], total_size: int, files: Mapping[str, bytes]) -> None:
        """Once every weight file is up: ``files``, then the index (the switch), then the replaced folder's weight
        files go. What fails before the switch is raised (call :meth:`abandon`); a failed deletion after it only
        warns, naming the files left: the new folder is complete."""
        previous = _listed_weight_files(self._fs, self._root)
        for name, content in sorted(files.items()):
            self._fs.pipe_file(f"{self._root}/{name}", content)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        self._fs.pipe_file(f"{self._root}/{INDEX_FILE}", json.dumps(index, indent=2, sort_keys=True).encode())
        current = set(weight_map.values())
        replaced = sorted(previous - current)
        try:
            for name in replaced:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm(f"{self._root}/{name}")
            _remove_abandoned_uploads(self._fs, self._root, current)
        except Exception as error:
            warnings.warn(
                f"The Hugging Face folder at {self._root!r} is saved, but deleting what it replaced failed "
                f"({type(error).__name__}: {error}); unused files may remain beside it (of {replaced}).",
                stacklevel=2,
            )

    def abandon(self, weight_map: Mapping[str, str]) -> None:
        """Delete this save's weight files (those some process put up); the save's own error is the one to raise."""
        for name in sorted(set(weight_map.values())):
            with contextlib.suppress(Exception):
                self._fs.rm(f"{self._root}/{name}")


def upload_weight_files(
    upload: FolderUpload,
    weights: Mapping[str, torch.Tensor],
    max_file_bytes: int,
    dtype: torch.dtype | None,
    *,
    owns: Callable[[int], bool] = lambda number: True,
    whole: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
) -> tuple[dict[str, str], int, Exception | None]:
    """Put ``weights`` up as the weight files of ``upload``, split as ``save_pretrained`` splits them, each file by
    the process that ``owns`` its number, which holds one file's tensors at a time (on the CPU).

    ``weights`` are this process's: whole tensors, or shards that ``whole`` makes whole (a collective: every process
    calls this with the same names, and ``whole`` for each in the same order). Returns the weight map and total size
    (the same in every process) and this process's failure, if any: after one it puts nothing up, but still takes
    part in every ``whole``, so that the others are not left waiting.
    """
    sizes = {name: _saved_bytes(value, dtype) for name, value in weights.items()}
    numbers = file_numbers(sizes, max_file_bytes)
    count = max(numbers.values(), default=1)
    weight_map = {name: upload.weight_file(number, count) for name, number in numbers.items()}
    failure: Exception | None = None
    for number in range(1, count + 1):
        mine = owns(number) and failure is None
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(name for name, its in numbers.items() if its == number):
            tensor = whole(weights[name])
            if mine:
                tensors[name] = tensor.cpu()
        if mine:
            try:
                upload.put_weights(tensors, upload.weight_file(number, count), dtype)
            except Exception as error:
                failure = error
    return weight_map, sum(sizes.values()), failure


def _saved_bytes(value: torch.Tensor, dtype: torch.dtype | None) -> int:
    """The bytes of ``value`` whole, as saved (floating-point tensors in ``dtype`` when given)."""
    if dtype is not None and value.is_floating_point():
        return value.numel() * dtype.itemsize
    return tensor_bytes(value)


#: The weight files a :class:`FolderUpload` names: ``model-<generation>[-0000i-of-0000N].safetensors`` (the
#: one-file form from earlier versions).
_UPLOADED_WEIGHTS = re.compile(r"model-[0-9a-f]{16}(-\d+-of-\d+)?\.safetensors")


def _remove_abandoned_uploads(fs: Any, root: str, current: set[str]) -> None:
    """Delete the weight files that uploads killed before their index left at ``root``, once an hour old (a younger
    one may belong to an upload still running); the index's own are kept."""
    now = time.time()
    for entry in fs.ls(root, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if name in current or not _UPLOADED_WEIGHTS.fullmatch(name):
            continue
        modified = last_written(fs, entry)
        if modified is not None and now - modified > ABANDONED_AFTER:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(entry["name"])


def _listed_weight_files(fs: Any, root: str) -> set[str]:
    """The weight files of the folder at ``root`` (its index's, and a lone ``model.safetensors``); none if empty."""
    names = {SINGLE_FILE} if fs.isfile(f"{root}/{SINGLE_FILE}") else set()
    with contextlib.suppress(FileNotFoundError):
        names |= set(json.loads(fs.cat_file(f"{root}/{INDEX_FILE}"))["weight_map"].values())
    return names


@contextlib.contextmanager
def removed_on_failure(temporary: Path, owner: bool = True) -> Iterator[None]:
    """Delete the half-written ``temporary`` folder if the block fails (on the ``owner`` rank, which created it)."""
    try:
        yield
    except BaseException:
        if owner and temporary.exists():
            remove_temporary(temporary)
        raise
