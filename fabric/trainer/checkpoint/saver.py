"""``CheckpointSaver``: saves the Trainer at an interval, keeps ``latest`` current and old checkpoints pruned.

It runs at BATCH_CHECKPOINT and EPOCH_CHECKPOINT (after evaluation, so saved metrics and stopper
states are current). Local folders are written in place (atomically, by Fabric). Sharded checkpoints
(FSDP, DeepSpeed) go straight to their folder, local or remote: every rank writes its own part there,
and the save returns once all parts are in place. A one-file checkpoint for a remote folder is written
to a staging directory private to this process first, then uploaded on a background thread and the
staged copy deleted; ``latest`` moves and old checkpoints are pruned only after the upload completed.
``fit()`` waits for pending uploads at FIT_END and deletes the staging directory (so does closing the
Trainer); one a killed process left behind is deleted by the next saver on the machine. With
``async_save`` a save takes a CPU snapshot and returns; the snapshot is written in the background straight
into the folder (no staging), one save at a time, and ``latest`` moves once it is complete.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from typing_extensions import override

from fabric.plugins.io.checkpoint_io import StorageOptions
from fabric.plugins.io.storage import check_writable_folder
from fabric.plugins.io.temporaries import create_locked, release_lock, remove_abandoned, temporary_sibling
from fabric.trainer.checkpoint.storage import (
    FOLDER_FIELDS,
    LATEST_FIELDS,
    PROGRESS_FIELDS,
    REPLICA_GROUP_MARK,
    Folder,
    Uploader,
    check_prunable,
    check_template,
    checkpoints_in,
    folder_name,
    format_name,
    names_differ_between_saves,
)
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.intervals import IntervalInput, SavesAtIntervals, create_interval, fires_once
from fabric.utilities.exceptions import CheckpointError

#: ``save(path, weights_only, storage_options, async_save)``: write a Trainer checkpoint (a collective call);
#: the future completes when the checkpoint is complete.
SaveFunction = Callable[[str, bool, StorageOptions, bool], Future[None]]
#: Where the staging directories of remote saves live, one per process: ``.{run name}.staging-{owner}``.
STAGING_ROOT = "fabric-checkpoint-staging"


@dataclass(frozen=True)
class SaveSettings:
    """What a :class:`CheckpointSaver` saves, where, under which names and how often: its arguments (the Trainer's
    ``save_*`` ones), checked when made, so a plan can hold them before any saver exists."""

    folder: str
    filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt"
    latest_filename: str | None = "latest-rank{rank}.pt"
    save_interval: IntervalInput = "1ep"
    num_checkpoints_to_keep: int = -1
    weights_only: bool = False
    overwrite: bool = False
    storage_options: StorageOptions = None
    async_save: bool = False

    def __post_init__(self) -> None:
        _check_folder(self.folder)
        check_template(self.filename, "save_filename")
        _check_latest_filename(self.latest_filename)
        interval = create_interval(self.save_interval, name="save_interval")
        keep = self.num_checkpoints_to_keep
        if isinstance(keep, bool) or keep == 0 or keep < -1:
            raise ValueError(f"save_num_checkpoints_to_keep={keep} must be -1 (all) or positive.")
        if keep > 0:
            check_prunable(self.filename, f"save_num_checkpoints_to_keep={keep}")
        if not self.overwrite and not names_differ_between_saves(self.filename) and not fires_once(interval):
            raise ValueError(
                f"save_filename={self.filename!r} has none of the fields that change between saves "
                f"({', '.join('{' + field + '}' for field in PROGRESS_FIELDS)}), so the second save of "
                f"save_interval={self.save_interval!r} would find the first and stop training. Use e.g. "
                "'ep{epoch}-ba{batch}-rank{rank}.pt', or save_overwrite=True to keep only the newest."
            )


class CheckpointSaver(SavesAtIntervals):
    """Save every ``save_interval`` into ``folder`` (``{run_name}`` allowed) under ``filename``.

    ``num_checkpoints_to_keep=-1`` keeps all; otherwise the newest N of this run are kept, including
    files earlier runs with the same run name left. ``weights_only`` saves the model alone;
    ``overwrite=False`` refuses to replace an existing checkpoint of the same name. ``storage_options``
    go to fsspec for a remote folder (endpoint, credentials). ``async_save`` writes a CPU snapshot in the
    background while training goes on (one save in flight; ``latest`` moves once it is complete).
    """

    def __init__(
        self,
        folder: str,
        *,
        filename: str = SaveSettings.filename,
        latest_filename: str | None = SaveSettings.latest_filename,
        save_interval: IntervalInput = SaveSettings.save_interval,
        num_checkpoints_to_keep: int = SaveSettings.num_checkpoints_to_keep,
        weights_only: bool = SaveSettings.weights_only,
        overwrite: bool = SaveSettings.overwrite,
        storage_options: StorageOptions = SaveSettings.storage_options,
        async_save: bool = SaveSettings.async_save,
    ) -> None:
        SaveSettings(  # the arguments' checks
            folder,
            filename,
            latest_filename,
            save_interval,
            num_checkpoints_to_keep,
            weights_only,
            overwrite,
            storage_options,
            async_save,
        )
        self.folder_template, self.filename, self.latest_filename = folder, filename, latest_filename
        self.interval = create_interval(save_interval, name="save_interval")
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only, self.overwrite = weights_only, overwrite
        self.storage_options = storage_options
        self.async_save = async_save
        self._in_flight: Future[None] | None = None
        self.saved: list[str] = []
        self.last_saved_batch = -1
        self._save: SaveFunction | None = None
        self._run_name = ""
        self._folder: Folder | None = None
        self._uploader: Uploader | None = None
        self._staging: Path | None = None
        self._staging_lock: int | None = None

    @classmethod
    def from_settings(cls, settings: SaveSettings) -> CheckpointSaver:
        """The saver ``settings`` describe (a Trainer's plan holds them before any saver exists)."""
        # Not dataclasses.asdict: it deep-copies, and an interval or storage option object must stay the user's.
        return cls(**{field.name: getattr(settings, field.name) for field in fields(settings)})

    def bind(self, save: SaveFunction, run_name: str, replica_group: int | None = None) -> None:
        """Connect to a Trainer: ``save(path, weights_only)`` writes a checkpoint (a collective call); the run's name
        and replica group (fault tolerance) name the folder."""
        self._save, self._run_name = save, run_name
        self._folder = Folder(folder_name(self.folder_template, run_name, replica_group), self.storage_options)

    @property
    def folder(self) -> Folder:
        if self._folder is None:
            raise RuntimeError("CheckpointSaver is not bound to a Trainer yet.")
        return self._folder

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        """Before any batch trains, the folder must take a write: a misspelled bucket, a read-only mount or missing
        credentials fail now, on every rank, naming the folder, not after the first interval's training."""
        fabric = require_fabric(state)
        problem = None
        if fabric.is_global_zero:
            try:
                check_writable_folder(self.folder.url, self.storage_options)
                problem = self._shared_with_other_replica_groups(fabric.strategy.replica_group)
            except CheckpointError as error:
                problem = str(error)
            except OSError as error:  # the mark could not be written or listed: said on every rank, not only here
                problem = f"save_folder {self.folder.url!r}: cannot mark it as this replica group's: {error}"
        problem = fabric.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _shared_with_other_replica_groups(self, group: int | None) -> str | None:
        """Why this replica group cannot save here, if other groups save to the folder too: each group's
        checkpoints hold its own data position under the same names, so the groups would overwrite each other's,
        and a group resuming from them would read another group's share of the data."""
        others = [] if group is None else self.folder.claim_for_replica_group(group)
        if not others:
            return None
        return (
            f"save_folder {self.folder.url!r} is replica group {group}'s and also group(s) {others}'s (their marks "
            f"{REPLICA_GROUP_MARK.format(group='<n>')} are there): each group's checkpoints hold its own data "
            "position under the same names, so the groups would overwrite each other's. Give each group its own "
            "folder, e.g. save_folder='checkpoints/{run_name}/group{replica_group}'."
        )

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        try:
            self.wait()
        finally:
            self._remove_staging()

    @override
    def save(self, state: State) -> str:
        """Save now (on every rank: it is a collective); returns the checkpoint's URL."""
        assert self._save is not None, "bind() first"
        fabric, folder = require_fabric(state), self.folder
        name = format_name(self.filename, self._name_values(state))
        if not self.overwrite and fabric.broadcast(folder.exists(name) if fabric.is_global_zero else False):
            raise FileExistsError(
                f"{folder.join(name)} exists; pass save_overwrite=True to replace it, or use another run name."
            )
        if self.async_save:  # a snapshot now, written in the background straight into the folder
            written = self._save(folder.join(name), self.weights_only, self.storage_options, True)
            self._in_flight = written
            if fabric.is_global_zero:
                self._uploads().submit(lambda: self._after_background_write(written, name))
        elif folder.is_local or fabric.strategy.saves_on_every_rank:
            self._save(folder.join(name), self.weights_only, self.storage_options, False)
            if fabric.is_global_zero:
                self._after_write(name)
        else:
            staged = os.path.join(self._staging_directory() if fabric.is_global_zero else "", name)
            self._save(staged, self.weights_only, None, False)
            if fabric.is_global_zero:
                self._uploads().submit(lambda: self._upload(staged, name))
        self.saved.append(folder.join(name))
        self.last_saved_batch = int(state.timestamp.batch)
        return folder.join(name)

    def wait(self) -> None:
        """Block until the save in flight and pending uploads are done (raising their error, if any)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()
        if self._uploader is not None:
            self._uploader.wait()

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        try:
            if self._uploader is not None:
                self._uploader.close()
                self._uploader = None
        finally:
            self._remove_staging()

    def _staging_directory(self) -> Path:
        """This process's own staging directory (made, and locked as in use, on first use), after deleting
        those that processes which are gone left behind."""
        if self._staging is None:
            owner = Path(tempfile.gettempdir()) / STAGING_ROOT / self._run_name.replace(os.sep, "_")
            remove_abandoned(owner, kinds=("staging",))
            self._staging = temporary_sibling(owner, "staging")
            self._staging_lock = create_locked(self._staging, directory=True)
        return self._staging

    def _remove_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            release_lock(self._staging_lock)
            self._staging = self._staging_lock = None

    def _after_background_write(self, written: Future[None], name: str) -> None:
        """On the upload thread: once the background save is complete, move ``latest`` and prune."""
        written.result()
        self._after_write(name)

    def _upload(self, staged: str, name: str) -> None:
        """On the upload thread: copy the staged checkpoint into the folder, then move ``latest`` and prune."""
        folder = self.folder
        try:
            folder.fs.put(staged, posixpath.join(folder.path, name), recursive=os.path.isdir(staged))
        finally:
            _remove_local(staged)
        self._after_write(name)

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


def _check_folder(folder: str) -> None:
    """``save_folder``: a template naming a folder."""
    check_template(folder, "save_folder", FOLDER_FIELDS)
    if not folder.strip():
        raise ValueError(
            f"save_folder={folder!r} names no folder; pass one, e.g. 'checkpoints/{{run_name}}' "
            "('.' for the working directory)."
        )


def _check_latest_filename(latest_filename: str | None) -> None:
    """``save_latest_filename``: None (no pointer) or a file name in the save folder."""
    if latest_filename is not None:
        check_template(latest_filename, "save_latest_filename", LATEST_FIELDS)
        if not latest_filename.strip() or "/" in latest_filename or os.sep in latest_filename:
            raise ValueError(
                f"save_latest_filename={latest_filename!r} must be a file name in save_folder (no folders), "
                "e.g. 'latest-rank{rank}.pt', or None for no pointer."
            )
