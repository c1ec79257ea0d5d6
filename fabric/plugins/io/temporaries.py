"""Temporary siblings of a checkpoint being written, and the clean-up of those a killed save left behind.

A save writes ``.NAME.tmp-PID-UUID@HOST`` next to ``NAME`` and renames it over ``NAME`` when complete.
Several writers may save to one path at once (two jobs, a job and its restarted copy), so a save
removes only temporaries that are provably abandoned: their owner process is gone (same host), or
nothing has written to them for :data:`ABANDONED_AFTER` seconds (another host, or a name without an
owner). A live writer's temporary is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

#: Seconds without a write after which a temporary of an unknown or remote owner counts as abandoned.
ABANDONED_AFTER = 3600.0


def temporary_sibling(target: Path, kind: str = "tmp") -> Path:
    """A fresh name beside ``target`` that records this process as its owner."""
    return target.parent / f"{_prefix(target.name, kind)}{os.getpid()}-{uuid.uuid4().hex}@{socket.gethostname()}"


def remove_abandoned(target: Path, kinds: tuple[str, ...] = ("tmp",)) -> None:
    """Delete the abandoned temporaries (files or directories) of ``target`` of the given kinds."""
    prefixes = tuple(_prefix(target.name, kind) for kind in kinds)
    now = time.time()
    with contextlib.suppress(FileNotFoundError), os.scandir(target.parent) as entries:
        for entry in entries:
            prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
            if prefix is None:
                continue
            with contextlib.suppress(FileNotFoundError):  # its owner may finish (rename) it meanwhile
                if _is_abandoned(entry.name[len(prefix) :], entry.stat(follow_symlinks=False).st_mtime, now):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.remove(entry.path)


def _prefix(name: str, kind: str) -> str:
    return f".{name}.{kind}-"


def _is_abandoned(owner: str, modified: float, now: float) -> bool:
    """Whether the temporary named ``PID-UUID@HOST`` (``owner``) can be deleted without harm."""
    head, _, host = owner.partition("@")
    pid_text = head.partition("-")[0]
    if host == socket.gethostname() and pid_text.isdigit() and sys.platform != "win32":
        return not _process_exists(int(pid_text))
    return now - modified > ABANDONED_AFTER


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True
