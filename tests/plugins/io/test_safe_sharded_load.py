"""Loading a sharded (DCP) checkpoint directory runs no code from it unless ``weights_only=False``.

Each crafted directory carries a payload that, if unpickled the unsafe way, creates a marker file: the
tests assert the marker never appears and the error names the entry that held it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from scripts.marker_payload import MarkerPayload
from torch import nn

from fabric import Fabric
from fabric.plugins.io.distributed_checkpoint import load_shards, read_whole, write_shards
from fabric.utilities.exceptions import CheckpointError

ROOT = Path(__file__).resolve().parents[3]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _checkpoint(directory: Path, step: Any) -> None:
    write_shards({"model": _model().state_dict(), "step": step, "rng": b"blob"}, directory)


def _payload_in_entry(tmp_path: Path) -> tuple[Path, Path]:
    directory, marker = tmp_path / "checkpoint", tmp_path / "marker"
    _checkpoint(directory, MarkerPayload(marker))
    return directory, marker


def _payload_in_metadata(tmp_path: Path) -> tuple[Path, Path]:
    directory, marker = tmp_path / "checkpoint", tmp_path / "marker"
    _checkpoint(directory, 5)
    metadata_file = directory / ".metadata"
    with metadata_file.open("rb") as file:
        metadata = pickle.load(file)  # our own, just written
    metadata.storage_meta.modules = [MarkerPayload(marker)]
    with metadata_file.open("wb") as file:
        pickle.dump(metadata, file)
    return directory, marker


def _fabric_load_into_state(directory: Path) -> None:
    Fabric(accelerator="cpu", devices=1).load(directory, {"model": _model(), "step": 0})


def _fabric_load_raw(directory: Path) -> None:
    Fabric(accelerator="cpu", devices=1).load(directory)


def _sharded_load(directory: Path) -> None:
    """What every rank of an FSDP job does: fill the given state from the shards."""
    load_shards({"model": _model().state_dict(), "step": 0}, directory)


def _consolidate(directory: Path) -> None:
    output = directory.parent / "out.pt"
    result = subprocess.run(
        [sys.executable, "-m", "fabric_cli", "consolidate", str(directory), str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 1 and not output.exists()
    assert "Traceback" not in result.stderr  # one clear line, not a crash
    raise CheckpointError(result.stderr)


LOADERS: dict[str, Callable[[Path], None]] = {
    "fabric.load(dir, state)": _fabric_load_into_state,
    "fabric.load(dir)": _fabric_load_raw,
    "sharded load": _sharded_load,
    "fabric consolidate": _consolidate,
}
PAYLOADS = {"entry": (_payload_in_entry, "entry 'step'"), "metadata": (_payload_in_metadata, "entry '.metadata'")}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("where", PAYLOADS)
def test_a_payload_in_a_sharded_checkpoint_is_refused_naming_the_entry(where: str, loader: str, tmp_path: Path) -> None:
    make, entry = PAYLOADS[where]
    directory, marker = make(tmp_path)
    with pytest.raises(CheckpointError) as error:
        LOADERS[loader](directory)
    assert entry in str(error.value)
    assert "weights_only=False" in str(error.value)  # the way out, for a trusted checkpoint
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("make", [_payload_in_entry, _payload_in_metadata])
def test_the_payload_is_real_it_runs_when_the_user_opts_out(make: Callable[..., Any], tmp_path: Path) -> None:
    directory, marker = make(tmp_path)
    Fabric(accelerator="cpu", devices=1).load(directory, weights_only=False)
    assert marker.exists()


def test_a_legitimate_sharded_checkpoint_loads_whole_with_its_values(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoint", {"step": 5, "epochs": [1, 2.5, "x", None]})
    loaded = read_whole(tmp_path / "checkpoint")
    assert loaded["step"] == {"step": 5, "epochs": [1, 2.5, "x", None]} and loaded["rng"] == b"blob"
    assert torch.equal(loaded["model"]["weight"], _model().weight.detach())


def test_metadata_naming_a_file_outside_the_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoint"
    _checkpoint(directory, 5)
    with (directory / ".metadata").open("rb") as file:
        metadata = pickle.load(file)
    for info in metadata.storage_data.values():
        info.relative_path = os.path.join("..", "elsewhere.distcp")
    with (directory / ".metadata").open("wb") as file:
        pickle.dump(metadata, file)
    with pytest.raises(CheckpointError, match=r"storage file .*elsewhere.distcp.* not inside the checkpoint"):
        read_whole(directory)


class _ForgedPath:
    """Pickles as a ``PosixPath`` whose cached string (``str()``) is ``shown`` while it joins as ``real``."""

    def __init__(self, real: str, shown: str) -> None:
        self.real, self.shown = real, shown

    def __reduce__(self) -> tuple[Any, ...]:
        return PosixPath, (self.real,), (None, {"_str": self.shown})


def test_a_storage_file_that_is_a_path_object_pointing_elsewhere_is_refused(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "other", {"secret": 1})  # another checkpoint, of the same layout
    directory = tmp_path / "checkpoint"
    _checkpoint(directory, 5)
    with (directory / ".metadata").open("rb") as file:
        metadata = pickle.load(file)
    for info in metadata.storage_data.values():
        info.relative_path = _ForgedPath(f"../other/{info.relative_path}", shown=info.relative_path)
    with (directory / ".metadata").open("wb") as file:
        pickle.dump(metadata, file)

    with pytest.raises(CheckpointError) as error:
        Fabric(accelerator="cpu", devices=1).load(directory)
    assert "entry '.metadata' names the storage file" in str(error.value)
    assert "is a PosixPath, not a str" in str(error.value)


@pytest.mark.parametrize("name", ["", "a\0b", "/abs/__0_0.distcp", "sub/../../x.distcp", "..\\x.distcp", "C:x.distcp"])
def test_a_storage_file_name_outside_the_directory_or_malformed_is_refused(name: str, tmp_path: Path) -> None:
    directory = tmp_path / "checkpoint"
    _checkpoint(directory, 5)
    with (directory / ".metadata").open("rb") as file:
        metadata = pickle.load(file)
    for info in metadata.storage_data.values():
        info.relative_path = name
    with (directory / ".metadata").open("wb") as file:
        pickle.dump(metadata, file)
    with pytest.raises(CheckpointError, match=r"names the storage file .*must be a plain relative file name"):
        read_whole(directory)
