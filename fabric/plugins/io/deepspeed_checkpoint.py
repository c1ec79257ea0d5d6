"""DeepSpeed checkpoint directories: atomic saves, checks before a load, and consolidation to one file.

A checkpoint is a directory in DeepSpeed's own layout (``engine.save_checkpoint``): one subdirectory
per save (a *tag*) with every rank's shard, and a ``latest`` file naming the complete one. Fabric writes
each save under a new tag and only then replaces ``latest`` (write to a temporary file, then rename),
so a save that fails or is killed midway leaves ``latest`` on the previous, complete checkpoint.
DeepSpeed's tools (``zero_to_fp32``, ``ds_to_universal``) read the same ``latest`` file.

At an fsspec URL (``s3://...``), which DeepSpeed cannot write to, every rank saves into its own local
staging directory and uploads its files under the tag; ``latest`` is written after all uploads finished.
A load downloads the complete tag into a temporary local directory first. Either way the committing rank
checks that every data-parallel rank's optimizer shard is there before ``latest`` moves.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.plugins.io.deepspeed_safe_load import safe_loading
from fabric.plugins.io.storage import filesystem, is_remote, require_bucket
from fabric.plugins.io.torch_io import TorchCheckpointIO, read_torch_file
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.lazy import install_hint

LATEST = "latest"
TAG_PREFIX = "fabric-"
#: Client-state entry naming the key under which the model was saved (so consolidation can put it back).
MODULE_KEY_ENTRY = "fabric_deepspeed_module_key"
_OPTIMIZER_SHARD = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def new_tag() -> str:
    return f"{TAG_PREFIX}{uuid.uuid4().hex}"


def prepare_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{os.fspath(directory)!r} is a file; DeepSpeed checkpoints are directories.")
    directory.mkdir(parents=True, exist_ok=True)


def commit(directory: Path, tag: str, world_size: int) -> None:
    """Point ``latest`` at the complete ``tag`` (atomically), then delete every other save by Fabric.

    Refuses (and deletes the save) when optimizer shards of some ranks are not in ``directory``: their
    nodes wrote them to a disk this one does not see.
    """
    _check_every_rank_saved(os.fspath(directory), saved_world_size(directory, tag), world_size)
    temporary = directory / f".{LATEST}.{uuid.uuid4().hex}"
    temporary.write_text(tag)
    os.replace(temporary, directory / LATEST)
    for entry in directory.iterdir():
        if entry.is_dir() and entry.name.startswith(TAG_PREFIX) and entry.name != tag:
            shutil.rmtree(entry, ignore_errors=True)


def _check_every_rank_saved(location: str, saved: int, world_size: int) -> None:
    if saved and saved != world_size:
        raise CheckpointError(
            f"The DeepSpeed checkpoint {location!r} holds optimizer shards of {saved} of {world_size} ranks: the "
            "others were written to a disk this node does not see. Save to storage every node shares (a shared "
            "file system, or an object store URL such as s3://bucket/folder); the checkpoint was not committed."
        )


@contextlib.contextmanager
def staging_directory() -> Iterator[Path]:
    """A private local directory for this rank's files of a save to a URL, deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="fabric-deepspeed-") as staging:
        yield Path(staging)


def upload(staging: Path, tag: str, url: str, storage_options: StorageOptions = None) -> None:
    """Copy the files this rank saved under ``staging/tag`` to ``url/tag`` (every rank, its own files)."""
    fs, root = filesystem(url, storage_options)
    require_bucket(fs, root, url)
    for file in sorted((staging / tag).iterdir()):
        fs.put_file(os.fspath(file), f"{root.rstrip('/')}/{tag}/{file.name}")


