"""``fabric.save(..., async_save=True)``: training goes on while a snapshot is written; one save in flight;
its error is never lost. And ``storage_options`` for object stores that the environment does not describe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from object_store import S3Server
from torch import nn

from fabric import Fabric
from fabric.plugins.io import TorchCheckpointIO
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.utilities.exceptions import CheckpointError

JOB = str(Path(__file__).parents[2] / "scripts" / "async_save_job.py")
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


class GatedIO(TorchCheckpointIO):
    """Writes only once ``gate`` is set, and fails when ``fail`` is set: a slow or broken storage."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail: BaseException | None = None
        self.writes: list[str] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathType, storage_options: StorageOptions = None
    ) -> None:
        self.gate.wait(timeout=60)
        if self.fail is not None:
            raise self.fail
        super().save_checkpoint(checkpoint, path, storage_options)
        self.writes.append(str(path))

    def load_checkpoint(
        self, path: PathType, *, weights_only: bool = True, storage_options: StorageOptions = None
    ) -> Any:
        self.writes.append(f"read {path}")
        return super().load_checkpoint(path, weights_only=weights_only, storage_options=storage_options)


def _setup(io: GatedIO) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", plugins=[io])
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters()))
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return fabric, model, optimizer


def test_an_async_save_writes_the_state_of_the_moment_it_was_asked_for(tmp_path: Path) -> None:
    io = GatedIO()
    fabric, model, optimizer = _setup(io)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    written = fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 1}, async_save=True)

    assert not written.done() and not (tmp_path / "ckpt.pt").exists()  # returned while the write waits
    with torch.no_grad():  # training goes on and changes the weights in place
        for parameter in model.parameters():
            parameter.add_(1.0)
    io.gate.set()
    written.result()

    loaded = fabric.load(tmp_path / "ckpt.pt")
    assert loaded["step"] == 1
    for name, value in before.items():
        assert torch.equal(loaded["model"][name], value)
    assert [entry.name for entry in tmp_path.iterdir()] == ["ckpt.pt"]


def test_the_next_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    io = GatedIO()
    fabric, model, _ = _setup(io)
    first = fabric.save(tmp_path / "first.pt", {"model": model}, async_save=True)
    io.gate.set()
    second = fabric.save(tmp_path / "second.pt", {"model": model}, async_save=True)
    assert first.done()  # the second save started only once the first was complete
    second.result()
    assert io.writes == [str(tmp_path / "first.pt"), str(tmp_path / "second.pt")]


def test_a_failed_background_save_is_reported_at_once_and_raised_at_the_next_save_and_load(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    io = GatedIO()
    fabric, model, _ = _setup(io)
    good = fabric.save(tmp_path / "good.pt", {"model": model, "step": 0}, async_save=True)
    io.gate.set()
    good.result()
    io.fail = CheckpointError("the bucket refused the upload")
    written = fabric.save(tmp_path / "bad.pt", {"model": model, "step": 1}, async_save=True)
    assert isinstance(written.exception(timeout=60), CheckpointError)
    reported = capfd.readouterr().err  # at once, though the job may never save again
    assert "the background save of" in reported and "bad.pt" in reported and "bucket refused" in reported

    with pytest.raises(CheckpointError, match="the bucket refused the upload"):
        fabric.save(tmp_path / "next.pt", {"model": model, "step": 2})
    io.fail = None
    fabric.save(tmp_path / "next.pt", {"model": model, "step": 2})  # raised once; storage works again
    assert fabric.load(tmp_path / "good.pt")["step"] == 0
    assert not (tmp_path / "bad.pt").exists()


def test_a_load_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    io = GatedIO()
    fabric, model, _ = _setup(io)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "step": 5}, async_save=True)
    threading.Timer(0.05, io.gate.set).start()  # opens the gate while the load (which must wait) is blocked
    assert fabric.load(tmp_path / "ckpt.pt")["step"] == 5
    assert io.writes == [str(tmp_path / "ckpt.pt"), f"read {tmp_path / 'ckpt.pt'}"]


