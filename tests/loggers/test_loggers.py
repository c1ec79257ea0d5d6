"""Tests for the CSV and TensorBoard loggers: what ends up on disk, versioning, and rank-zero-only writing."""

from __future__ import annotations

import argparse
import csv
import json
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import fabric.loggers.tensorboard as tensorboard_module
from fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from fabric.utilities.rank_zero import rank_zero_only, set_global_rank


@pytest.fixture(autouse=True)
def global_rank_zero() -> Iterator[None]:
    """Run each test as global rank 0 and put back whatever rank was set before."""
    previous = getattr(rank_zero_only, "rank", None)
    set_global_rank(0)
    yield
    if previous is None:
        delattr(rank_zero_only, "rank")
    else:
        set_global_rank(previous)


def read_csv(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    with fsspec.open(str(path), "r", newline="") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def all_files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


# ----------------------------------------------------------------------------------------------- CSVLogger


def test_csv_logger_writes_steps_and_values(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    for step in range(3):
        logger.log_metrics({"loss": 1.0 / (step + 1), "acc": step * 0.25}, step=step * 10)
    logger.save()

    assert logger.log_dir == str(tmp_path / "fabric_logs" / "version_0")
    header, rows = read_csv(Path(logger.log_dir) / "metrics.csv")
    assert header == ["step", "loss", "acc"]
    assert [int(row["step"]) for row in rows] == [0, 10, 20]
    assert [float(row["loss"]) for row in rows] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert [float(row["acc"]) for row in rows] == [0.0, 0.25, 0.5]


def test_csv_logger_step_defaults_to_call_count(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    for value in (5.0, 6.0, 7.0):
        logger.log_metrics({"x": value})
    logger.save()

    _, rows = read_csv(Path(logger.log_dir) / "metrics.csv")
    assert [(row["step"], row["x"]) for row in rows] == [("0", "5.0"), ("1", "6.0"), ("2", "7.0")]


@pytest.mark.parametrize("flush_every", [1, 100], ids=["new-key-after-flush", "new-key-in-buffer"])
def test_csv_logger_new_key_widens_header_and_keeps_earlier_rows(tmp_path: Path, flush_every: int) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=flush_every)
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_metrics({"loss": 0.25}, step=1)
    logger.log_metrics({"loss": 0.125, "val_acc": 0.9}, step=2)
    logger.log_metrics({"loss": 0.0625}, step=3)
    logger.finalize("success")

    header, rows = read_csv(Path(logger.log_dir) / "metrics.csv")
    assert header == ["step", "loss", "val_acc"]
    assert rows == [
        {"step": "0", "loss": "0.5", "val_acc": ""},
        {"step": "1", "loss": "0.25", "val_acc": ""},
        {"step": "2", "loss": "0.125", "val_acc": "0.9"},
        {"step": "3", "loss": "0.0625", "val_acc": ""},
    ]
    assert [path.name for path in all_files(Path(logger.log_dir))] == ["metrics.csv"]  # no temporary file left


def test_csv_logger_buffers_until_flush_interval(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    metrics_file = Path(logger.log_dir) / "metrics.csv"

    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 2.0}, step=1)
    assert not metrics_file.exists()

    logger.log_metrics({"loss": 3.0}, step=2)
    assert [row["loss"] for row in read_csv(metrics_file)[1]] == ["1.0", "2.0", "3.0"]

    logger.log_metrics({"loss": 4.0}, step=3)
    assert len(read_csv(metrics_file)[1]) == 3
    logger.save()
    assert [row["loss"] for row in read_csv(metrics_file)[1]] == ["1.0", "2.0", "3.0", "4.0"]


def test_csv_logger_converts_tensors(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": torch.tensor(0.5), "correct": torch.tensor(7), "single": torch.tensor([2.5])}, step=1)
    logger.save()

    _, rows = read_csv(Path(logger.log_dir) / "metrics.csv")
    assert rows == [{"step": "1", "loss": "0.5", "correct": "7", "single": "2.5"}]


def test_csv_logger_rejects_non_scalar_tensor(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    with pytest.raises(ValueError, match=r"'weights'.*\(2, 3\)"):
        logger.log_metrics({"loss": 1.0, "weights": torch.zeros(2, 3)}, step=0)
    logger.save()
    assert not (Path(logger.log_dir) / "metrics.csv").exists()  # the rejected row was not half-logged


def test_csv_logger_takes_a_metric_named_step_as_lightnings_does(tmp_path: Path) -> None:
    """litgpt logs ``{"loss", "iter", "step", ...}`` with ``fabric.log_dict(metrics, step=iter_num)``."""
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": 2.0, "step": 7.0})  # no step=: the metric is the row's step
    logger.log_metrics({"loss": 1.5, "step": 8.0}, step=8)  # the same value: nothing to say
    with pytest.warns(UserWarning, match=r"the metric 'step' \(2\.0\) differs from step=16; the 'step' column"):
        logger.log_metrics({"loss": 1.0, "step": 2.0}, step=16)
    logger.log_metrics({"loss": 0.5, "step": 3.0}, step=32)  # warned once
    logger.save()
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["step", "loss"]
    assert [(float(row["step"]), float(row["loss"])) for row in rows] == [(7, 2.0), (8, 1.5), (16, 1.0), (32, 0.5)]


def test_csv_logger_prefix(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.save()
    assert read_csv(Path(logger.log_dir) / "metrics.csv")[0] == ["step", "train/loss"]


def test_csv_logger_versions_increment(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path, name="exp")
    first.log_metrics({"loss": 1.0}, step=0)
    second = CSVLogger(tmp_path, name="exp")
    second.log_metrics({"loss": 2.0}, step=0)
    first.save()
    second.save()

    assert (first.version, second.version) == (0, 1)
    assert sorted(path.name for path in (tmp_path / "exp").iterdir()) == ["version_0", "version_1"]
    assert read_csv(tmp_path / "exp" / "version_1" / "metrics.csv")[1] == [{"step": "0", "loss": "2.0"}]
    assert CSVLogger(tmp_path, name="exp").version == 2
    assert CSVLogger(tmp_path, name="other").version == 0


def test_csv_logger_explicit_versions(tmp_path: Path) -> None:
    assert CSVLogger(tmp_path, version=7).log_dir == str(tmp_path / "fabric_logs" / "version_7")
    named = CSVLogger(tmp_path, version="baseline")
    assert named.log_dir == str(tmp_path / "fabric_logs" / "baseline")
    (tmp_path / "fabric_logs" / "version_3").mkdir(parents=True)
    (tmp_path / "fabric_logs" / "notes").mkdir()
    assert CSVLogger(tmp_path).version == 4  # the next number after the highest, ignoring other directories


def test_csv_logger_resuming_a_version_keeps_earlier_rows(tmp_path: Path) -> None:
    first_run = CSVLogger(tmp_path, version="run")
    first_run.log_metrics({"loss": 1.0}, step=0)
    first_run.finalize("failed")

    resumed = CSVLogger(tmp_path, version="run")
    resumed.log_metrics({"loss": 0.5, "lr": 0.01}, step=1)
    resumed.finalize("success")

    header, rows = read_csv(Path(resumed.log_dir) / "metrics.csv")
    assert header == ["step", "loss", "lr"]
    assert rows == [{"step": "0", "loss": "1.0", "lr": ""}, {"step": "1", "loss": "0.5", "lr": "0.01"}]


def test_csv_logger_writes_hyperparams(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(argparse.Namespace(lr=0.1, layers=[64, 32], data=Path("/data")))
    logger.log_hyperparams({"batch_size": 8, "device": torch.device("cpu"), "lr": 0.05})

    saved = json.loads((Path(logger.log_dir) / "hparams.json").read_text())
    assert saved == {"lr": 0.05, "layers": [64, 32], "data": "/data", "batch_size": 8, "device": "cpu"}


def test_csv_logger_memory_filesystem() -> None:
    root = f"memory://csv-logger-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        logger = CSVLogger(root, name="exp")
        logger.log_metrics({"loss": 0.5}, step=0)
        logger.log_hyperparams({"lr": 0.1})
        logger.finalize("success")

        assert logger.version == 0
        assert CSVLogger(root, name="exp").version == 1
        assert read_csv(f"{root}/exp/version_0/metrics.csv") == (["step", "loss"], [{"step": "0", "loss": "0.5"}])
        assert json.loads(fs.cat_file(f"{root}/exp/version_0/hparams.json")) == {"lr": 0.1}
    finally:
        fs.rm(root, recursive=True)


def test_csv_logger_rejects_bad_flush_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush_logs_every_n_steps"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


# ----------------------------------------------------------------------------------------- non-zero ranks


@pytest.mark.parametrize("logger_class", [CSVLogger, TensorBoardLogger])
def test_nothing_is_written_on_other_ranks(tmp_path: Path, logger_class: type[CSVLogger | TensorBoardLogger]) -> None:
    set_global_rank(1)
    logger = logger_class(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_hyperparams({"lr": 0.1})
    logger.save()
    logger.finalize("success")

    assert list(tmp_path.iterdir()) == []
    if isinstance(logger, TensorBoardLogger):
        assert logger.experiment is None


# ----------------------------------------------------------------------------------------- TensorBoardLogger


def load_events(log_dir: str) -> Any:
    """Read back every event file in ``log_dir`` the way TensorBoard does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_logger_writes_scalars(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": torch.tensor(0.5), "acc": 0.25}, step=3)
    logger.log_metrics({"loss": 0.125}, step=7)
    logger.log_metrics({"loss": 0.0625})  # no step: the number of earlier calls
    logger.finalize("success")

    assert logger.log_dir == str(tmp_path / "fabric_logs" / "version_0")
    assert any(path.name.startswith("events.out.tfevents") for path in all_files(Path(logger.log_dir)))
    events = load_events(logger.log_dir)
    assert sorted(events.Tags()["scalars"]) == ["train/acc", "train/loss"]
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(3, 0.5), (7, 0.125), (2, 0.0625)]
    assert [(event.step, event.value) for event in events.Scalars("train/acc")] == [(3, 0.25)]


def test_tensorboard_logger_rejects_non_scalar_tensor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'grads'.*\(4,\)"):
        TensorBoardLogger(tmp_path).log_metrics({"grads": torch.ones(4)})


def test_tensorboard_logger_writes_hyperparams(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    logger = TensorBoardLogger(tmp_path, default_hp_metric=True)
    logger.log_hyperparams({"lr": 0.1, "optimizer": {"name": "adam", "betas": (0.9, 0.99)}, "seed": None})
    logger.finalize("success")

    events = load_events(logger.log_dir)
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["optimizer/name"].string_value == "adam"
    assert hparams["optimizer/betas"].string_value == "(0.9, 0.99)"
    assert hparams["seed"].string_value == "None"  # TensorBoard would silently drop a None value
    assert [event.value for event in events.Scalars("hp_metric")] == [-1.0]


def test_tensorboard_logger_versions_increment(tmp_path: Path) -> None:
    first = TensorBoardLogger(tmp_path)
    first.log_metrics({"loss": 1.0}, step=0)
    second = TensorBoardLogger(tmp_path)
    second.log_metrics({"loss": 2.0}, step=0)
    first.finalize("success")
    second.finalize("success")

    assert (first.version, second.version) == (0, 1)
    assert [event.value for event in load_events(second.log_dir).Scalars("loss")] == [2.0]


def test_tensorboard_logger_creates_writer_lazily_and_pickles_without_it(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, flush_secs=5)
    assert list(tmp_path.iterdir()) == []  # constructing does not touch the disk

    writer = logger.experiment
    assert writer is not None
    assert writer.log_dir == logger.log_dir
    assert logger.experiment is writer

    restored = pickle.loads(pickle.dumps(logger))
    assert restored.log_dir == logger.log_dir
    restored.finalize("success")
    logger.finalize("success")


def test_tensorboard_logger_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorboard_module, "_TENSORBOARD_AVAILABLE", False)
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r'pip install -e "\.\[tensorboard\]"'):
        logger.log_metrics({"loss": 1.0})


# ----------------------------------------------------------------------------------------------- interface


def test_importing_loggers_does_not_import_tensorboard() -> None:
    code = (
        "import sys, fabric.loggers; "
        "loaded = [m for m in ('tensorboard', 'torch.utils.tensorboard') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_logger_base_class_defaults() -> None:
    class RecordingLogger(Logger):
        def __init__(self) -> None:
            self.saved = 0

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: object, step: int | None = None) -> None:
            pass

        def log_hyperparams(self, params: object) -> None:
            pass

        def save(self) -> None:
            self.saved += 1

    logger = RecordingLogger()
    assert (logger.root_dir, logger.log_dir) == (None, None)
    logger.finalize("success")
    assert logger.saved == 1

    with pytest.raises(TypeError, match="abstract"):
        Logger()  # type: ignore[abstract]