def commit_remote(url: str, tag: str, world_size: int, storage_options: StorageOptions = None) -> None:
    """:func:`commit` at a URL: ``latest`` is one object written in one request, so it moves atomically."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    shards = {
        m.group(1)
        for entry in fs.ls(f"{root}/{tag}", detail=False)
        if (m := _OPTIMIZER_SHARD.fullmatch(entry.rsplit("/", 1)[-1]))
    }
    try:
        _check_every_rank_saved(url, len(shards), world_size)
    except CheckpointError:
        fs.rm(f"{root}/{tag}", recursive=True)
        raise
    fs.pipe_file(f"{root}/{LATEST}", tag.encode())
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(TAG_PREFIX) and name != tag:
            fs.rm(entry, recursive=True)


@contextlib.contextmanager
def local_copy(path: PathType, storage_options: StorageOptions = None) -> Iterator[Path]:
    """The checkpoint directory ``path`` on the local disk: itself, or for a URL a download of its complete
    save (``latest`` and the tag it names) into a temporary directory, deleted afterwards."""
    if not is_remote(path):
        yield Path(os.fspath(path))
        return
    fs, root = filesystem(path, storage_options)
    root = root.rstrip("/")
    if not fs.isfile(f"{root}/{LATEST}"):
        raise CheckpointError(
            f"{os.fspath(path)!r} is not a DeepSpeed checkpoint directory (no {LATEST!r} file in it)."
        )
    with tempfile.TemporaryDirectory(prefix="fabric-deepspeed-") as local:
        directory = Path(local)
        tag = fs.cat_file(f"{root}/{LATEST}").decode().strip()
        (directory / LATEST).write_text(tag)
        if is_tag_name(tag) and fs.isdir(f"{root}/{tag}"):  # latest_tag refuses anything else, below
            (directory / tag).mkdir()
            for entry in fs.ls(f"{root}/{tag}", detail=False):
                fs.get_file(entry, os.fspath(directory / tag / entry.rstrip("/").rsplit("/", 1)[-1]))
        latest_tag(directory)
        yield directory


def latest_tag(directory: Path) -> str:
    """The tag of the complete checkpoint in ``directory``; a ``CheckpointError`` if there is none."""
    pointer = directory / LATEST
    if not directory.is_dir() or not pointer.is_file():
        hint = " For a consolidated single file, load it with a single-device Fabric." if directory.is_file() else ""
        raise CheckpointError(
            f"{os.fspath(directory)!r} is not a DeepSpeed checkpoint directory (no {LATEST!r} file in it).{hint}"
        )
    tag = pointer.read_text().strip()
    if not is_tag_name(tag):
        raise CheckpointError(
            f"{os.fspath(directory)!r}: {LATEST!r} holds {tag!r}, which is not a tag: a tag must be the name of a "
            "directory inside the checkpoint directory (one path component, not '.' or '..', no NUL byte)."
        )
    if not (directory / tag).is_dir():
        raise CheckpointError(f"{os.fspath(directory)!r}: {LATEST!r} names {tag!r}, which does not exist.")
    return tag


def is_tag_name(text: str) -> bool:
    """Whether ``text`` can name a save inside a checkpoint directory: one path component, not ``.``/``..``."""
    return text not in ("", ".", "..") and not any(separator in text for separator in ("/", "\\", "\0"))


def saved_world_size(directory: Path, tag: str) -> int:
    """How many data-parallel ranks wrote the optimizer shards of ``tag``."""
    ranks = {int(m.group(1)) for f in (directory / tag).iterdir() if (m := _OPTIMIZER_SHARD.fullmatch(f.name))}
    return len(ranks)


def read_client_state(directory: Path, tag: str, weights_only: bool = True) -> dict[str, Any]:
    """The user's own entries (``"step": 5``, ...) saved next to the model, without loading any shard.

    Call it inside :func:`~fabric.plugins.io.deepspeed_safe_load.safe_loading`, which allows DeepSpeed's
    own records under ``weights_only``.
    """
    files = sorted((directory / tag).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{os.fspath(directory / tag)!r} holds no DeepSpeed model state file.")
    saved = read_torch_file(files[0], os.fspath(files[0]), weights_only, mmap=True)
    client_state = saved.get("fabric_client_state")
    if not isinstance(client_state, dict):
        raise CheckpointError(f"{os.fspath(files[0])!r} was not written by Fabric's DeepSpeedStrategy.")
    return client_state


def check_world_size(directory: Path, tag: str, world_size: int) -> None:
    saved = saved_world_size(directory, tag)
    if saved and saved != world_size:
        raise CheckpointError(
            f"{os.fspath(directory)!r} was saved by {saved} ranks and this job has {world_size}; DeepSpeed cannot "
            "re-shard it directly. Consolidate it with fabric.strategies.deepspeed.convert_zero_checkpoint_to_fp32"
            "(directory, file) and load the file with a single-device Fabric, or convert it with DeepSpeed's "
            "ds_to_universal and set 'load_universal_checkpoint': true in the config."
        )


def read_whole(path: PathType, weights_only: bool = True, storage_options: StorageOptions = None) -> dict[str, Any]:
    """The full float32 weights (under the key the model was saved with) and the client entries, gathered
    from the ZeRO shards in this process; optimizer states cannot be rebuilt and are left out.

    With ``weights_only`` (the default) nothing in the checkpoint can run code while it is read.
    """
    with local_copy(path, storage_options) as directory:
        tag = latest_tag(directory)
        with safe_loading(directory / tag, weights_only):
            client_state = read_client_state(directory, tag, weights_only)
            state_dict = _gather_fp32(directory, tag)
    module_key = client_state.pop(MODULE_KEY_ENTRY, "model")
    return {**client_state, module_key: state_dict}


def consolidate(directory: PathType, output_file: Path, weights_only: bool = True) -> None:
    """Write :func:`read_whole` into one ``fabric.load``-able file."""
    TorchCheckpointIO().save_checkpoint(read_whole(directory, weights_only), output_file)


def _gather_fp32(directory: Path, tag: str) -> dict[str, torch.Tensor]:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as error:
        raise ImportError(
            f"{os.fspath(directory)!r} is a DeepSpeed checkpoint; reading it needs DeepSpeed: "
            f"{install_hint('deepspeed', 'deepspeed')}."
        ) from error
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        state_dict: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(os.fspath(directory), tag=tag)
    return state_dict
