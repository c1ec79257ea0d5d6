"""Several writers, killed writers and a full disk: a checkpoint path always holds one complete save.

- Two processes saving to one path in a loop never fail, and the last complete save wins.
- A save removes only temporaries that are provably abandoned (owner gone, or untouched for long).
- A sharded (FSDP) save cleans up the directory a killed save left beside the target.
- A full disk is reported as such, with the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric.plugins.io import temporaries, torch_io
from fabric.plugins.io.distributed_checkpoint import publish, read_whole, temporary_directory, write_shards
from fabric.utilities.exceptions import CheckpointError

SAVES = 150

_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from fabric import Fabric

    path, me, other, saves = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    fabric = Fabric(accelerator="cpu")
    (path.parent / f"ready-{me}").touch()
    while not (path.parent / f"ready-{other}").exists():  # start together, so the saves overlap
        pass
    for iteration in range(saves):
        fabric.save(path, {"writer": me, "iteration": iteration, "weights": torch.full((256,), float(iteration))})
    print(saves)
    """
)


def test_two_processes_saving_to_one_path_never_fail_and_the_last_complete_save_wins(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "ckpt.pt"
    path.parent.mkdir()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), me, other, str(SAVES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, other in (("a", "b"), ("b", "a"))
    ]
    outputs = [writer.communicate(timeout=120) for writer in writers]
    for writer, (stdout, stderr) in zip(writers, outputs, strict=True):
        assert writer.returncode == 0, stderr[-3000:]
        assert stdout.split() == [str(SAVES)]
    loaded = Fabric(accelerator="cpu").load(path)
    # Each writer's last act is its final save, so the file holds the final save of one of them, whole.
    assert loaded["iteration"] == SAVES - 1 and loaded["writer"] in ("a", "b")
    assert torch.equal(loaded["weights"], torch.full((256,), float(SAVES - 1)))
    assert sorted(entry.name for entry in path.parent.iterdir()) == ["ckpt.pt", "ready-a", "ready-b"]


def _finished_pid() -> int:
    """The id of a process that has exited (and been reaped): an owner that is provably gone."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_removes_only_the_temporaries_that_are_provably_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    host, old = socket.gethostname(), time.time() - 2 * temporaries.ABANDONED_AFTER
    names = {
        "dead owner": f".ckpt.pt.tmp-{_finished_pid()}-{'0' * 32}@{host}",
        "live owner, long untouched": f".ckpt.pt.tmp-{os.getpid()}-{'1' * 32}@{host}",
        "other host, recent": f".ckpt.pt.tmp-1-{'2' * 32}@elsewhere.example",
        "other host, long untouched": f".ckpt.pt.tmp-1-{'3' * 32}@elsewhere.example",
        "no owner, recent": f".ckpt.pt.tmp-{'4' * 32}",
        "no owner, long untouched": f".ckpt.pt.tmp-{'5' * 32}",
        "another checkpoint's": f".other.pt.tmp-{_finished_pid()}-{'6' * 32}@{host}",
    }
    for label, name in names.items():
        (tmp_path / name).write_bytes(b"partial")
        if "long untouched" in label:
            os.utime(tmp_path / name, (old, old))

    Fabric(accelerator="cpu").save(path, {"step": 1})

    kept = {label for label, name in names.items() if (tmp_path / name).exists()}
    assert kept == {"live owner, long untouched", "other host, recent", "no owner, recent", "another checkpoint's"}


_KILLED_SHARDED_SAVE = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    from fabric.plugins.io.distributed_checkpoint import temporary_directory, write_shards

    write_shards({"weights": torch.ones(64)}, temporary_directory(Path(sys.argv[1])))
    os._exit(9)  # killed after writing, before the rename
    """
)


def test_a_sharded_save_removes_what_a_killed_sharded_save_left_behind(tmp_path: Path) -> None:
    target = tmp_path / "sharded"
    killed = subprocess.run([sys.executable, "-c", _KILLED_SHARDED_SAVE, str(target)], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr[-3000:]
    leftovers = [entry.name for entry in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".sharded.tmp-")

    for step in (1, 2):  # the second save also sets the first aside and deletes it
        temporary = temporary_directory(target)
        write_shards({"weights": torch.full((64,), float(step))}, temporary)
        publish(temporary, target)

    assert [entry.name for entry in tmp_path.iterdir()] == ["sharded"]
    assert torch.equal(read_whole(target)["weights"], torch.full((64,), 2.0))


class _DiskFills:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, file: Any, room: int) -> None:
        self._file, self._room = file, room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return int(self._file.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _DiskFills:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()


@pytest.mark.parametrize("room", [0, 4096, 1 << 20])  # at the first byte, in the header, amid the tensors
def test_a_full_disk_is_reported_as_such_and_the_previous_checkpoint_is_intact(
    room: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    fabric = Fabric(accelerator="cpu")
    previous = {"step": 1, "weights": torch.arange(8.0)}
    fabric.save(path, previous)

    monkeypatch.setattr(torch_io, "open", lambda file, mode: _DiskFills(open(file, mode), room), raising=False)  # noqa: SIM115
    with pytest.raises(CheckpointError) as error:
        fabric.save(path, {"step": 2, "weights": torch.zeros(1 << 20)})
    monkeypatch.undo()

    assert (
        str(error.value) == f"No space left on device while writing {str(path)!r}; the previous checkpoint is intact."
    )
    loaded = fabric.load(path)
    assert loaded["step"] == 1 and torch.equal(loaded["weights"], previous["weights"])
    assert [entry.name for entry in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_a_full_disk_at_fsync_is_reported_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    fabric = Fabric(accelerator="cpu")
    fabric.save(path, {"step": 1})

    def full(_: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch_io.os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"No space left on device while writing .*previous checkpoint is intact"):
        fabric.save(path, {"step": 2})
    monkeypatch.undo()
    assert fabric.load(path) == {"step": 1}
    assert [entry.name for entry in tmp_path.iterdir()] == ["ckpt.pt"]
