"""Several writers, killed writers and a full disk: a checkpoint path always holds one complete save.

- Two processes saving to one path in a loop never fail, and the last complete save wins, also when they
  are in different PID namespaces (containers sharing the host name), where neither sees the other's id.
- A save removes only temporaries that are provably abandoned (unlocked past a short grace period on
  this host, untouched for long elsewhere), in local and in remote (fsspec) folders.
- A sharded (FSDP) save cleans up the directory a killed save left beside the target.
- A full disk is reported as such, with the previous checkpoint intact.
"""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
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


_OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]
needs_pid_namespaces = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (Linux) to run a writer in its own PID namespace",
)


@pytest.mark.parametrize(
    "namespaces",
    [
        pytest.param(False, id="one PID namespace"),
        pytest.param(True, id="two PID namespaces", marks=needs_pid_namespaces),
    ],
)
def test_two_processes_saving_to_one_path_never_fail_and_the_last_complete_save_wins(
    namespaces: bool, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoints" / "ckpt.pt"
    path.parent.mkdir()

    def command(me: str, other: str) -> list[str]:
        writer = [sys.executable, "-c", _WRITER, str(path), me, other, str(SAVES)]
        return [*_OWN_PID_NAMESPACE, *writer] if namespaces and me == "b" else writer

    writers = [
        subprocess.Popen(
            command(me, other),
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


def test_a_save_removes_only_the_temporaries_that_are_provably_abandoned(tmp_path: Path) -> None:
    """On this host a temporary is alive while its writer holds its lock, whatever process id its name shows."""
    path = tmp_path / "ckpt.pt"
    host, now = socket.gethostname(), time.time()
    past_grace, old = now - 2 * temporaries.LOCK_GRACE, now - 2 * temporaries.ABANDONED_AFTER
    names = {
        "unlocked, past the grace period": (f".ckpt.pt.tmp-{os.getpid()}-{'0' * 32}@{host}", past_grace),
        "unlocked, just created": (f".ckpt.pt.tmp-{os.getpid()}-{'1' * 32}@{host}", now),
        "other host, recent": (f".ckpt.pt.tmp-1-{'2' * 32}@elsewhere.example", past_grace),
        "other host, long untouched": (f".ckpt.pt.tmp-1-{'3' * 32}@elsewhere.example", old),
        "no owner, recent": (f".ckpt.pt.tmp-{'4' * 32}", past_grace),
        "no owner, long untouched": (f".ckpt.pt.tmp-{'5' * 32}", old),
        "another checkpoint's": (f".other.pt.tmp-1-{'6' * 32}@{host}", old),
    }
    for name, modified in names.values():
        (tmp_path / name).write_bytes(b"partial")
        os.utime(tmp_path / name, (modified, modified))

    with temporaries.owned_temporary(path) as live:  # a writer of this host, long at work on its temporary
        live.write_bytes(b"partial")
        os.utime(live, (old, old))
        Fabric(accelerator="cpu").save(path, {"step": 1})
        assert live.exists()

    kept = {label for label, (name, _) in names.items() if (tmp_path / name).exists()}
    # A temporary is locked from the moment it has its name, so one of this host that is unlocked, however young,
    # lost its writer (it used to be spared for 30 s: a killed sharded save's whole checkpoint of disk).
    assert kept == {"other host, recent", "no owner, recent", "another checkpoint's"}


def test_abandoned_temporaries_in_a_remote_folder_are_removed_by_their_age() -> None:
    """No lock can be checked on an object store: only the time of the last write tells."""
    fs, folder = fsspec.filesystem("memory"), f"/remote-{uuid.uuid4().hex}"
    old, recent = time.time() - 2 * temporaries.ABANDONED_AFTER, time.time()
    temporaries_written = {  # label: (name, {object under the name: when it was written})
        "file, old": (".ckpt.pt.tmp-7-a@elsewhere", {"": old}),
        "file, recent": (".ckpt.pt.tmp-7-b@elsewhere", {"": recent}),
        "prefix, every object old": (".ckpt.pt.tmp-7-c@elsewhere", {"/__0_0.distcp": old, "/.metadata": old}),
        "prefix, one object recent": (".ckpt.pt.tmp-7-d@elsewhere", {"/__0_0.distcp": old, "/.metadata": recent}),
        "set aside, old, a kind not asked for": (".ckpt.pt.old-7-e@elsewhere", {"": old}),
        "another checkpoint's, old": (".other.pt.tmp-7-f@elsewhere", {"": old}),
    }
    for name, objects in temporaries_written.values():
        for below, written in objects.items():
            fs.pipe_file(f"{folder}/{name}{below}", b"partial")
            fs.store[f"{folder}/{name}{below}"].created = datetime.datetime.fromtimestamp(
                written, datetime.timezone.utc
            )
    fs.pipe_file(f"{folder}/ckpt.pt", b"complete")

    temporaries.remove_abandoned_remote(fs, f"{folder}/ckpt.pt")

    kept = {label for label, (name, _) in temporaries_written.items() if fs.exists(f"{folder}/{name}")}
    assert kept == {
        "file, recent",
        "prefix, one object recent",
        "set aside, old, a kind not asked for",
        "another checkpoint's, old",
    }
    assert fs.cat_file(f"{folder}/ckpt.pt") == b"complete"


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

    for step in (1, 2):  # the first save removes the killed one's directory at once; the second sets the first aside
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


_SHARDED_ON_A_SMALL_DISK = textwrap.dedent(
    """
    import sys

    import torch

    from fabric import Fabric
    from fabric.utilities.exceptions import CheckpointError

    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=1)
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(64, 64))
    fabric.save(sys.argv[1], {"model": model, "step": 1})
    try:
        fabric.save(sys.argv[1], {"model": model, "step": 2, "padding": torch.zeros(1 << 18)})
    except CheckpointError as error:
        print(error)
    print(fabric.load(sys.argv[1])["step"])
    """
)


def test_a_sharded_save_on_a_full_disk_is_one_line_and_the_previous_checkpoint_is_intact(tmp_path: Path) -> None:
    """DCP raised its raw CheckpointException, with a traceback per rank embedded in the message."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "sharded_save.py"
    script.write_text(_SHARDED_ON_A_SMALL_DISK)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        result = subprocess.run(
            [sys.executable, str(script), str(disk / "ckpt")], capture_output=True, text=True, timeout=120
        )
        leftovers = sorted(entry.name for entry in disk.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert result.returncode == 0, result.stderr[-3000:]
    message, step = result.stdout.strip().splitlines()
    assert (
        message == f"No space left on device while writing {str(disk / 'ckpt')!r}; the previous checkpoint is intact."
    )
    assert step == "1"
    assert leftovers == ["ckpt"]


def test_a_temporary_is_never_seen_unlocked_while_its_writer_lives(tmp_path: Path) -> None:
    """The guard against removing a temporary that its writer has not locked yet is that it gets its name locked."""
    target = tmp_path / "ckpt.pt"
    live_file = temporaries.temporary_sibling(target)
    live_directory = temporaries.temporary_sibling(target)
    descriptors = [temporaries.create_locked(live_file), temporaries.create_locked(live_directory, directory=True)]
    assert temporaries._is_locked(live_file) and temporaries._is_locked(live_directory)
    stalled = tmp_path / f"{temporaries.CREATING_PREFIX}{'7' * 32}"  # a writer stalled inside create_locked
    stalled.mkdir()
    temporaries.remove_abandoned(target)
    assert live_file.exists() and live_directory.exists() and stalled.exists()
    for descriptor in descriptors:
        temporaries.release_lock(descriptor)
    past_grace = time.time() - 2 * temporaries.LOCK_GRACE
    os.utime(stalled, (past_grace, past_grace))
    temporaries.remove_abandoned(target)
    assert list(tmp_path.iterdir()) == []
