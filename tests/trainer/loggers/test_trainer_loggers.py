"""Logger destinations, driven through the Logger and the Engine: what ends up in memory, files, CSVs and streams."""

from __future__ import annotations

import csv
import inspect
import io
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.loggers import CSVLogger as FabricCSVLogger
from fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time
from fabric.trainer.loggers import (
    ConsoleLogger,
    CSVLogger,
    FabricLoggerDestination,
    FileLogger,
    InMemoryLogger,
    Logger,
    LoggerDestination,
    ProgressBarLogger,
    TensorBoardLogger,
)


class Rig:
    """A State with a Logger and an Engine that both reach ``destination``: the Trainer's wiring, without the loop."""

    def __init__(self, destination: LoggerDestination, max_duration: str = "100ba") -> None:
        self.state = State(model=nn.Linear(1, 1), max_duration=Time.from_timestring(max_duration))
        self.logger = Logger(self.state, [destination])
        self.engine = Engine(self.state, self.logger, loggers=[destination])

    def train_batch(self, loss: float | None = None) -> None:
        """One batch: the clock advances, the loss is logged like the loop does, then BATCH_END."""
        self.engine.run_event(Event.BATCH_START)
        self.state.timestamp = self.state.timestamp.to_next_batch(4, duration=timedelta(seconds=0.5))
        if loss is not None:
            self.logger.log_metrics({"loss/train/total": loss})
        self.engine.run_event(Event.BATCH_END)

    def end_epoch(self) -> None:
        self.state.timestamp = self.state.timestamp.to_next_epoch()
        self.engine.run_event(Event.EPOCH_END)

    def evaluate(self, label: str, metrics: dict[str, float], batches: int = 0) -> None:
        self.state.dataloader_label = label
        self.engine.run_event(Event.EVAL_START)
        for _ in range(batches):
            self.engine.run_event(Event.EVAL_BATCH_END)
        self.logger.log_metrics({f"metrics/{label}/{name}": value for name, value in metrics.items()})
        self.engine.run_event(Event.EVAL_END)
        self.state.dataloader_label = None


# --- InMemoryLogger ---------------------------------------------------------------------------------


def test_in_memory_logger_keeps_every_value_with_its_step() -> None:
    memory = InMemoryLogger()
    rig = Rig(memory)
    rig.train_batch(loss=0.5)
    rig.train_batch(loss=0.25)
    rig.logger.log_hyperparameters({"lr": 0.1, "model": "mlp"})
    assert memory.data == {"loss/train/total": [(1, 0.5), (2, 0.25)]}
    assert memory.most_recent_values == {"loss/train/total": 0.25}
    assert memory.hyperparameters == {"lr": 0.1, "model": "mlp"}


def test_only_the_in_memory_logger_is_kept_on_every_rank() -> None:
    assert InMemoryLogger.all_ranks
    assert not any(cls.all_ranks for cls in (ProgressBarLogger, ConsoleLogger, FileLogger, FabricLoggerDestination))


# --- FileLogger -------------------------------------------------------------------------------------


def test_file_logger_appends_lines_and_flushes_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "one" / "log.txt"
    file_logger = FileLogger(path, flush_interval=2)
    rig = Rig(file_logger)
    rig.logger.log_hyperparameters({"lr": 0.1})
    rig.train_batch(loss=0.5)
    assert path.read_text() == ""  # buffered until the interval
    rig.train_batch(loss=0.25)
    assert path.read_text().splitlines() == [
        "[hyperparameter] lr: 0.1",
        "[batch=1] loss/train/total: 0.5",
        "[batch=2] loss/train/total: 0.25",
    ]
    rig.train_batch(loss=0.125)
    file_logger.close()
    assert path.read_text().splitlines()[-1] == "[batch=3] loss/train/total: 0.125"


