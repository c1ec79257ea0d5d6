"""Temporary siblings of a checkpoint being written, and the clean-up of those a killed save left behind.

A save writes ``.NAME.tmp-PID-UUID@HOST`` next to ``NAME`` and renames it over ``NAME`` when complete.
Several writers may save to one path at once (two jobs, a job and its restarted copy), so a save
removes only temporaries that are provably abandoned. The writer holds an advisory lock
(``flock``) on its temporary from creation until the rename (:func:`owned_temporary`), and the kernel
drops it when the writer dies. A temporary is created locked: under a name no cleaner takes for one
(``.fabric-creating-UUID``), locked, then renamed to its name, so a temporary of this host that is unlocked
has lost its writer and is removed by the next save, however young (a killed sharded save's directory is a
whole checkpoint's worth of disk). A process id says nothing here, as writers in other PID namespaces
(containers, Kubernetes ``hostNetwork`` pods) share the host name but not the process ids. A temporary of another
host, or of an unknown owner, or on a file system without locks, counts as abandoned once nothing has
written to it for :data:`ABANDONED_AFTER` seconds, as does one in a remote folder
(:func:`remove_abandoned_remote`), where no lock can be checked. The PID and host stay in the name for
the humans reading a directory listing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; every temporary is judged by its age
    fcntl = None  # type: ignore[assignment]

#: Seconds without a write after which a temporary whose lock cannot be checked counts as abandoned.
ABANDONED_AFTER = 3600.0
#: What a temporary is called between its creation and its lock (see :func:`create_locked`).
CREATING_PREFIX = ".fabric-creating-"
#: Seconds such a one is spared: the instant between its creation and its rename, with room for a stalled writer.
LOCK_GRACE = 30.0


def temporary_sibling(target: Path, kind: str = "tmp") -> Path:
    """A fresh name beside ``target`` that records this process as its owner."""
    return target.parent / f"{_prefix(target.name, kind)}{os.getpid()}-{uuid.uuid4().hex}@{socket.gethostname()}"


@contextlib.contextmanager
def owned_temporary(target: Path, kind: str = "tmp", directory: bool = False) -> Iterator[Path]:
    """Create a temporary sibling of ``target`` (a file, or a directory) and hold its lock while the block runs.

    Rename the temporary over ``target`` inside the block; the lock is released on leaving it. If the
    block raises, what is left of the temporary is deleted.
    """
    path = temporary_sibling(target, kind)
    descriptor = create_locked(path, directory)
    try:
        yield path
    except BaseException:
        remove_temporary(path)
        raise
    finally:
        release_lock(descriptor)


def create_locked(path: Path, directory: bool = False) -> int | None:
    """Create ``path`` (a file, or a directory) and its parents, locked from the moment it has its name; returns
    the descriptor that holds the lock, for :func:`release_lock` (``None`` where there are no locks: Windows).

    It is made under a name of the kind :func:`remove_abandoned` spares while young, locked, then renamed (the
    lock belongs to the open file, which the rename keeps), so no cleaner ever sees it unlocked while its
    writer lives.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    creating = path.parent / f"{CREATING_PREFIX}{uuid.uuid4().hex}"
    if directory:
        creating.mkdir()
        if fcntl is None:
            creating.rename(path)
            return None
        descriptor = os.open(creating, os.O_RDONLY)
    else:
        descriptor = os.open(creating, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without locks (some FUSE mounts): cleaners go by age
            fcntl.flock(descriptor, fcntl.LOCK_EX)
    os.rename(creating, path)
    return descriptor


def release_lock(descriptor: int | None) -> None:
    if descriptor is not None:
        os.close(descriptor)


def remove_abandoned(target: Path, kinds: tuple[str, ...] = ("tmp",)) -> None:
    """Delete the abandoned temporaries (files or directories) of ``target`` of the given kinds."""
    prefixes = tuple(_prefix(target.name, kind) for kind in kinds)
    now = time.time()
    with contextlib.suppress(FileNotFoundError), os.scandir(target.parent) as entries:
        for entry in entries:
            prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
            if prefix is None and not entry.name.startswith(CREATING_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):  # its owner may finish (rename) it meanwhile
                age = now - entry.stat(follow_symlinks=False).st_mtime
                if prefix is None:  # left by a process that died in create_locked, or one still in it
                    abandoned = age > LOCK_GRACE
                else:
                    abandoned = _is_abandoned(Path(entry.path), entry.name[len(prefix) :], age)
                if abandoned:
                    remove_temporary(Path(entry.path))


def remove_abandoned_remote(fs: AbstractFileSystem, target_path: str, kinds: tuple[str, ...] = ("tmp",)) -> None:
    """Delete the temporaries of ``target_path`` on the fsspec filesystem ``fs`` (an object store) that nothing
    has written to for :data:`ABANDONED_AFTER` seconds; one whose time is unknown is kept."""
    parent, _, name = target_path.rstrip("/").rpartition("/")
    prefixes = tuple(_prefix(name, kind) for kind in kinds)
    now = time.time()
    try:
        entries = fs.ls(parent, detail=True)
    except FileNotFoundError:
        return
    for entry in entries:
        if not entry["name"].rstrip("/").rpartition("/")[2].startswith(prefixes):
            continue
        modified = last_written(fs, entry)
        if modified is not None and now - modified > ABANDONED_AFTER:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(entry["name"], recursive=True)


def _prefix(name: str, kind: str) -> str:
    return f".{name}.{kind}-"


def _is_abandoned(path: Path, owner: str, age: float) -> bool:
    """Whether the temporary ``path``, named ``PID-UUID@HOST`` (``owner``), can be deleted without harm."""
    same_host = "@" in owner and owner.rpartition("@")[2] == socket.gethostname()
    locked = _is_locked(path) if same_host else None
    if locked is not None:
        return not locked
    return age > ABANDONED_AFTER


def _is_locked(path: Path) -> bool | None:
    """Whether a process holds the lock of ``path`` (its writer is alive); ``None`` where locks are unavailable."""
    if fcntl is None:
        return None
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # the file system has no locks
        return None
    finally:
        os.close(descriptor)  # releases the lock if this process took it
    return False


def remove_temporary(path: Path) -> None:
    """Delete the file or directory ``path`` if it is there (another save's clean-up may delete it too)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def last_written(fs: AbstractFileSystem, info: dict[str, Any]) -> float | None:
    """When the remote file ``info`` (from ``fs.ls(detail=True)``), or the newest object under a directory
    (a prefix, which often has no time of its own), was last written; ``None`` if the store does not say."""
    times = [_timestamp(info)]
    if info.get("type") == "directory":
        times += [_timestamp(below) for below in fs.find(info["name"], detail=True).values()]
    known = [stamp for stamp in times if stamp is not None]
    return max(known) if known else None


def _timestamp(info: dict[str, Any]) -> float | None:
    """The modification time an fsspec ``info`` dict gives: s3fs ``LastModified``, ``mtime``, gcsfs
    ``updated``, memory ``created`` (a datetime, an ISO string or seconds since the epoch)."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(key)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None
