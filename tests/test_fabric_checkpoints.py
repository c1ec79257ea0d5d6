"""Checkpoints: what ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` promise users.

Round trips are bit-exact on local paths and fsspec URLs, a load either succeeds completely or
changes nothing, unreadable or unsafe files raise :class:`CheckpointError`, and a save that fails or
is killed half way never damages the checkpoint already at the path.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.utilities.exceptions import CheckpointError

PRECISION_STATE_KEY = "fabric_precision_state"
#: Where the location-parametrized tests save: a local disk, fsspec's memory filesystem, a real S3 API.
LOCATIONS = ["local", "memory", "s3"]
_roots: dict[str, str] = {}


class Opaque:
    """A user class: arbitrary pickled objects like this must not load with weights_only=True."""

    def __init__(self, payload: int) -> None:
        self.payload = payload


class PickleBombError(Exception):
    pass


class Unpicklable:
    """Makes ``torch.save`` fail part way through pickling the checkpoint."""

    def __reduce__(self) -> Any:
        raise PickleBombError("this object refuses to be pickled")


@pytest.fixture(autouse=True)
def _clean_memory_filesystem() -> Iterator[None]:
    memory = fsspec.filesystem("memory")
    memory.store.clear()
    memory.pseudo_dirs[:] = [""]
    yield
    memory.store.clear()
    memory.pseudo_dirs[:] = [""]


@pytest.fixture(autouse=True)
def _s3_root(request: pytest.FixtureRequest) -> Iterator[None]:
    """For tests run with ``where="s3"``: a new bucket on the test S3 server."""
    if "where" in request.fixturenames and request.getfixturevalue("where") == "s3":
        _roots["s3"] = request.getfixturevalue("s3_bucket") + "/checkpoints"
    yield
    _roots.pop("s3", None)


def _directory(where: str, tmp_path: Path) -> str:
    return {"local": str(tmp_path), "memory": "memory://checkpoints"}.get(where) or _roots[where]


def _file(where: str, tmp_path: Path, name: str = "ckpt.pt") -> str:
    return f"{_directory(where, tmp_path)}/{name}"


def _listdir(directory: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(directory)
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))


def _read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as file:
        return file.read()  # type: ignore[no-any-return]


def _write_bytes(path: str, data: bytes) -> None:
    with fsspec.open(path, "wb") as file:
        file.write(data)


def _net(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _build(fabric: Fabric, seed: int, net: nn.Module | None = None, hidden: int = 8) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    net = net if net is not None else _net(hidden)
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(fabric: Fabric, model: Any, optimizer: Any, scheduler: Any = None, *, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        y = torch.randn(16, 2, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _clone(value: Any) -> Any:
    """A deep copy whose tensors are detached clones (to compare against after a load)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _assert_identical(actual: Any, expected: Any, where: str = "") -> None:
    """Same structure, bit-identical tensors (dtype and shape included), equal everything else."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"tensor differs at {where}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            _assert_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            _assert_identical(left, right, f"{where}[{index}]")
    else:
        assert actual == expected, where


def _snapshot(model: Any, optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return _clone(model.module.state_dict()), _clone(optimizer.state_dict())


def _assert_unchanged(model: Any, optimizer: Any, before: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    _assert_identical(model.module.state_dict(), before[0], "model")
    _assert_identical(optimizer.state_dict(), before[1], "optimizer")


def _trained(fabric: Fabric, seed: int = 0, hidden: int = 8) -> tuple[Any, Any, Any]:
    model, optimizer, scheduler = _build(fabric, seed, hidden=hidden)
    _train(fabric, model, optimizer, scheduler, steps=3, seed=seed + 100)
    return model, optimizer, scheduler


# --- 1. round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", LOCATIONS)
def test_round_trip_is_bit_exact_and_training_resumes_identically(where: str, tmp_path: Path) -> None:
    path = _file(where, tmp_path)
    fabric = Fabric(accelerator="cpu")
    model, optimizer, scheduler = _trained(fabric, seed=0)
    extra = torch.randn(3, 5)
    fabric.save(
        path,
        {"model": model, "optimizer": optimizer, "step": 7, "extra": {"a": extra}, "scheduler": scheduler},
    )

    resumed = Fabric(accelerator="cpu")  # as in a new process
    model2, optimizer2, scheduler2 = _build(resumed, seed=1)
    assert not torch.equal(model2.module[0].weight, model.module[0].weight)  # or the check below proves nothing
    assert scheduler2.state_dict() != scheduler.state_dict()
    state = {"model": model2, "optimizer": optimizer2, "step": 0, "scheduler": scheduler2}
    remainder = resumed.load(path, state)

    assert state["model"] is model2 and state["optimizer"] is optimizer2 and state["scheduler"] is scheduler2
    _assert_identical(model2.module.state_dict(), model.module.state_dict(), "model")
    _assert_identical(dict(model2.named_parameters()), dict(model.named_parameters()), "parameters")
    saved_optimizer, loaded_optimizer = optimizer.state_dict(), optimizer2.state_dict()
    assert len(saved_optimizer["state"]) == 4  # Adam state for each of the four parameters
    _assert_identical(loaded_optimizer, saved_optimizer, "optimizer")
    assert state["step"] == 7
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert set(remainder) == {"extra"}
    _assert_identical(remainder["extra"], {"a": extra}, "extra")

    _train(fabric, model, optimizer, scheduler, steps=4, seed=42)
    _train(resumed, model2, optimizer2, scheduler2, steps=4, seed=42)
    _assert_identical(dict(model2.named_parameters()), dict(model.named_parameters()), "after more steps")
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


# --- 2. raw load ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", LOCATIONS)
def test_load_without_state_returns_the_raw_checkpoint_without_wrapper_prefixes(where: str, tmp_path: Path) -> None:
    path = _file(where, tmp_path)
    fabric = Fabric(accelerator="cpu")
    model, optimizer, _ = _trained(fabric)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})

    raw = fabric.load(path)

    assert set(raw) == {"model", "optimizer", "step"}
    assert list(raw["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _assert_identical(raw["model"], model.module.state_dict(), "model")
    _assert_identical(raw["optimizer"], optimizer.state_dict(), "optimizer")
    assert raw["step"] == 3
    plain = _net()  # the model state dict loads into plain PyTorch, no Fabric needed
    plain.load_state_dict(raw["model"])
    assert torch.equal(plain[2].bias, model.module[2].bias)


# --- 3. strict ----------------------------------------------------------------------------------------


def test_requesting_an_absent_entry_raises_unless_strict_is_false(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    fabric = Fabric(accelerator="cpu")
    model, optimizer, _ = _trained(fabric)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})

    model2, optimizer2, _ = _build(fabric, seed=1)
    before = _snapshot(model2, optimizer2)
    state = {"model": model2, "optimizer": optimizer2, "epoch": 11}
    with pytest.raises(CheckpointError, match="epoch"):
        fabric.load(path, state)
    _assert_unchanged(model2, optimizer2, before)
    assert state["epoch"] == 11

    remainder = fabric.load(path, state, strict=False)
    _assert_identical(model2.module.state_dict(), model.module.state_dict(), "model")
    _assert_identical(optimizer2.state_dict(), optimizer.state_dict(), "optimizer")
    assert state["epoch"] == 11
    assert remainder == {"step": 3}


# --- 4. a failed load changes nothing -----------------------------------------------------------------


def _renamed_net() -> nn.Module:
    """Same shapes and parameter count as ``_net()``, different keys."""
    return nn.Sequential(
        collections.OrderedDict(encoder=nn.Linear(4, 8), act=nn.ReLU(), head=nn.Linear(8, 2)),
    )


@pytest.mark.parametrize(
    ("other_net", "offending_key"),
    [
        # The optimizer entry comes before the model in ``state``, so its moments' shapes are the first misfit.
        pytest.param(lambda: _net(hidden=16), "exp_avg", id="different-shapes"),
        pytest.param(_renamed_net, "2.weight", id="missing-keys"),
    ],
)
def test_a_checkpoint_that_does_not_fit_changes_nothing(other_net: Any, offending_key: str, tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    fabric = Fabric(accelerator="cpu")
    # The source has as many parameters as the target: only shapes tell the optimizer states apart.
    source, source_optimizer, _ = _build(fabric, seed=5, net=other_net())
    _train(fabric, source, source_optimizer, steps=2, seed=6)
    fabric.save(path, {"step": 99, "optimizer": source_optimizer, "model": source})

    model, optimizer, _ = _trained(fabric, seed=0)
    before = _snapshot(model, optimizer)
    # Entries that would load fine come first: nothing may be applied before everything is checked.
    state = {"step": 5, "optimizer": optimizer, "model": model}
    with pytest.raises(CheckpointError, match=re.escape(repr(offending_key))):
        fabric.load(path, state)

    _assert_unchanged(model, optimizer, before)
    assert state["step"] == 5
    _train(fabric, model, optimizer, steps=1, seed=7)  # and the objects still work


# --- 5. unreadable files ------------------------------------------------------------------------------


def _corrupt(kind: str, where: str, tmp_path: Path, fabric: Fabric, model: Any, optimizer: Any) -> str:
    if kind == "missing":
        return _file(where, tmp_path, "nowhere.pt")
    if kind == "directory":
        path = _file(where, tmp_path, "a-directory")
        fs, target = fsspec.core.url_to_fs(path)
        fs.makedirs(target)
        _write_bytes(f"{path}/inside.txt", b"x")
        return path
    path = _file(where, tmp_path, f"{kind}.pt")
    if kind == "truncated":
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
        data = _read_bytes(path)
        _write_bytes(path, data[: len(data) // 2])
    else:
        data = random.Random(0).randbytes(4096)
        assert not data.startswith((b"PK", b"\x80"))  # neither a zip archive nor a pickle
        _write_bytes(path, data)
    return path


@pytest.mark.parametrize("where", LOCATIONS)
@pytest.mark.parametrize("kind", ["missing", "truncated", "random-bytes", "directory"])
def test_unreadable_checkpoints_raise_and_change_nothing(kind: str, where: str, tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model, optimizer, _ = _trained(fabric)
    path = _corrupt(kind, where, tmp_path, fabric, model, optimizer)
    before = _snapshot(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}

    with pytest.raises(CheckpointError) as error:
        fabric.load(path, state)

    message = str(error.value)
    if kind == "missing":
        assert "nowhere.pt" in message
        assert isinstance(error.value, FileNotFoundError)  # what code catching a missing file expects
    if kind == "random-bytes":  # garbage is not a reason to advise unsafe loading
        assert "weights_only=False" not in message
    _assert_unchanged(model, optimizer, before)
    assert state["step"] == 0
    with pytest.raises(CheckpointError):
        fabric.load(path)


@pytest.mark.parametrize("text", ["hello, this is a note", "the weights are elsewhere", "see README"])
def test_a_text_file_is_a_checkpoint_error(text: str, tmp_path: Path) -> None:
    """Text starting with "h", "t" or "s" reached torch's legacy reader, which raised a raw KeyError or IndexError."""
    path = tmp_path / "notes.pt"
    path.write_text(text)
    with pytest.raises(CheckpointError, match=r"notes\.pt.* is not a readable checkpoint"):
        Fabric(accelerator="cpu").load(path)


