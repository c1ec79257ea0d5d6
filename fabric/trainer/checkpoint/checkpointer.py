"""Saving and loading a whole Trainer through Fabric, and finding the checkpoint to resume from.

A full checkpoint holds ``model``, ``optimizer_0``, ``optimizer_1``, ... (Fabric saves the precision
plugin's scaler with them), ``trainer`` (:class:`TrainerCheckpointState`), ``rng`` (every rank's
generator states, stacked by rank) and ``meta``. A weights-only checkpoint (the deployable model) holds
``model`` and ``meta``, with the weights the algorithms export (:meth:`Algorithm.exported_weights`: EMA's
average); a full checkpoint keeps the training weights, so a resume is exact. Loading goes through
``fabric.load``, which validates every entry before changing anything.
"""

from __future__ import annotations

import io
import os
from collections.abc import Collection
from contextlib import ExitStack
from typing import Any

import fsspec
import torch

from fabric.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fabric.trainer.checkpoint.storage import Folder, checkpoints_in, format_name
from fabric.trainer.checkpoint.trainer_state import SECTIONS, TrainerCheckpointState
from fabric.trainer.state import State
from fabric.trainer.surgery import surgery_records
from fabric.utilities.rank_zero import rank_zero_warn

CHECKPOINT_FORMAT = "fabric.trainer/1"
#: Names ``load_ignore_keys`` accepts: the trainer's sections plus the separate entries.
IGNORABLE = (*SECTIONS, "optimizers", "rng")


class TrainerCheckpointer:
    def __init__(self, state: State, trainer_state: TrainerCheckpointState, run_name: str) -> None:
        self.state = state
        self.trainer_state = trainer_state
        self.run_name = run_name

    def save(self, path: str, weights_only: bool = False) -> None:
        """Write a checkpoint of the Trainer to ``path`` (every rank must call this)."""
        fabric = self.state.fabric
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
                fabric.save(path, {"model": self.state.model, "meta": meta})
            return
        entries: dict[str, Any] = {"model": self.state.model, **self._optimizers()}
        entries.update(trainer=self.trainer_state, rng=RngStates(fabric), meta=meta)
        fabric.save(path, entries)

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
                entries["rng"] = RngStates(self.state.fabric)
        self.state.fabric.load(path, entries, strict=strict)
        rng = entries.get("rng")
        if isinstance(rng, RngStates) and rng.loaded is not None:
            self._restore_rng(rng.loaded)

    def _optimizers(self) -> dict[str, Any]:
        return {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.state.optimizers)}

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        fabric = self.state.fabric
        saved_world_size = len(rng["torch"])
        if saved_world_size != fabric.world_size:
            rank_zero_warn(
                f"The checkpoint was saved by {saved_world_size} rank(s) and this run has {fabric.world_size}: random "
                "number generators are not restored, so random draws (dropout, augmentation) differ from the first run."
            )
            return
        # clone: a row of the stacked tensor is a view at an offset, which torch.set_rng_state cannot take
        restore_rng_state({kind: states[fabric.global_rank].clone() for kind, states in rng.items()})


class RngStates:
    """Every rank's generator states, stacked by rank: gathered when saved, held back when loaded.

    Stored as one serialized blob (bytes), not as tensors: sharded strategies (DCP) then load it whole
    with any number of ranks, instead of resharding a tensor whose first dimension is the old world size.
    The blob is a ``torch.save`` of plain tensors and is read back with ``weights_only=True``.
    ``load_state_dict`` only keeps the states; the checkpointer applies this rank's row once the whole
    load succeeded. Saving and loading it are collectives, as are ``fabric.save`` and ``fabric.load``.
    """

    def __init__(self, fabric: Any) -> None:
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
    folder_template: str, filename: str, latest_filename: str | None, run_name: str
) -> str | None:
    """The newest complete checkpoint of ``run_name``: by the counters in its name, else the ``latest`` pointer.

    Files of interrupted saves (``.name.tmp-*``) never count.
    """
    folder = Folder(format_name(folder_template, {"run_name": run_name}))
    found = checkpoints_in(folder, filename, run_name)
    if found and any(field in filename for field in ("{batch}", "{epoch}", "{sample}", "{token}")):
        return folder.join(found[-1][1])
    if latest_filename is not None:
        return folder.resolve_latest(format_name(latest_filename, {"run_name": run_name, "rank": 0}))
    return folder.join(found[-1][1]) if found else None


def read_surgery_records(path: str) -> list[dict[str, Any]]:
    """The model surgery a checkpoint file was saved with (``meta["surgery"]``), read without loading its tensors.

    Only single-file checkpoints are read (memory-mapped when local); anything unreadable gives ``[]``,
    and the real load reports the problem.
    """
    try:
        if os.path.isfile(path):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            with fsspec.open(path, "rb") as file:
                checkpoint = torch.load(file, map_location="cpu", weights_only=True)
        return list(checkpoint.get("meta", {}).get("surgery", []))
    except Exception:  # the real load, later, reports what is wrong with the file
        return []
