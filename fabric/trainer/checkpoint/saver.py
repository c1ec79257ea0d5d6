"""``CheckpointSaver``: saves the Trainer at an interval, keeps ``latest`` current and old checkpoints pruned.

It runs at BATCH_CHECKPOINT and EPOCH_CHECKPOINT (after evaluation, so saved metrics and stopper
states are current). Local folders are written in place (atomically, by Fabric). Remote folders are
written to a local staging file first, then uploaded on a background thread; ``latest`` moves and old
checkpoints are pruned only after the upload completed. ``fit()`` waits for pending uploads at FIT_END.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from fabric.trainer.callback import Callback
from fabric.trainer.checkpoint.storage import (
    PROGRESS_FIELDS,
    Folder,
    Uploader,
    check_prunable,
    check_template,
    checkpoints_in,
    format_name,
    names_differ_between_saves,
)
from fabric.trainer.events import Event
from fabric.trainer.intervals import IntervalInput, create_interval, fires_once
from fabric.trainer.state import State

SaveFunction = Callable[[str, bool], None]


class CheckpointSaver(Callback):
    """Save every ``save_interval`` into ``folder`` (``{run_name}`` allowed) under ``filename``.

    ``num_checkpoints_to_keep=-1`` keeps all; otherwise the newest N of this run are kept, including
    files earlier runs with the same run name left. ``weights_only`` saves the model alone;
    ``overwrite=False`` refuses to replace an existing checkpoint of the same name.
    """

    def __init__(
        self,
        folder: str,
        *,
        filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
        latest_filename: str | None = "latest-rank{rank}.pt",
        save_interval: IntervalInput = "1ep",
        num_checkpoints_to_keep: int = -1,
        weights_only: bool = False,
        overwrite: bool = False,
    ) -> None:
        check_template(folder, "save_folder")
        if not folder.strip():
            raise ValueError(
                f"save_folder={folder!r} names no folder; pass one, e.g. 'checkpoints/{{run_name}}' "
                "('.' for the working directory)."
            )
        self.folder_template = folder
        self.filename = check_template(filename, "save_filename")
        if latest_filename is not None:
            check_template(latest_filename, "save_latest_filename")
            if not latest_filename.strip() or "/" in latest_filename or os.sep in latest_filename:
                raise ValueError(
                    f"save_latest_filename={latest_filename!r} must be a file name in save_folder (no folders), "
                    "e.g. 'latest-rank{rank}.pt', or None for no pointer."
                )
        self.latest_filename = latest_filename
        self.interval = create_interval(save_interval, name="save_interval")
        if isinstance(num_checkpoints_to_keep, bool) or num_checkpoints_to_keep == 0 or num_checkpoints_to_keep < -1:
            raise ValueError(f"save_num_checkpoints_to_keep={num_checkpoints_to_keep} must be -1 (all) or positive.")
        if num_checkpoints_to_keep > 0:
            check_prunable(filename, f"save_num_checkpoints_to_keep={num_checkpoints_to_keep}")
        if not overwrite and not names_differ_between_saves(filename) and not fires_once(self.interval):
            raise ValueError(
                f"save_filename={filename!r} has none of the fields that change between saves "
                f"({', '.join('{' + field + '}' for field in PROGRESS_FIELDS)}), so the second save of "
                f"save_interval={save_interval!r} would find the first and stop training. Use e.g. "
                "'ep{epoch}-ba{batch}-rank{rank}.pt', or save_overwrite=True to keep only the newest."
            )
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = weights_only
        self.overwrite = overwrite
        self.saved: list[str] = []
        self.last_saved_batch = -1
        self._save: SaveFunction | None = None
        self._run_name = ""
        self._folder: Folder | None = None
        self._uploader: Uploader | None = None

    def bind(self, save: SaveFunction, run_name: str) -> None:
        """Connect to a Trainer: ``save(path, weights_only)`` writes a checkpoint (a collective call)."""
        self._save, self._run_name = save, run_name
        self._folder = Folder(format_name(self.folder_template, {"run_name": run_name}))

    @property
    def folder(self) -> Folder:
        if self._folder is None:
            raise RuntimeError("CheckpointSaver is not bound to a Trainer yet.")
        return self._folder

    def batch_checkpoint(self, state: State, logger: Any) -> None:
        if self.interval(state, Event.BATCH_END):
            self.save(state)

    def epoch_checkpoint(self, state: State, logger: Any) -> None:
        if self.interval(state, Event.EPOCH_END):
            self.save(state)

    def fit_end(self, state: State, logger: Any) -> None:
        self.wait()

    def save(self, state: State) -> str:
        """Save now (on every rank: it is a collective); returns the checkpoint's URL."""
        assert self._save is not None, "bind() first"
        fabric, folder = state.fabric, self.folder
        name = format_name(self.filename, self._name_values(state))
        if not self.overwrite and fabric.broadcast(folder.exists(name) if fabric.is_global_zero else False):
            raise FileExistsError(
                f"{folder.join(name)} exists; pass save_overwrite=True to replace it, or use another run name."
            )
        if folder.is_local:
            self._save(folder.join(name), self.weights_only)
            if fabric.is_global_zero:
                self._after_write(name)
        else:
            staging = os.path.join(tempfile.gettempdir(), f"fabric-checkpoints-{self._run_name}", name)
            self._save(staging, self.weights_only)
            if fabric.is_global_zero:
                self._uploads().submit(
                    lambda: folder.fs.put(staging, folder.join(name), recursive=os.path.isdir(staging)),
                    lambda: self._after_write(name),
                    lambda: _remove_local(staging),
                )
        self.saved.append(folder.join(name))
        self.last_saved_batch = int(state.timestamp.batch)
        return folder.join(name)

    def wait(self) -> None:
        """Block until pending uploads are done (raising their error, if any)."""
        if self._uploader is not None:
            self._uploader.wait()

    def close(self, state: State | None = None, logger: Any = None) -> None:
        if self._uploader is not None:
            self._uploader.close()
            self._uploader = None

    def _uploads(self) -> Uploader:
        if self._uploader is None:
            self._uploader = Uploader(max_pending=1)
        return self._uploader

    def _after_write(self, name: str) -> None:
        """The checkpoint is complete at its final place: move ``latest`` to it, then prune old ones."""
        folder = self.folder
        if self.latest_filename is not None:
            folder.point_latest(format_name(self.latest_filename, {"run_name": self._run_name, "rank": 0}), name)
        if self.num_checkpoints_to_keep > 0:
            existing = checkpoints_in(folder, self.filename, self._run_name)
            for _, old in existing[: -self.num_checkpoints_to_keep]:
                if old != name:
                    folder.remove(old)

    def _name_values(self, state: State) -> dict[str, Any]:
        timestamp = state.timestamp
        return {
            "run_name": self._run_name,
            "epoch": int(timestamp.epoch),
            "batch": int(timestamp.batch),
            "sample": int(timestamp.sample),
            "token": int(timestamp.token),
            "batch_in_epoch": int(timestamp.batch_in_epoch),
            "rank": 0,  # Fabric writes one checkpoint per save, from rank 0 (sharded ones are directories)
        }


def _remove_local(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