# --- 6. safe loading by default -----------------------------------------------------------------------


def test_arbitrary_pickled_objects_are_refused_unless_weights_only_is_false(tmp_path: Path) -> None:
    path = tmp_path / "pickled.pt"
    torch.save({"weights": torch.arange(4.0), "obj": Opaque(123)}, path)
    fabric = Fabric(accelerator="cpu")

    with pytest.raises(CheckpointError, match="weights_only=False") as error:
        fabric.load(path)
    assert "Opaque" in str(error.value)  # says what was refused
    with pytest.raises(CheckpointError, match="weights_only=False"):
        fabric.load(path, {"weights": None})

    raw = fabric.load(path, weights_only=False)
    assert isinstance(raw["obj"], Opaque) and raw["obj"].payload == 123
    assert torch.equal(raw["weights"], torch.arange(4.0))


# --- 7. atomic saves ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", LOCATIONS)
def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(where: str, tmp_path: Path) -> None:
    directory = _directory(where, tmp_path)
    path = _file(where, tmp_path)
    fabric = Fabric(accelerator="cpu")
    old = {"step": 1, "weights": torch.randn(64, 64)}
    fabric.save(path, old)
    assert _listdir(directory) == ["ckpt.pt"]

    big = [torch.full((1 << 20,), float(index)) for index in range(8)]  # 32 MB ahead of the failure
    with pytest.raises(PickleBombError):
        fabric.save(path, {"step": 2, "big": big, "bomb": Unpicklable()})

    assert _listdir(directory) == ["ckpt.pt"]
    _assert_identical(fabric.load(path), old)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys

    import torch

    from fabric import Fabric

    fabric = Fabric(accelerator="cpu")
    tensors = [torch.full((4 << 20,), 2.0) for _ in range(10)]  # 160 MB: a save takes a while
    for step in range(1, 1_000_000):  # overwrite the same checkpoint until killed
        fabric.save(sys.argv[1], {"step": step, "tensors": tensors})
        print(step, flush=True)
    """
)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    original = {"step": 0, "tensors": [torch.full((1000,), 1.0) for _ in range(10)]}
    Fabric(accelerator="cpu").save(path, original)

    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _partial_temporary_file(tmp_path):
            if child.poll() is not None:
                pytest.fail(f"The writer exited early ({child.returncode}): {child.stderr.read()}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                pytest.fail("No partly written temporary checkpoint appeared next to the target within 60 s.")
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        stdout, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == -signal.SIGKILL

    loaded = Fabric(accelerator="cpu").load(path)
    completed = [int(line) for line in stdout.split()]
    if not completed:  # the usual case: killed during the very first save
        _assert_identical(loaded, original)
    else:  # the parent was too slow to catch the first save; the file must still be one whole save
        assert loaded["step"] in (completed[-1], completed[-1] + 1)
        _assert_identical(loaded["tensors"], [torch.full((4 << 20,), 2.0) for _ in range(10)])

    # The killed save left its temporary file, unlocked: the next save of the same checkpoint removes it.
    assert _partial_temporary_file(tmp_path)
    Fabric(accelerator="cpu").save(path, {"step": 3})
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["ckpt.pt"]


def _partial_temporary_file(directory: Path) -> bool:
    for entry in directory.iterdir():
        if entry.name.startswith(".") and ".tmp-" in entry.name:
            try:
                if entry.stat().st_size > 0:
                    return True
            except FileNotFoundError:  # renamed into place in the meantime
                continue
    return False


# --- 8. bare state dicts ------------------------------------------------------------------------------


def test_load_raw_loads_a_plain_state_dict_and_refuses_one_that_does_not_fit(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    torch.manual_seed(3)
    source = _net()
    torch.save(source.state_dict(), tmp_path / "plain.pt")
    torch.save(_net(hidden=16).state_dict(), tmp_path / "wrong.pt")

    model, optimizer, _ = _trained(fabric, seed=0)
    assert not torch.equal(model.module[0].weight, source[0].weight)
    fabric.load_raw(tmp_path / "plain.pt", model)
    _assert_identical(model.module.state_dict(), source.state_dict(), "model")

    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=re.escape("'0.weight'")):
        fabric.load_raw(tmp_path / "wrong.pt", model)
    _assert_unchanged(model, optimizer, before)


# --- 9. precision state -------------------------------------------------------------------------------


def test_the_grad_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    model, optimizer, _ = _build(fabric, seed=0)
    fabric.backward(model(torch.randn(2, 4)).sum() * float("inf"))  # an overflow: step skipped, scale backs off
    optimizer.step()
    optimizer.zero_grad()
    _train(fabric, model, optimizer, steps=2, seed=1)
    scaler_state = fabric.precision.scaler.state_dict()  # type: ignore[attr-defined]
    initial_scale = Fabric(accelerator="cpu", precision="16-mixed").precision.scaler.get_scale()  # type: ignore[attr-defined]
    assert fabric.precision.scaler.get_scale() < initial_scale  # type: ignore[attr-defined]
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})

    assert Fabric(accelerator="cpu").load(path)[PRECISION_STATE_KEY] == {"scaler": scaler_state}

    resumed = Fabric(accelerator="cpu", precision="16-mixed")
    model2, optimizer2, _ = _build(resumed, seed=1)
    remainder = resumed.load(path, {"model": model2, "optimizer": optimizer2})
    assert resumed.precision.scaler.get_scale() == fabric.precision.scaler.get_scale()  # type: ignore[attr-defined]
    assert resumed.precision.scaler.state_dict() == scaler_state  # type: ignore[attr-defined]
    assert remainder == {"step": 2}


# --- modules the validation must not reject -----------------------------------------------------------


class Counting(nn.Linear):
    """Keeps non-tensor state in the state dict through ``get_extra_state``."""

    def __init__(self) -> None:
        super().__init__(4, 2)
        self.calls = 0

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def test_modules_with_extra_state_round_trip(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(Counting())
    model.module.calls = 5
    fabric.save(tmp_path / "ckpt.pt", {"model": model})

    model2 = fabric.setup(Counting())
    fabric.load(tmp_path / "ckpt.pt", {"model": model2})
    assert model2.module.calls == 5
    assert torch.equal(model2.module.weight, model.module.weight)


def test_lazy_modules_take_their_shapes_from_the_checkpoint(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(3, 4))
    fabric.save(tmp_path / "ckpt.pt", {"model": model})

    lazy = fabric.setup(nn.LazyLinear(4))
    fabric.load(tmp_path / "ckpt.pt", {"model": lazy})
    assert torch.equal(lazy.module.weight, model.module.weight)
    assert torch.equal(lazy(torch.ones(1, 3)), model(torch.ones(1, 3)))


def test_optimizer_state_of_another_width_is_refused_on_its_own(tmp_path: Path) -> None:
    path = tmp_path / "wide.pt"
    fabric = Fabric(accelerator="cpu")
    _, wide_optimizer, _ = _trained(fabric, seed=1, hidden=16)
    fabric.save(path, {"optimizer": wide_optimizer})
    model, optimizer, _ = _trained(fabric, seed=0)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=r"'exp_avg' of parameter 0 has shape \(16, 4\)"):
        fabric.load(path, {"optimizer": optimizer})
    _assert_unchanged(model, optimizer, before)


class Fragile:
    """A user object whose ``load_state_dict`` rejects what it is given."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["value"] < 0:
            raise ValueError("value must not be negative")
        self.value = state_dict["value"]


