"""Saving and loading a whole Trainer through Fabric, and finding the checkpoint to resume from.

A full checkpoint holds ``model``, ``optimizer_0``, ``optimizer_1``, ... (Fabric saves the precision
plugin's scaler with them), ``trainer`` (:class:`TrainerCheckpointState`), ``rng`` (every rank's
generator states, stacked by rank) and ``meta``. A weights-only checkpoint (the deployable model) holds
``model`` and ``meta``, with the weights the algorithms export (:meth:`Algorithm.exported_weights`: EMA's
average); a full checkpoint keeps the training weights, so a resume is exact. A load first reads ``meta``
(cheaply, without the tensors) and refuses a checkpoint without our format marker or of a newer format;
then it goes through ``fabric.load``, which validates every entry before changing anything.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Collection
from concurrent.futures import Future
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from fabric.plugins.io.checkpoint_io import CheckpointIO, StorageOptions
from fabric.plugins.io.formats import CheckpointFormat, incomplete_error, recognise
from fabric.plugins.io.torch_io import TorchCheckpointIO
from fabric.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fabric.trainer.checkpoint.storage import Folder, checkpoints_in, folder_name, format_name
from fabric.trainer.checkpoint.trainer_state import SECTIONS, TrainerCheckpointState
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.surgery import surgery_records
from fabric.utilities.exceptions import CheckpointError
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.fabric import Fabric

#: The version of the checkpoint format this code writes, and the newest it reads.
_FORMAT_VERSION = 1
CHECKPOINT_FORMAT = f"fabric.trainer/{_FORMAT_VERSION}"
_FORMAT_PATTERN = re.compile(r"fabric\.trainer/([1-9][0-9]*)")
#: Names ``load_ignore_keys`` accepts: the trainer's sections plus the separate entries.
IGNORABLE = (*SECTIONS, "optimizers", "rng")


class TrainerCheckpointer:
    """Saves and loads the Trainer; ``storage_options`` go to fsspec for URLs unless a call gives its own."""

    def __init__(
        self,
        state: State,
        trainer_state: TrainerCheckpointState,
        run_name: str,
        storage_options: StorageOptions = None,
    ) -> None:
        self.state = state
        self.trainer_state = trainer_state
        self.run_name = run_name
        self.storage_options = storage_options

    def save(
        self,
        path: str,
        weights_only: bool = False,
        storage_options: StorageOptions = None,
        async_save: bool = False,
    ) -> Future[None]:
        """Write a checkpoint of the Trainer to ``path`` (every rank must call this); the future completes when
        it is complete at ``path`` (at once, unless ``async_save`` writes it in the background)."""
        fabric = require_fabric(self.state)
        options: dict[str, Any] = {
            "storage_options": storage_options if storage_options is not None else self.storage_options,
            "async_save": async_save,
        }
        meta = {
            "format": CHECKPOINT_FORMAT,
            "world_size": fabric.world_size,
            "run_name": self.run_name,
            "surgery": surgery_records(self.state.algorithms),
        }
        if weights_only:
            with ExitStack() as exports:
                for algorithm in self.state.algorithms:
                    exports.enter_context(algorithm.exported_weights(self.state))
                written: Future[None] = fabric.save(path, {"model": self.state.model, "meta": meta}, **options)
            return written
        entries: dict[str, Any] = {"model": self.state.model, **self._optimizers()}
        entries.update(trainer=self.trainer_state, rng=RngStates(fabric), meta=meta)
        written = fabric.save(path, entries, **options)
        return written

    def load(
        self, path: str, *, weights_only: bool = False, strict: bool = True, ignore_keys: Collection[str] = ()
    ) -> None:
        """Restore the Trainer from ``path``; on any error nothing changed. ``ignore_keys`` skips parts."""
        unknown = sorted(set(ignore_keys) - set(IGNORABLE))
        if unknown:
            raise ValueError(f"load_ignore_keys has {unknown}; the parts a checkpoint has are {list(IGNORABLE)}.")
        entries: dict[str, Any] = {"model": self.state.model}
        if not weights_only:
            if "optimizers" not in ignore_keys:
                entries.update(self._optimizers())
            self.trainer_state.ignore = frozenset(key for key in ignore_keys if key in SECTIONS)
            entries["trainer"] = self.trainer_state
            if "rng" not in ignore_keys:
                entries["rng"] = RngStates(require_fabric(self.state))
        fabric = require_fabric(self.state)
        check_format(read_meta(path, fabric.strategy.checkpoint_io, self.storage_options), path)
        fabric.load(path, entries, strict=strict, storage_options=self.storage_options)
        rng = entries.get("rng")
        if isinstance(rng, RngStates) and rng.loaded is not None:
            self._restore_rng(rng.loaded)

    def _optimizers(self) -> dict[str, Any]:
        return {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.state.optimizers)}

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        fabric = require_fabric(self.state)
        saved_world_size = len(rng["torch"])
        if saved_world_size != fabric.world_size:
            rank_zero_warn(
                f"The checkpoint was saved by {saved_world_size} rank(s) and this run has {fabric.world_size}: random "
                "number generators are not restored, so random draws (dropout, augmentation) differ from the first run."
            )
            return
        # torch-workaround(rng-state-from-a-view): torch.set_rng_state crashes on a view at an offset, such as a row
        # of the stacked tensor: clone
        restore_rng_state({kind: states[fabric.global_rank].clone() for kind, states in rng.items()})


class RngStates:
    """Every rank's generator states, stacked by rank: gathered when saved, held back when loaded.

    Stored as one serialized blob (bytes), not as tensors: sharded strategies (DCP) then load it whole
    with any number of ranks, instead of resharding a tensor whose first dimension is the old world size.
    The blob is a ``torch.save`` of plain tensors and is read back with ``weights_only=True``.
    ``load_state_dict`` only keeps the states; the checkpointer applies this rank's row once the whole
    load succeeded. Saving and loading it are collectives, as are ``fabric.save`` and ``fabric.load``.
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        stacked = {kind: self.fabric.all_gather(value).cpu() for kind, value in capture_rng_state().items()}
        buffer = io.BytesIO()
        torch.save(stacked, buffer)
        return {"per_rank": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict["per_rank"]
        if not isinstance(blob, bytes):
            raise ValueError(f"the rng entry holds a {type(blob).__name__}, not the serialized states of every rank")
        self.loaded = torch.load(io.BytesIO(blob), weights_only=True)


def find_resume_checkpoint(
    folder_template: str,
    filename: str,
    latest_filename: str | None,
    run_name: str,
    storage_options: StorageOptions = None,
    replica_group: int | None = None,
) -> str | None:
    """The newest complete checkpoint of ``run_name`` (and ``replica_group``, for a folder that names it): by the
    counters in its name, else the ``latest`` pointer.

    Files of interrupted saves (``.name.tmp-*``) and directories of unfinished sharded saves never count.
    """
    folder = Folder(folder_name(folder_template, run_name, replica_group), storage_options)
    found = checkpoints_in(folder, filename, run_name)
    if found and any(field in filename for field in ("{batch}", "{epoch}", "{sample}", "{token}")):
        return folder.join(found[-1][1])
    if latest_filename is not None:
        return folder.resolve_latest(format_name(latest_filename, {"run_name": run_name, "rank": 0}))
    return folder.join(found[-1][1]) if found else None


def check_format(meta: object, path: str) -> None:
    """Refuse what this version cannot load as a Trainer checkpoint: one without our format marker in its
    ``meta`` (not written by the Trainer), of a foreign format, or of a newer version of ours."""
    not_ours = (
        f"{path!r} is not a Trainer checkpoint (Trainer.save_checkpoint writes 'meta' with a 'format' marker, "
        "also with weights_only=True). To start from the weights of another checkpoint, load them into the "
        "model before building the Trainer: Fabric().load(path, {'model': model}), or Fabric().load_raw(path, "
        "model) for a bare state_dict."
    )
    if not isinstance(meta, dict):
        raise CheckpointError(f"{not_ours} It has no 'meta' entry.")
    found = meta.get("format")
    if found is None:
        raise CheckpointError(f"{not_ours} Its 'meta' entry has no 'format' marker.")
    match = _FORMAT_PATTERN.fullmatch(found) if isinstance(found, str) else None
    if match is None:
        raise CheckpointError(f"{not_ours} Its format is {found!r}; this version reads {CHECKPOINT_FORMAT}.")
    if int(match.group(1)) > _FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} was written by a newer version: format {found}, this version reads up to "
            f"{CHECKPOINT_FORMAT}; upgrade fabric to load it."
        )