def test_storage_options_reach_an_s3_api_the_environment_does_not_name(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fabric.save/load took no storage options: an S3-compatible store's endpoint and credentials could only
    come from environment variables."""
    import s3fs

    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    s3fs.S3FileSystem.clear_instance_cache()
    fabric = Fabric(accelerator="cpu")
    options = s3_server.storage_options()
    path = f"{s3_bucket}/ckpt.pt"
    fabric.save(path, {"step": 3, "weights": torch.arange(4.0)}, storage_options=options)
    loaded = fabric.load(path, storage_options=options)
    assert loaded["step"] == 3 and torch.equal(loaded["weights"], torch.arange(4.0))
    target = nn.Linear(2, 2)
    fabric.save(f"{s3_bucket}/raw.pt", target.state_dict(), storage_options=options)
    fabric.load_raw(f"{s3_bucket}/raw.pt", nn.Linear(2, 2), storage_options=options)


def test_an_async_save_snapshots_every_mutable_value_not_only_tensors(tmp_path: Path) -> None:
    """A NumPy array changed in place right after ``async_save=True`` was written with its new values."""
    io = GatedIO()
    fabric, model, _ = _setup(io)
    counts, history = np.zeros(3), [1.0, 2.0]
    written = fabric.save(
        tmp_path / "ckpt.pt", {"model": model, "counts": counts, "history": history, "meta": {"seen": counts}},
        async_save=True,
    )  # fmt: skip
    counts += 5  # training goes on, in place
    history.append(3.0)
    io.gate.set()
    written.result()
    loaded = fabric.load(tmp_path / "ckpt.pt", weights_only=False)
    assert loaded["counts"].tolist() == [0.0, 0.0, 0.0] and loaded["history"] == [1.0, 2.0]
    assert loaded["meta"]["seen"].tolist() == [0.0, 0.0, 0.0]


def test_an_async_save_of_an_object_that_cannot_be_copied_is_refused_naming_its_entry(tmp_path: Path) -> None:
    io = GatedIO()
    io.gate.set()
    fabric, model, _ = _setup(io)
    with pytest.raises(CheckpointError, match=r"state\['lock'\] \(a lock\) cannot be copied.*without async_save"):
        fabric.save(tmp_path / "ckpt.pt", {"model": model, "lock": threading.Lock()}, async_save=True)
    assert not (tmp_path / "ckpt.pt").exists()


def _job(scenario: str, out_dir: Path, devices: int) -> subprocess.CompletedProcess[str]:
    out_dir.mkdir(exist_ok=True)
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    command = [sys.executable, JOB, scenario, str(out_dir), str(devices)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)


def test_every_ddp_ranks_future_completes_only_with_rank_zeros_write_and_its_load_reads_it(tmp_path: Path) -> None:
    """Only rank 0 writes under DDP; rank 1's future completed at once and its load read the previous checkpoint."""
    job = _job("seen", tmp_path, devices=2)
    assert job.returncode == 0, job.stderr
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports == [{"done_before_the_write": False, "step": 2}] * 2


@pytest.mark.parametrize("devices", [1, 2])
def test_a_script_whose_last_async_save_failed_exits_non_zero(tmp_path: Path, devices: int) -> None:
    """The script ends normally after its last save; that save failed (a full disk): a scheduler must not see 0."""
    job = _job("last_fails", tmp_path, devices=devices)
    assert job.returncode == 1, job.stderr
    assert "script done" in job.stdout
    assert "No space left on device" in job.stderr and "last.ckpt" in job.stderr
    assert job.stderr.count("exiting with code 1: the last background save failed") == devices
    if devices == 2:
        assert "rank 0, which writes" in job.stderr  # rank 1 heard of rank 0's failure
    assert not (tmp_path / "last.ckpt").exists()
