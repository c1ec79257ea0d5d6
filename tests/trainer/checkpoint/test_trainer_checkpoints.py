"""Trainer checkpoints: bit-exact resume (end of epoch, mid-epoch), autoresume, retention, latest, remote, errors."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from fabric.plugins.io.distributed_checkpoint import write_shards
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import State
from fabric.trainer.schedulers import LinearWithWarmupScheduler
from fabric.trainer.trainer import Trainer
from fabric.utilities.exceptions import CheckpointError

SCRIPTS = Path(__file__).parents[2] / "scripts"
Batch = tuple[torch.Tensor, torch.Tensor]


class DropoutNet(nn.Module):
    """Dropout makes the result depend on the RNG state, so an exact resume needs it restored."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


class CountBatches(Callback):
    """A stateful callback: its count must resume with the trainer."""

    def __init__(self) -> None:
        self.count = 0

    def batch_end(self, state: State, logger: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]


class StopAt(Callback):
    """Ends training after ``batch`` batches, like a crash would, but with max_duration (and the schedule) intact."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state: State, logger: Any) -> None:
        if int(state.timestamp.batch) == self.batch:
            state.stop_training()


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _trainer(initial: nn.Module, **kwargs: Any) -> Trainer:
    model = copy.deepcopy(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    options: dict[str, Any] = {
        "train_dataloader": DataLoader(_data(), batch_size=8, shuffle=True),  # 6 batches per epoch
        "max_duration": "10ba",
        "optimizers": optimizer,
        "schedulers": LinearWithWarmupScheduler(t_warmup="3ba"),
        "callbacks": [CountBatches(), CountBatches()],
        "progress_bar": False,
        "seed": 7,
        "accelerator": "cpu",
    }
    options.update(kwargs)
    return Trainer(model=model, **options)


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.state.model.parameters()]


@pytest.fixture(scope="module")
def initial() -> nn.Module:
    torch.manual_seed(0)
    return DropoutNet()


@pytest.fixture(scope="module")
def uninterrupted(initial: nn.Module) -> list[torch.Tensor]:
    trainer = _trainer(initial)
    trainer.fit()
    return _weights(trainer)


@pytest.mark.parametrize("stop_at", [4, 6, 7])  # mid-epoch, end of epoch 1, one batch into epoch 2
def test_resume_gives_bit_identical_weights(
    tmp_path: Path, initial: nn.Module, uninterrupted: list[torch.Tensor], stop_at: int
) -> None:
    callbacks = [CountBatches(), CountBatches(), StopAt(stop_at)]
    first = _trainer(initial, callbacks=callbacks, save_folder=str(tmp_path), save_interval="1000ba")
    first.fit()  # saves at the end of training
    (checkpoint,) = first.saver.saved  # type: ignore[union-attr]
    torch.manual_seed(12345)  # a new process: whatever RNG state it happens to have
    resumed = _trainer(initial, load_path=checkpoint)
    assert int(resumed.state.timestamp.batch) == stop_at
    assert [callback.count for callback in resumed.state.callbacks[:2]] == [stop_at, stop_at]
    resumed.fit()
    for ours, reference in zip(_weights(resumed), uninterrupted, strict=True):
        assert torch.equal(ours, reference)
    assert int(resumed.state.timestamp.sample) == 10 * 8


def test_autoresume_picks_the_newest_complete_checkpoint(tmp_path: Path, initial: nn.Module) -> None:
    first = _trainer(initial, max_duration="5ba", save_folder=str(tmp_path / "{run_name}"), save_interval="1ba")
    first.fit()
    folder = tmp_path / first.run_name
    assert sorted(os.listdir(folder)) == sorted([*(f"ep0-ba{n}-rank0.pt" for n in range(1, 6)), "latest-rank0.pt"])
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5-rank0.pt"
    (folder / ".ep1-ba9-rank0.pt.tmp-999").write_bytes(b"half a checkpoint")  # an interrupted save
    resumed = _trainer(
        initial, save_folder=str(tmp_path / "{run_name}"), run_name=first.run_name, autoresume=True, save_interval="1ba"
    )
    assert int(resumed.state.timestamp.batch) == 5


def test_autoresume_without_a_checkpoint_starts_from_load_path_or_scratch(tmp_path: Path, initial: nn.Module) -> None:
    trainer = _trainer(initial, save_folder=str(tmp_path), run_name="fresh", autoresume=True)
    assert int(trainer.state.timestamp.batch) == 0
    with pytest.raises(ValueError, match="autoresume=True needs save_folder and run_name"):
        _trainer(initial, save_folder=str(tmp_path), autoresume=True)


def test_retention_keeps_the_newest_and_prunes_what_an_earlier_run_left(tmp_path: Path, initial: nn.Module) -> None:
    first = _trainer(initial, max_duration="4ba", save_folder=str(tmp_path), run_name="job", save_interval="1ba")
    first.fit()
    assert len([name for name in os.listdir(tmp_path) if name.startswith("ep")]) == 4
    second = _trainer(
        initial,
        max_duration="7ba",
        save_folder=str(tmp_path),
        run_name="job",
        save_interval="1ba",
        save_num_checkpoints_to_keep=2,
        autoresume=True,
    )
    second.fit()
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("ep")) == [
        "ep0-ba6-rank0.pt",
        "ep1-ba7-rank0.pt",
    ]
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ep1-ba7-rank0.pt"


def test_save_overwrite_is_refused_unless_asked(tmp_path: Path, initial: nn.Module) -> None:
    _trainer(initial, max_duration="2ba", save_folder=str(tmp_path), run_name="a", save_interval="2ba").fit()
    with pytest.raises(FileExistsError, match="save_overwrite=True"):
        _trainer(initial, max_duration="2ba", save_folder=str(tmp_path), run_name="a", save_interval="2ba").fit()
    again = _trainer(
        initial, max_duration="2ba", save_folder=str(tmp_path), run_name="a", save_interval="2ba", save_overwrite=True
    )
    again.fit()


def test_memory_filesystem_round_trip_with_background_upload(
    initial: nn.Module, uninterrupted: list[torch.Tensor]
) -> None:
    first = _trainer(initial, max_duration="4ba", save_folder="memory://ckpts/{run_name}", save_interval="2ba")
    first.fit()
    first.close()
    fs = fsspec.filesystem("memory")
    names = sorted(path.rsplit("/", 1)[-1] for path in fs.ls(f"/ckpts/{first.run_name}", detail=False))
    assert names == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt", "latest-rank0.pt.symlink"]
    assert fs.cat(f"/ckpts/{first.run_name}/latest-rank0.pt.symlink") == b"ep0-ba4-rank0.pt"
    resumed = _trainer(
        initial, save_folder="memory://ckpts/{run_name}", run_name=first.run_name, autoresume=True, save_interval="2ba"
    )
    resumed.fit()
    for ours, reference in zip(_weights(resumed), uninterrupted, strict=True):
        assert torch.equal(ours, reference)


class InReplicaGroup(SingleDeviceStrategy):
    """One process as replica group ``group`` of a fault-tolerant run (the groups' checkpoints differ: each holds the
    group's own data position)."""

    def __init__(self, group: int) -> None:
        super().__init__(device=torch.device("cpu"))
        self.group = group

    @property
    @override
    def replica_group(self) -> int:
        return self.group


@pytest.mark.parametrize("root", ["local", "memory://shared-by-groups"])
def test_replica_groups_sharing_a_save_folder_are_refused_before_training_and_a_group_may_come_back(
    tmp_path: Path, initial: nn.Module, root: str
) -> None:
    """Group 1 saving where group 0 saves would overwrite group 0's checkpoints (the same names, another data
    position): it stops at fit's start naming the folder and both groups, before any batch; group 0's files stay as
    they were, and group 0 started again in its folder autoresumes from them."""
    folder = str(tmp_path / "shared") if root == "local" else f"{root}/{tmp_path.name}"
    options: dict[str, Any] = {"save_folder": folder, "save_interval": "2ba", "run_name": "run", "max_duration": "4ba"}
    first = _trainer(initial, strategy=InReplicaGroup(0), **options)
    first.fit()
    first.close()
    fs, path = fsspec.core.url_to_fs(folder)
    before = {name: fs.cat(name) for name in fs.find(path) if not name.endswith(".symlink")}
    other = _trainer(initial, strategy=InReplicaGroup(1), **options)
    with pytest.raises(CheckpointError, match=r"is replica group 1's and also group\(s\) \[0\]'s") as error:
        other.fit()
    other.close()
    assert repr(folder) in str(error.value) and "its own folder" in str(error.value)
    assert int(other.state.timestamp.batch) == 0, "refused before any batch trained"
    after = {name: fs.cat(name) for name in fs.find(path) if not name.endswith(".symlink")}
    assert after == before, "group 0's checkpoints untouched, and group 1 left no mark"
    back = _trainer(initial, strategy=InReplicaGroup(0), autoresume=True, **{**options, "max_duration": "6ba"})
    assert int(back.state.timestamp.batch) == 4
    back.fit()
    assert int(back.state.timestamp.batch) == 6


def test_a_replica_group_that_cannot_mark_its_folder_stops_with_a_checkpoint_error(
    tmp_path: Path, initial: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error of the filesystem while marking becomes the CheckpointError every rank raises (on rank 0 alone it
    would leave the others waiting in the broadcast)."""
    from fabric.trainer.checkpoint.storage import Folder

    def refuse(folder: Folder, group: int) -> list[int]:
        raise PermissionError("read-only bucket policy")

    monkeypatch.setattr(Folder, "claim_for_replica_group", refuse)
    trainer = _trainer(initial, strategy=InReplicaGroup(0), save_folder=str(tmp_path), max_duration="2ba")
    with pytest.raises(CheckpointError, match=r"cannot mark it as this replica group's: read-only bucket policy"):
        trainer.fit()
    assert int(trainer.state.timestamp.batch) == 0


def test_corrupt_foreign_and_mismatching_checkpoints_fail_and_change_nothing(
    tmp_path: Path, initial: nn.Module
) -> None:
    trainer = _trainer(initial, max_duration="2ba")
    trainer.fit()
    before = (_weights(trainer), copy.deepcopy(trainer.state.optimizers[0].state_dict()), trainer.state.timestamp)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    wider = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))
    other = _trainer(DropoutNet(), max_duration="1ba", save_folder=str(tmp_path), run_name="other", save_interval="1ba")
    other.state.model.module.net = wider  # type: ignore[union-attr]
    other.save_checkpoint(str(tmp_path / "wider.pt"))
    for path in (garbage, foreign, tmp_path / "wider.pt"):
        with pytest.raises(CheckpointError, match=str(path.name)):
            trainer.load_checkpoint(str(path))
        assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), before[0], strict=True))
        assert trainer.state.timestamp == before[2]
        torch.testing.assert_close(trainer.state.optimizers[0].state_dict(), before[1])


def test_weights_only_and_ignored_parts(tmp_path: Path, initial: nn.Module) -> None:
    trainer = _trainer(initial, max_duration="3ba")
    trainer.fit()
    trainer.save_checkpoint(str(tmp_path / "full.pt"))
    trainer.save_checkpoint(str(tmp_path / "weights.pt"), weights_only=True)
    assert set(torch.load(tmp_path / "weights.pt", weights_only=True)) == {"model", "meta"}
    for path, options in (
        ("weights.pt", {"load_weights_only": True}),
        ("full.pt", {"load_ignore_keys": ["timestamp"]}),
    ):
        fresh = _trainer(initial, load_path=str(tmp_path / path), **options)
        assert int(fresh.state.timestamp.batch) == 0  # a fine-tuning start: the clock was not loaded
        assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(trainer), strict=True))
    with pytest.raises(ValueError, match="load_ignore_keys has \\['weights'\\]"):
        _trainer(initial, load_path=str(tmp_path / "full.pt"), load_ignore_keys=["weights"])


_NOT_OURS = (
    "is not a Trainer checkpoint (Trainer.save_checkpoint writes 'meta' with a 'format' marker, also with "
    "weights_only=True). To start from the weights of another checkpoint, load them into the model before "
    "building the Trainer: Fabric().load(path, {'model': model}), or Fabric().load_raw(path, model) for a bare "
    "state_dict."
)


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        (
            {"format": "fabric.trainer/2"},
            "was written by a newer version: format fabric.trainer/2, this version "
            "reads up to fabric.trainer/1; upgrade fabric to load it.",
        ),
        (None, f"{_NOT_OURS} It has no 'meta' entry."),
        ({"run_name": "x"}, f"{_NOT_OURS} Its 'meta' entry has no 'format' marker."),
        ({"format": "other.tool/1"}, f"{_NOT_OURS} Its format is 'other.tool/1'; this version reads fabric.trainer/1."),
    ],
    ids=["newer", "no meta", "no marker", "foreign"],
)
@pytest.mark.parametrize("weights_only", [False, True])
def test_a_checkpoint_of_a_newer_or_foreign_format_is_refused_and_changes_nothing(
    meta: dict[str, Any] | None, problem: str, weights_only: bool, tmp_path: Path, initial: nn.Module
) -> None:
    saver = _trainer(initial, max_duration="3ba")
    saver.fit()
    path = tmp_path / "ckpt.pt"
    saver.save_checkpoint(str(path), weights_only=weights_only)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint.pop("meta")
    torch.save(checkpoint if meta is None else {**checkpoint, "meta": meta}, path)  # otherwise loadable

    trainer = _trainer(initial, max_duration="2ba")
    trainer.fit()
    before = (_weights(trainer), copy.deepcopy(trainer.state.optimizers[0].state_dict()), trainer.state.timestamp)
    for strict in (True, False):
        with pytest.raises(CheckpointError) as error:
            trainer.load_checkpoint(str(path), weights_only=weights_only, strict=strict)
        assert str(error.value) == f"{str(path)!r} {problem}"
        assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), before[0], strict=True))
        torch.testing.assert_close(trainer.state.optimizers[0].state_dict(), before[1])
        assert trainer.state.timestamp == before[2]


def test_the_format_of_a_sharded_checkpoint_is_checked_too(tmp_path: Path, initial: nn.Module) -> None:
    trainer = _trainer(initial, max_duration="2ba")
    trainer.fit()
    before = _weights(trainer)
    model = {"model": trainer.state.model.state_dict()}
    write_shards({**model, "meta": {"format": "fabric.trainer/2"}}, tmp_path / "newer")
    write_shards(model, tmp_path / "foreign")
    with pytest.raises(CheckpointError, match=r"newer version: format fabric.trainer/2, this version reads up to"):
        trainer.load_checkpoint(str(tmp_path / "newer"), weights_only=True)
    with pytest.raises(CheckpointError, match=r"is not a Trainer checkpoint .* It has no 'meta' entry\.$"):
        trainer.load_checkpoint(str(tmp_path / "foreign"), weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), before, strict=True))


def test_bad_save_options_fail_at_construction(tmp_path: Path, initial: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"save_filename='ep\{epochs\}.pt' uses \['epochs'\]"):
        _trainer(initial, save_folder=str(tmp_path), save_filename="ep{epochs}.pt")
    with pytest.raises(ValueError, match="save_num_checkpoints_to_keep=0"):
        _trainer(initial, save_folder=str(tmp_path), save_num_checkpoints_to_keep=0)
    with pytest.raises(ValueError, match="save_interval='2xx'"):
        _trainer(initial, save_folder=str(tmp_path), save_interval="2xx")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"save_folder": ""}, r"save_folder='' names no folder; pass one, e\.g\. 'checkpoints/\{run_name\}'"),
        (
            {"save_latest_filename": "latest/rank{rank}.pt"},
            r"save_latest_filename='latest/rank\{rank\}.pt' must be a file name in save_folder "
            r".*'latest-rank\{rank\}.pt'",
        ),
        (
            {"save_filename": "model.pt", "save_num_checkpoints_to_keep": 2},
            r"save_filename='model.pt' has none of the fields that change between saves .*"
            r"save_num_checkpoints_to_keep=2 has nothing to prune; use e\.g\. 'ep\{epoch\}-ba\{batch\}",
        ),
        (
            {"save_filename": "ep{epoch}/model.pt", "save_num_checkpoints_to_keep": 2},
            r"save_filename='ep\{epoch\}/model.pt' puts checkpoints in subfolders",
        ),
        (  # fit() used to die with a bare KeyError 'rank' when it named the folder
            {"save_folder": "checkpoints/{rank}"},
            r"save_folder='checkpoints/\{rank\}' uses \['rank'\]; the fields it may use are \['run_name', "
            r"'replica_group'\]",
        ),
        (  # and at the first save, after an interval of training, with KeyError 'epoch'
            {"save_latest_filename": "latest-ep{epoch}.pt"},
            r"save_latest_filename='latest-ep\{epoch\}.pt' uses \['epoch'\]; the fields it may use are "
            r"\['run_name', 'rank'\]",
        ),
        (  # fit() used to die at the second save, after a whole interval of training
            {"save_filename": "model.pt", "save_interval": "2ba"},
            r"save_filename='model.pt' has none of the fields that change between saves .*so the second save of "
            r"save_interval='2ba' would find the first and stop training.*save_overwrite=True",
        ),
    ],
)
def test_save_options_that_would_fail_later_fail_at_construction_naming_what_works(
    options: dict[str, Any], message: str, tmp_path: Path, initial: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        _trainer(initial, **{"save_folder": str(tmp_path / "checkpoints"), **options})
    assert list(tmp_path.iterdir()) == []  # nothing was written anywhere


def test_a_save_folder_may_name_the_replica_group_which_is_0_without_fault_tolerance(
    tmp_path: Path, initial: nn.Module
) -> None:
    """``{replica_group}`` gives each fault-tolerant group its own folder (tests/strategies/fault_tolerant saves and
    autoresumes groups through it); a normal run saves to and resumes from group 0's, as a fault-tolerant run's
    checkpoint loads in a normal one."""
    folder = str(tmp_path / "{run_name}" / "group{replica_group}")
    _trainer(initial, save_folder=folder, run_name="run", max_duration="2ba", save_interval="1ba").fit()
    assert sorted(entry.name for entry in (tmp_path / "run" / "group0").iterdir()) == [
        "ep0-ba1-rank0.pt",
        "ep0-ba2-rank0.pt",
        "latest-rank0.pt",
    ]
    resumed = _trainer(
        initial, save_folder=folder, run_name="run", max_duration="3ba", save_interval="1ba", autoresume=True
    )
    resumed.fit()
    assert int(resumed.state.timestamp.batch) == 3 and resumed.saver is not None
    assert resumed.saver.saved == [str(tmp_path / "run" / "group0" / "ep0-ba3-rank0.pt")]  # resumed at batch 2


def test_a_fixed_save_filename_is_fine_when_every_checkpoint_is_kept(tmp_path: Path, initial: nn.Module) -> None:
    trainer = _trainer(initial, save_folder=str(tmp_path), save_filename="model.pt", save_overwrite=True)
    trainer.fit()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["latest-rank0.pt", "model.pt"]
    once = _trainer(initial, save_folder=str(tmp_path / "once"), save_filename="final.pt", save_interval="1dur")
    once.fit()  # saved once, at the end
    assert sorted(entry.name for entry in (tmp_path / "once").iterdir()) == ["final.pt", "latest-rank0.pt"]


def _resume_job(folder: Path, max_batches: int, interval: str = "1ba") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "trainer_resume.py"), str(folder), str(max_batches), interval],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_saves_at_the_next_batch_and_exits_with_the_preemption_code(tmp_path: Path) -> None:
    job = _resume_job(tmp_path, 100_000, interval="1000000ba")
    assert job.stdout is not None
    assert job.stdout.readline().startswith("training")  # the SIGTERM handler is installed once fit() runs
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr
    saved = [name for name in os.listdir(tmp_path / "job") if name.startswith("ep")]
    assert len(saved) == 1 and os.readlink(tmp_path / "job" / "latest-rank0.pt") == saved[0]
    said = f"Training stopped on SIGTERM (checkpoint saved to {tmp_path / 'job' / saved[0]}); exit code 75."
    assert stderr.splitlines().count(said) == 1, stderr
    resumed = _resume_job(tmp_path, int(saved[0].split("-ba")[1].split("-")[0]) + 3)
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert "resumed at batch" in stdout


def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    job = _resume_job(tmp_path, 100_000)
    assert job.stdout is not None
    job.stdout.readline()
    while True:  # wait until one checkpoint is complete and the next one is being written
        assert job.poll() is None, "the job ended before a save could be interrupted"
        names = os.listdir(tmp_path / "job") if (tmp_path / "job").is_dir() else []
        if any(name.startswith("ep") for name in names) and any(name.startswith(".ep") for name in names):
            break
    job.kill()
    job.communicate(timeout=60)
    resumed = _resume_job(tmp_path, 0)
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert "resumed at batch" in stdout


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


def test_model_surgery_is_reapplied_when_its_checkpoint_loads_into_a_fresh_model(tmp_path: Path) -> None:
    from fabric.trainer.algorithms.ghost_batchnorm import GhostBatchNorm

    trained = _trainer(
        BatchNormNet(), algorithms=[GhostBatchNorm(ghost_batch_size=4)], callbacks=[], max_duration="3ba"
    )
    trained.fit()
    trained.save_checkpoint(str(tmp_path / "ghost.pt"))
    assert type(trained.state.model.module.net[1]).__name__ != "BatchNorm1d"  # type: ignore[index, union-attr]

    fresh = _trainer(BatchNormNet(), callbacks=[], load_path=str(tmp_path / "ghost.pt"))  # no GhostBatchNorm here
    assert type(fresh.state.model.module.net[1]) is type(trained.state.model.module.net[1])  # type: ignore[index, union-attr]
    batch = next(iter(DataLoader(_data(), batch_size=16)))
    trained.state.model.eval()
    fresh.state.model.eval()
    with torch.no_grad():
        assert torch.equal(fresh.state.model(batch), trained.state.model(batch))


def test_surgery_records_are_read_from_a_sharded_checkpoint_and_an_unreadable_one_raises(tmp_path: Path) -> None:
    """They were read from single files only, and any error gave no records: a sharded checkpoint's surgery was
    silently not reapplied (harmless only when it changes a parameter's shape, and the load then fails)."""
    from fabric.trainer.checkpoint.checkpointer import read_surgery_records

    records = [{"algorithm": "fabric.trainer.algorithms.ghost_batchnorm.GhostBatchNorm", "hparams": {"ghost": 4}}]
    write_shards({"model": {"w": torch.ones(2)}, "meta": {"format": "fabric.trainer/1", "surgery": records}},
                 tmp_path / "sharded")  # fmt: skip
    assert read_surgery_records(str(tmp_path / "sharded")) == records
    (tmp_path / "truncated.pt").write_bytes(b"PK\x03\x04 not a whole checkpoint")
    with pytest.raises(CheckpointError, match=r"truncated\.pt"):
        read_surgery_records(str(tmp_path / "truncated.pt"))


def test_a_checkpoint_saver_can_be_passed_as_a_callback(tmp_path: Path, initial: nn.Module) -> None:
    from fabric.trainer.checkpoint.saver import CheckpointSaver

    saver = CheckpointSaver(str(tmp_path), filename="step{batch}.pt", save_interval="2ba", num_checkpoints_to_keep=1)
    trainer = _trainer(initial, max_duration="4ba", callbacks=[saver])
    trainer.fit()
    assert sorted(os.listdir(tmp_path)) == ["latest-rank0.pt", "step4.pt"]
    assert trainer.saver is saver


@pytest.mark.parametrize("save_async", [False, True])
def test_a_misspelled_bucket_fails_before_training_and_is_never_created(
    s3_bucket: str, tmp_path: Path, save_async: bool
) -> None:
    """With save_async=True the run created the misspelled bucket and exited 0; without, every batch trained and only
    the upload at the end failed, without naming the bucket."""
    import s3fs

    misspelled = f"{s3_bucket}-typo"
    counter = CountBatches()
    trainer = _trainer(
        DropoutNet(), save_folder=f"{misspelled}/run1", save_interval="5ba", save_async=save_async, callbacks=[counter]
    )
    with pytest.raises(CheckpointError, match=rf"the bucket '{misspelled[len('s3://') :]}' does not exist"):
        trainer.fit()
    assert counter.count == 0
    s3fs.S3FileSystem.clear_instance_cache()
    assert not fsspec.filesystem("s3").exists(misspelled)


def test_a_folder_that_refuses_writes_fails_before_training(tmp_path: Path) -> None:
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    (read_only / "run1").write_text("a file where the folder should be")
    counter = CountBatches()
    trainer = _trainer(DropoutNet(), save_folder=str(read_only / "run1"), callbacks=[counter])
    with pytest.raises(CheckpointError, match=r"Checkpoints cannot be written to '.*run1'"):
        trainer.fit()
    assert counter.count == 0


def test_an_autoresumed_run_says_where_it_resumed_and_that_nothing_is_left_to_train(
    tmp_path: Path, initial: nn.Module, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun of a finished run printed two progress bars and exited 0 without a word of either."""
    first = _trainer(initial, max_duration="3ba", save_folder=str(tmp_path), run_name="exp1", save_interval="1ba")
    first.fit()
    capsys.readouterr()
    rerun = _trainer(initial, max_duration="3ba", save_folder=str(tmp_path), run_name="exp1", autoresume=True)
    assert capsys.readouterr().err == (
        f"fabric: autoresume: resumed run 'exp1' from {tmp_path / 'ep0-ba3-rank0.pt'} at epoch 0, batch 3.\n"
    )
    rerun.fit()
    assert "fabric: nothing left to train: the run is at epoch 0, batch 3, which max_duration=3ba reaches" in (
        capsys.readouterr().err
    )