def read_meta(path: str, checkpoint_io: CheckpointIO, storage_options: StorageOptions = None) -> Any:
    """The ``meta`` entry of the checkpoint at ``path`` (``None`` if it has none), read without the tensors
    where the format allows: a local file memory-mapped, only that entry of a sharded (DCP) directory, the
    client state of a DeepSpeed one (a DeepSpeed checkpoint at a URL is downloaded)."""
    form = recognise(path, storage_options)
    if form is CheckpointFormat.DCP:
        from fabric.plugins.io import distributed_checkpoint

        if "meta" not in distributed_checkpoint.read_metadata_keys(path, storage_options=storage_options):
            return None
        return distributed_checkpoint.read_whole(path, keys={"meta"}, storage_options=storage_options)["meta"]
    if form is CheckpointFormat.DEEPSPEED:
        from fabric.plugins.io import deepspeed_checkpoint
        from fabric.plugins.io.deepspeed_safe_load import safe_loading

        with deepspeed_checkpoint.local_copy(path, storage_options) as directory:
            tag = deepspeed_checkpoint.latest_tag(directory)
            with safe_loading(directory / tag, weights_only=True):
                return deepspeed_checkpoint.read_client_state(directory, tag).get("meta")
    if form is CheckpointFormat.INCOMPLETE:
        raise incomplete_error(path)
    checkpoint = _read_file(path, checkpoint_io, storage_options)
    return checkpoint.get("meta") if isinstance(checkpoint, dict) else None


def _read_file(path: str, checkpoint_io: CheckpointIO, storage_options: StorageOptions = None) -> Any:
    """A checkpoint file, memory-mapped when torch can map it (a local file in torch's zip format), else read
    by ``checkpoint_io`` (which also says why a file cannot be read)."""
    if os.path.isfile(path):
        with contextlib.suppress(Exception):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return checkpoint_io.load_checkpoint(path, weights_only=True, storage_options=storage_options)


def read_surgery_records(path: str, storage_options: StorageOptions = None) -> list[dict[str, Any]]:
    """The model surgery a checkpoint was saved with (``meta["surgery"]``), read without its tensors where the format
    allows (:func:`read_meta`), in every format the Trainer saves.

    A checkpoint that cannot be read raises here, as its load would: without its records, surgery that leaves the
    state dict's keys and shapes as they were (a LayerNorm swapped for a low-precision one) would silently not be
    reapplied, and the checkpoint would load into the unchanged model.
    """
    meta = read_meta(path, TorchCheckpointIO(), storage_options)
    return list(meta.get("surgery", [])) if isinstance(meta, dict) else []