def test_an_object_that_fails_to_load_rolls_back_everything_before_it(tmp_path: Path) -> None:
    path = tmp_path / "fragile.pt"
    fabric = Fabric(accelerator="cpu")
    model, _, _ = _trained(fabric, seed=0)
    fabric.save(path, {"scheduler": {"last_epoch": 50}, "good": {"value": 3}, "bad": {"value": -1}, "model": model})
    fresh_model, fresh_optimizer, fresh_scheduler = _trained(fabric, seed=1)
    before = _snapshot(fresh_model, fresh_optimizer)
    scheduler_before = fresh_scheduler.state_dict()
    good, bad = Fragile(), Fragile()
    state = {"scheduler": fresh_scheduler, "good": good, "bad": bad, "model": fresh_model}
    with pytest.raises(CheckpointError, match=r"Entry 'bad' .* could not be loaded into Fragile: ValueError"):
        fabric.load(path, state)
    assert good.value == 0 and bad.value == 0
    assert fresh_scheduler.state_dict() == scheduler_before
    _assert_unchanged(fresh_model, fresh_optimizer, before)


def test_a_broken_grad_scaler_entry_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "scaler.pt"
    torch.save({"fabric_precision_state": {"scaler": {"scale": 1.0}}, "step": 1}, path)
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    scale_before = fabric.precision.scaler.get_scale()  # type: ignore[attr-defined]
    state = {"step": 0}
    with pytest.raises(CheckpointError, match=r"'fabric_precision_state'.*MixedPrecision"):
        fabric.load(path, state)
    assert fabric.precision.scaler.get_scale() == scale_before  # type: ignore[attr-defined]
    assert state["step"] == 0


def test_a_save_to_a_bucket_that_does_not_exist_names_it_and_never_creates_it(s3_bucket: str) -> None:
    """s3fs's makedirs created the misspelled bucket, and the checkpoint went there."""
    import s3fs

    missing = f"{s3_bucket}-typo"
    with pytest.raises(CheckpointError, match=rf"the bucket '{missing[len('s3://') :]}' does not exist"):
        Fabric(accelerator="cpu").save(f"{missing}/run/last.pt", {"step": 1})
    s3fs.S3FileSystem.clear_instance_cache()
    assert not fsspec.filesystem("s3").exists(missing)
