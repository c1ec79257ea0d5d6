"""Where checkpoints live: file names from templates, the ``latest`` pointer, listing and pruning, uploads.

Folders are local paths or fsspec URLs (``memory://``, ``s3://``, ``gs://`` with their backends).
``latest`` is a symlink on a local disk and, on object stores (which have no links), a small text file
``<latest>.symlink`` holding the target's name. It is moved only after the checkpoint it names is
complete, and both forms are replaced atomically. A sharded checkpoint directory counts only once its
save finished (:mod:`fabric.plugins.io.formats`): an unfinished one is never listed, resumed from or
taken for an existing checkpoint.
"""

from __future__ import annotations

import os
import posixpath
import queue
import re
import string
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from fabric.plugins.io.checkpoint_io import StorageOptions
from fabric.plugins.io.formats import is_complete_directory
from fabric.plugins.io.storage import filesystem

#: Fields a file name template may use.
NAME_FIELDS = ("run_name", "epoch", "batch", "sample", "token", "batch_in_epoch", "rank")
#: Fields a save folder may use: fixed for the run on every rank (``replica_group``: the group's index under fault
#: tolerance, else 0), so that every rank saves into, lists and resumes from the one folder.
FOLDER_FIELDS = ("run_name", "replica_group")
#: Fields the ``latest`` pointer's name may use: one pointer per rank's name, moved as the checkpoints are saved.
LATEST_FIELDS = ("run_name", "rank")
POINTER_SUFFIX = ".symlink"
#: The mark a replica group leaves in its save folder (fault tolerance), ``{group}`` its index.
REPLICA_GROUP_MARK = ".fabric-replica-group-{group}"


def check_template(template: str, what: str, allowed: tuple[str, ...] = NAME_FIELDS) -> str:
    """Fail now, naming the field, if ``template`` uses a field outside ``allowed``."""
    fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    unknown = sorted({field for field in fields if field not in allowed})
    if unknown:
        raise ValueError(f"{what}={template!r} uses {unknown}; the fields it may use are {list(allowed)}.")
    return template


def folder_name(template: str, run_name: str, replica_group: int | None) -> str:
    """The save folder ``template`` names for this run (and replica group: 0 without fault tolerance)."""
    return template.format(run_name=run_name, replica_group=0 if replica_group is None else replica_group)


#: Fields that differ between two saves of one run; pruning orders checkpoints by them.
PROGRESS_FIELDS = ("epoch", "batch", "sample", "token")


def names_differ_between_saves(template: str) -> bool:
    """Whether names made from ``template`` hold a field of :data:`PROGRESS_FIELDS`."""
    fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    return bool(fields & set(PROGRESS_FIELDS))


def check_prunable(template: str, why: str) -> None:
    """Fail now unless names made from ``template`` tell saves apart and sit directly in the folder
    (``why`` names the option that needs old checkpoints found and pruned)."""
    if not names_differ_between_saves(template):
        raise ValueError(
            f"save_filename={template!r} has none of the fields that change between saves "
            f"({', '.join('{' + field + '}' for field in PROGRESS_FIELDS)}), so every save replaces the last and "
            f"{why} has nothing to prune; use e.g. 'ep{{epoch}}-ba{{batch}}-rank{{rank}}.pt', or keep all (-1)."
        )
    if "/" in template:
        raise ValueError(
            f"save_filename={template!r} puts checkpoints in subfolders, where {why} does not look for old "
            "ones; use a plain file name, e.g. 'ep{epoch}-ba{batch}-rank{rank}.pt', or keep all (-1)."
        )


def format_name(template: str, values: Mapping[str, Any]) -> str:
    return template.format(**{field: values[field] for field in NAME_FIELDS if field in values})


def template_pattern(template: str, run_name: str) -> re.Pattern[str]:
    """A regex matching names made from ``template`` for ``run_name``, capturing the numeric fields."""
    pattern, groups = "", set()
    for literal, field, _, _ in string.Formatter().parse(template):
        pattern += re.escape(literal)
        if field is None:
            continue
        if field == "run_name":
            pattern += re.escape(run_name)
        elif field in groups:
            pattern += rf"(?P={field})"
        else:
            groups.add(field)
            pattern += rf"(?P<{field}>\d+)"
    return re.compile(pattern)


