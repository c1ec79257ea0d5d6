"""A full disk, said the same way by every checkpoint writer: one line naming the path, and that the
checkpoint saved there before is intact."""

from __future__ import annotations

import errno
import os

from fabric.plugins.io.checkpoint_io import PathType
from fabric.utilities.exceptions import CheckpointError


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` or what caused it is a full disk or quota (``torch.save`` reports a failed
    write as ``RuntimeError: ... unexpected pos``, with the ``OSError`` as its context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def disk_full_error(path: PathType) -> CheckpointError:
    return CheckpointError(
        f"No space left on device while writing {os.fspath(path)!r}; the previous checkpoint is intact."
    )