def test_file_logger_reopens_and_appends_after_close(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_text("earlier run\n")
    file_logger = FileLogger(path)
    file_logger.log_metrics({"accuracy": 0.75}, step=7)
    file_logger.close()
    file_logger.log_metrics({"accuracy": 0.8}, step=8)
    file_logger.close()
    assert path.read_text().splitlines() == ["earlier run", "[batch=7] accuracy: 0.75", "[batch=8] accuracy: 0.8"]


def test_file_logger_with_line_buffering_writes_at_once(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    FileLogger(path, buffer_size=1).log_metrics({"loss": 1.5}, step=1)
    assert path.read_text() == "[batch=1] loss: 1.5\n"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"flush_interval": 0}, "flush_interval must be"),
        ({"flush_interval": 1.5}, "flush_interval must be"),
        ({"buffer_size": 0}, "buffer_size must be -1"),
        ({"buffer_size": -2}, "buffer_size must be -1"),
    ],
)
def test_file_logger_rejects_bad_arguments(tmp_path: Path, arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FileLogger(tmp_path / "log.txt", **arguments)


# --- Fabric's loggers as destinations ---------------------------------------------------------------


def _csv_rows(log_dir: str) -> list[dict[str, str]]:
    with open(Path(log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_a_fabric_logger_receives_the_values_and_is_saved_when_fit_ends(tmp_path: Path) -> None:
    fabric_logger = FabricCSVLogger(tmp_path, name="run", flush_logs_every_n_steps=1000)
    rig = Rig(FabricLoggerDestination(fabric_logger))
    rig.logger.log_hyperparameters({"lr": 0.1})
    rig.train_batch(loss=0.5)
    rig.train_batch(loss=0.25)
    assert not (Path(fabric_logger.log_dir) / "metrics.csv").exists()  # still buffered by the CSV logger
    rig.engine.run_event(Event.FIT_END)
    assert _csv_rows(fabric_logger.log_dir) == [
        {"step": "1", "loss/train/total": "0.5"},
        {"step": "2", "loss/train/total": "0.25"},
    ]
    assert '"lr": 0.1' in (Path(fabric_logger.log_dir) / "hparams.json").read_text()


def test_the_csv_destination_takes_fabrics_arguments_and_writes_on_close(tmp_path: Path) -> None:
    destination = CSVLogger(tmp_path, name="exp", version=3, prefix="train")
    rig = Rig(destination)
    rig.train_batch(loss=0.5)
    destination.close()
    assert destination.logger.log_dir == str(tmp_path / "exp" / "version_3")
    assert _csv_rows(str(tmp_path / "exp" / "version_3")) == [{"step": "1", "train/loss/train/total": "0.5"}]


def test_the_tensorboard_destination_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    destination = TensorBoardLogger(tmp_path, name="tb", version=0)
    Rig(destination).train_batch(loss=0.5)
    destination.close()
    assert list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*"))


def test_only_fabric_loggers_can_be_adapted() -> None:
    with pytest.raises(TypeError, match=r"Expected a fabric\.loggers\.Logger"):
        FabricLoggerDestination(InMemoryLogger())  # type: ignore[arg-type]


# --- ConsoleLogger ----------------------------------------------------------------------------------


def test_console_logger_prints_the_latest_values_every_interval_in_batches() -> None:
    stream = io.StringIO()
    rig = Rig(ConsoleLogger(log_interval="2ba", stream=stream))
    for loss in (0.5, 0.25, 0.125):
        rig.train_batch(loss=loss)
    assert stream.getvalue().splitlines() == ["[epoch=0 batch=2] train: loss/train/total: 0.25"]
    rig.engine.run_event(Event.FIT_END)  # what was logged since the last line is printed once more
    assert stream.getvalue().splitlines()[-1] == "[epoch=0 batch=3] train: loss/train/total: 0.125"


def test_console_logger_prints_per_epoch_and_one_line_per_evaluation() -> None:
    stream = io.StringIO()
    rig = Rig(ConsoleLogger(log_interval=1, stream=stream))
    rig.train_batch(loss=0.5)
    rig.logger.log_metrics({"lr-SGD/group0": 0.1})
    assert stream.getvalue() == ""
    rig.end_epoch()
    rig.evaluate("val", {"accuracy": 0.75, "loss": 0.3})
    assert stream.getvalue().splitlines() == [
        "[epoch=1 batch=1] train: loss/train/total: 0.5, lr-SGD/group0: 0.1",
        "[epoch=1 batch=1] val: metrics/val/accuracy: 0.75, metrics/val/loss: 0.3",
    ]


@pytest.mark.parametrize(("interval", "problem"), [("0ba", "must be positive"), ("often", "is not an interval")])
def test_console_logger_rejects_a_bad_interval(interval: str, problem: str) -> None:
    with pytest.raises(ValueError, match=f"log_interval={interval!r} {problem}"):
        ConsoleLogger(log_interval=interval)


# --- ProgressBarLogger ------------------------------------------------------------------------------


def test_progress_bar_covers_the_run_and_shows_loss_and_epoch() -> None:
    stream = io.StringIO()
    bar = ProgressBarLogger(stream=stream)
    rig = Rig(bar, max_duration="4ba")
    rig.engine.run_event(Event.FIT_START)
    for loss in (0.5, 0.4, 0.3, 0.25):
        rig.train_batch(loss=loss)
    rig.engine.run_event(Event.FIT_END)
    final = stream.getvalue().rstrip("\n").split("\n")[-1]
    assert re.search(r"train: 100%.* 4/4 .*epoch=0, loss/train/total=0\.25", final), final


def test_progress_bar_total_counts_epochs_of_a_known_length() -> None:
    stream = io.StringIO()
    rig = Rig(ProgressBarLogger(stream=stream), max_duration="2ep")
    rig.state.dataloader_len = 3
    rig.engine.run_event(Event.FIT_START)
    rig.train_batch(loss=1.0)
    rig.engine.run_event(Event.FIT_END)
    assert " 1/6 " in stream.getvalue()


def test_progress_bar_per_epoch_when_the_run_length_is_unknown() -> None:
    stream = io.StringIO()
    rig = Rig(ProgressBarLogger(stream=stream), max_duration="1000sp")
    rig.state.dataloader_len = 2
    rig.engine.run_event(Event.FIT_START)
    for _ in range(2):
        rig.engine.run_event(Event.EPOCH_START)
        rig.train_batch(loss=1.0)
        rig.train_batch(loss=0.5)
        rig.end_epoch()
    first, second = stream.getvalue().rstrip("\n").split("\n")  # each finished bar is left on its own line
    assert re.search(r"train epoch 0: 100%.* 2/2 .*epoch=0, loss/train/total=0\.5", first), first
    assert re.search(r"train epoch 1: 100%.* 2/2 .*epoch=1, loss/train/total=0\.5", second), second


def test_progress_bar_eval_bar_is_labelled_and_disappears() -> None:
    stream = io.StringIO()
    bar = ProgressBarLogger(stream=stream)
    rig = Rig(bar, max_duration="4ba")
    rig.engine.run_event(Event.FIT_START)
    rig.train_batch(loss=0.5)
    rig.evaluate("val", {"accuracy": 0.5}, batches=3)
    output = stream.getvalue()
    assert "eval val:" in output
    assert re.search(r"\r {10,}", output[output.rindex("eval val:") :])  # the bar's line was blanked out
    bar.close()
    assert re.search(r"train:  25%.* 1/4 ", stream.getvalue().rstrip("\n").split("\n")[-1])  # left by close()


# --- One set of destinations for the Trainer and its Fabric -------------------------------------------


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outputs: torch.Tensor = self.linear(batch[0])
        return outputs

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, batch[1])


class _FabricLogsEveryBatch(Callback):
    def batch_end(self, state: State, logger: Any) -> None:
        state.fabric.log("from_fabric", float(state.timestamp.batch) / 10)


def test_fabric_log_and_the_trainer_write_to_the_same_destinations_once(tmp_path: Path) -> None:
    from fabric import Fabric
    from fabric.trainer.trainer import Trainer

    fabric_csv = FabricCSVLogger(tmp_path, name="run", version=0)
    memory = InMemoryLogger()
    model = _Regression()
    trainer = Trainer(
        model,
        DataLoader(TensorDataset(torch.randn(12, 3), torch.randn(12, 1)), batch_size=4),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=[_FabricLogsEveryBatch()],
        loggers=[memory],
        progress_bar=False,
        fabric=Fabric(accelerator="cpu", devices=1, loggers=[fabric_csv]),
    )
    trainer.fit()
    trainer.fabric.log_dict({"after_fit": torch.tensor(2.0)})  # no step: the batch count, as the Trainer's values
    trainer.close()
    # The Trainer's values and Fabric's reach the in-memory destination, Fabric's at the current batch, each once.
    assert memory.data["from_fabric"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert memory.data["after_fit"] == [(3, 2.0)]
    assert [step for step, _ in memory.data["loss/train/total"]] == [1, 2, 3]
    # The logger the Fabric already held gets the Trainer's values too, and Fabric's exactly once.
    rows = _csv_rows(fabric_csv.log_dir)
    assert [row["from_fabric"] for row in rows if row["from_fabric"]] == ["0.1", "0.2", "0.3"]
    assert len([row for row in rows if row["loss/train/total"]]) == 3
    assert trainer.fabric.logger is fabric_csv  # the Fabric's own logger stays first


def test_the_trainer_csv_and_tensorboard_names_take_fabrics_signature() -> None:
    assert inspect.signature(CSVLogger).parameters == inspect.signature(FabricCSVLogger).parameters
    assert inspect.signature(TensorBoardLogger).parameters == inspect.signature(FabricTensorBoardLogger).parameters


# --- failures -----------------------------------------------------------------------------------------


class ExceptionRecorder(LoggerDestination):
    def __init__(self) -> None:
        self.exceptions: list[BaseException] = []

    def log_exception(self, exception: BaseException) -> None:
        self.exceptions.append(exception)


class RaisesOnEval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, batch: Any) -> torch.Tensor:
        if not self.training:
            raise RuntimeError("eval fails on purpose")
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return (outputs - batch[1]).pow(2).mean()


def test_every_destination_hears_of_an_exception_ending_fit_or_eval_once_and_of_nothing_on_success() -> None:
    from fabric.trainer import Trainer

    x = torch.randn(8, 2)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    recorders = [ExceptionRecorder(), ExceptionRecorder()]
    model = RaisesOnEval()
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        loggers=recorders,
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    assert [recorder.exceptions for recorder in recorders] == [[], []]
    with pytest.raises(RuntimeError, match="eval fails on purpose") as raised:
        trainer.eval(eval_dataloader=loader)
    assert [recorder.exceptions for recorder in recorders] == [[raised.value], [raised.value]]
    with pytest.raises(RuntimeError, match="eval fails on purpose"):
        trainer.fit(duration="1ep", eval_dataloader=loader)  # evaluates at the end of the epoch
    assert [len(recorder.exceptions) for recorder in recorders] == [2, 2]


def test_log_table_sends_the_rows_at_the_current_batch_and_refuses_rows_of_another_length() -> None:
    from fabric.trainer.core.logger import Logger

    state = State(model=nn.Linear(1, 1))
    state.timestamp = state.timestamp.to_next_batch(4, 0)
    memory = InMemoryLogger()
    logger = Logger(state, [memory])
    logger.log_table(["prompt", "generation"], [("a", "b c"), ("d", "e")], name="generations")
    assert memory.tables["generations"] == {"columns": ["prompt", "generation"], "rows": [["a", "b c"], ["d", "e"]],
                                            "step": 1}  # fmt: skip
    with pytest.raises(ValueError, match=r"log_table\('t'\): rows \[1\] do not have the 2 columns \['x', 'y'\]"):
        logger.log_table(["x", "y"], [[1, 2], [3]], name="t")
    assert "t" not in memory.tables