class Folder:
    """A checkpoint folder on some filesystem (a local path or an fsspec URL, with fsspec's ``storage_options``)."""

    def __init__(self, url: str, storage_options: StorageOptions = None) -> None:
        self.url = url
        self.storage_options = storage_options
        self.fs, self.path = filesystem(url, storage_options)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def join(self, name: str) -> str:
        """The URL (or local path) of ``name`` in this folder."""
        if self.is_local:
            return os.path.join(self.url, name)
        return f"{self.url.rstrip('/')}/{name}"

    def names(self) -> list[str]:
        """Names of the entries in the folder (none if it does not exist)."""
        self.fs.invalidate_cache(self.path)  # other processes write here: a cached listing may be stale
        if not self.fs.exists(self.path):
            return []
        return [posixpath.basename(entry.rstrip("/")) for entry in self.fs.ls(self.path, detail=False)]

    def exists(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint in the folder: a file, or a directory whose save finished."""
        path = posixpath.join(self.path, name)
        self.fs.invalidate_cache(path)
        if not self.fs.exists(path):
            return False
        return not self.fs.isdir(path) or is_complete_directory(self.join(name), self.storage_options)

    def remove(self, name: str) -> None:
        self.fs.rm(posixpath.join(self.path, name), recursive=True)

    def claim_for_replica_group(self, group: int) -> list[int]:
        """Mark the folder as replica group ``group``'s; returns the other groups that marked it, and then takes the
        mark back (the claim failed). The mark is written before the folder is listed, so of two groups claiming one
        folder at once each sees the other."""
        mark = posixpath.join(self.path, REPLICA_GROUP_MARK.format(group=group))
        self.fs.makedirs(self.path, exist_ok=True)
        self.fs.pipe(mark, b"")
        prefix = REPLICA_GROUP_MARK.format(group="")
        marks = [name[len(prefix) :] for name in self.names() if name.startswith(prefix)]
        others = sorted(int(other) for other in marks if other.isdigit() and int(other) != group)
        if others:
            self.fs.rm(mark)
        return others

    def point_latest(self, latest_name: str, target_name: str) -> None:
        """Make ``latest_name`` name ``target_name``, replacing the previous pointer atomically."""
        if self.is_local:
            os.makedirs(self.url, exist_ok=True)
            temporary = os.path.join(self.url, f".{latest_name}.tmp-{os.getpid()}")
            if os.path.lexists(temporary):
                os.remove(temporary)
            os.symlink(target_name, temporary)
            os.replace(temporary, os.path.join(self.url, latest_name))
        else:
            self.fs.pipe(posixpath.join(self.path, latest_name + POINTER_SUFFIX), target_name.encode())

    def resolve_latest(self, latest_name: str) -> str | None:
        """The URL the ``latest`` pointer names, or None when there is no pointer or its target is gone."""
        if self.is_local:
            link = os.path.join(self.url, latest_name)
            if os.path.islink(link) and os.path.exists(link):
                return os.path.join(self.url, os.readlink(link))
            return None
        pointer = posixpath.join(self.path, latest_name + POINTER_SUFFIX)
        self.fs.invalidate_cache(pointer)
        if not self.fs.exists(pointer):
            return None
        target = self.fs.cat(pointer).decode().strip()
        return self.join(target) if self.exists(target) else None


def checkpoints_in(folder: Folder, template: str, run_name: str) -> list[tuple[tuple[int, ...], str]]:
    """``((epoch, batch, sample, token), name)`` of every complete checkpoint of ``run_name``, oldest first.

    Temporary files of interrupted saves start with ``.`` and never match the template; directories of
    unfinished sharded saves are left out.
    """
    pattern = template_pattern(template, run_name)
    found = []
    for name in folder.names():
        match = pattern.fullmatch(name)
        if match is None or name.startswith(".") or not folder.exists(name):
            continue
        numbers = match.groupdict()
        found.append((tuple(int(numbers.get(field) or 0) for field in ("batch", "epoch", "sample", "token")), name))
    return sorted(found)


class Uploader:
    """Copies finished checkpoints to remote storage on a background thread, so training continues.

    The queue is bounded: a save waits only when ``max_pending`` uploads are already queued. An upload
    error is raised at the next :meth:`submit` or at :meth:`wait`, never lost.
    """

    def __init__(self, max_pending: int = 1) -> None:
        self._queue: queue.Queue[tuple[Callable[[], None], ...] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def submit(self, *steps: Callable[[], None]) -> None:
        """Run ``steps`` in order on the upload thread (e.g. upload, then move ``latest``, then prune)."""
        self._raise_error()
        self._queue.put(steps)

    def wait(self) -> None:
        """Block until every submitted upload finished; raise the first error any of them had."""
        self._queue.join()
        self._raise_error()

    def close(self) -> None:
        self.wait()
        self._queue.put(None)
        self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"Uploading a checkpoint failed: {error}") from error

    def _run(self) -> None:
        while True:
            steps = self._queue.get()
            try:
                if steps is None:
                    return
                if self._error is None:
                    for step in steps:
                        step()
            except BaseException as error:  # handed to the training thread by _raise_error
                self._error = error
            finally:
                self._queue.task_done()
