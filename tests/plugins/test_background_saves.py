"""``fabric.save(..., async_save=True)``: training goes on while a snapshot is written; one save in flight;
its error is never lost. And ``storage_options`` for object stores that the environment does not describe."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from object_store import S3Server
from torch import nn

from fabric import Fabric
from fabric.plugins.io import TorchCheckpointIO
from fabric.plugins.io.checkpoint_io import PathType, StorageOptions
from fabric.utilities.exceptions import CheckpointError


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
