"""The events Composer users hook (issue 13, item 9): load events in every set-up, one iteration per fit(),
standalone evaluation events, and ``close(state, logger)`` then ``post_close()`` from ``Trainer.close()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.algorithms.ema import EMA
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.loggers.destination import LoggerDestination
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.linear(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs.squeeze(-1), batch[1])


def _loader(batches: int = 3, batch_size: int = 2) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    samples = batches * batch_size
    return DataLoader(TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples)), batch_size)


class Recorder(Callback):
    """Every event with the batch count it fired at."""

    def __init__(self) -> None:
        self.events: list[tuple[Event, int]] = []

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        self.events.append((event, int(state.timestamp.batch)))

    def only(self, *events: Event) -> list[tuple[Event, int]]:
        return [(event, batch) for event, batch in self.events if event in events]


def _trainer(recorder: Callback, **kwargs: Any) -> Trainer:
    model = Regressor()
    kwargs.setdefault("max_duration", "2ep")
    return Trainer(
        model,
        _loader(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[recorder],
        progress_bar=False,
        seed=0,
        **kwargs,
    )


def test_load_events_fire_in_every_set_up_and_one_iteration_spans_each_fit() -> None:
    recorder = Recorder()
    trainer = _trainer(recorder)
    assert [event for event, _ in recorder.events] == [Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD]
    trainer.fit()
    trainer.fit(duration="2ba")  # ends mid-epoch: the iteration is the fit() call, not a number of epochs
    iteration_events = (Event.ITERATION_START, Event.ITERATION_END, Event.ITERATION_CHECKPOINT)
    assert recorder.only(Event.FIT_START, *iteration_events, Event.EPOCH_CHECKPOINT, Event.FIT_END) == [
        (Event.FIT_START, 0),
        (Event.ITERATION_START, 0),
        (Event.EPOCH_CHECKPOINT, 3),
        (Event.EPOCH_CHECKPOINT, 6),
        (Event.ITERATION_END, 6),
        (Event.ITERATION_CHECKPOINT, 6),
        (Event.FIT_END, 6),
        (Event.FIT_START, 6),
        (Event.ITERATION_START, 6),
        (Event.ITERATION_END, 8),
        (Event.ITERATION_CHECKPOINT, 8),
        (Event.FIT_END, 8),
    ]
    # the iteration opens before the first epoch starts
    starts = [event for event, _ in recorder.events if event in (Event.ITERATION_START, Event.EPOCH_START)]
    assert starts[:2] == [Event.ITERATION_START, Event.EPOCH_START]
    assert len(recorder.only(Event.BEFORE_LOAD)) == len(recorder.only(Event.AFTER_LOAD)) == 1


def test_loading_a_checkpoint_fires_the_load_events_once_around_the_load(tmp_path: Path) -> None:
    first = _trainer(Recorder(), max_duration="2ba")
    first.fit()
    first.save_checkpoint(str(tmp_path / "checkpoint.pt"))
    recorder = Recorder()
    _trainer(recorder, load_path=str(tmp_path / "checkpoint.pt"))
    # BEFORE_LOAD sees the fresh clock, AFTER_LOAD the loaded one; neither fires twice
    assert recorder.events == [(Event.INIT, 0), (Event.BEFORE_LOAD, 0), (Event.AFTER_LOAD, 2)]


def test_standalone_eval_fires_its_own_round_events_instead_of_the_training_ones() -> None:
    recorder = Recorder()
    trainer = _trainer(recorder, eval_dataloader=_loader(batches=2))
    trainer.eval()
    assert [event for event, _ in recorder.events[3:]] == [
        Event.EVAL_STANDALONE_START,
        Event.EVAL_START,
        *[Event.EVAL_BATCH_START, Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD, Event.EVAL_BATCH_END] * 2,
        Event.EVAL_END,
        Event.EVAL_STANDALONE_END,
    ]
    trainer.fit(duration="1ep")  # evaluation during training keeps EVAL_BEFORE_ALL / EVAL_AFTER_ALL
    assert len(recorder.only(Event.EVAL_BEFORE_ALL)) == len(recorder.only(Event.EVAL_AFTER_ALL)) == 1
    assert len(recorder.only(Event.EVAL_STANDALONE_START)) == 1


class WeightsAtEval(Callback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def eval_start(self, state: State, logger: Any) -> None:
        self.weights.append(state.model.module.linear.weight.detach().clone())


def test_ema_evaluates_with_the_average_in_a_standalone_eval_too() -> None:
    seen = WeightsAtEval()
    model = Regressor()
    ema = EMA(half_life="1ba")
    trainer = Trainer(
        model,
        _loader(),
        "3ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        eval_dataloader=_loader(batches=1),
        eval_interval="10ep",
        algorithms=[ema],
        callbacks=[seen],
        progress_bar=False,
    )
    trainer.fit()  # evaluates once at the end of training
    raw = model.linear.weight.detach().clone()
    trainer.eval()
    assert ema.averages is not None
    average = ema.averages[0]
    assert not torch.equal(average, raw)
    assert torch.equal(seen.weights[0], average) and torch.equal(seen.weights[1], average)
    assert torch.equal(model.linear.weight, raw)  # swapped back after the standalone round


class Closing(LoggerDestination):
    def __init__(self, name: str, calls: list[str], fail: bool = False) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def close(self, state: State | None = None, logger: Any = None) -> None:
        assert isinstance(state, State) and logger is not None
        self.calls.append(f"close {self.name}")
        if self.fail:
            raise OSError(f"{self.name} could not flush")

    def post_close(self) -> None:
        self.calls.append(f"post_close {self.name}")


class ClosingCallback(Callback):
    def __init__(self, name: str, calls: list[str], fail: bool = False) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def close(self, state: State, logger: Any) -> None:
        self.calls.append(f"close {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} failed to close")

    def post_close(self) -> None:
        self.calls.append(f"post_close {self.name}")


def test_close_calls_every_close_then_every_post_close_once() -> None:
    calls: list[str] = []
    model = Regressor()
    trainer = Trainer(
        model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[ClosingCallback("a", calls), ClosingCallback("b", calls)],
        loggers=[Closing("logger", calls)],
        progress_bar=False,
    )
    trainer.close()
    trainer.close()
    assert calls == ["close a", "close b", "close logger", "post_close a", "post_close b", "post_close logger"]


def test_a_failing_close_does_not_stop_the_others_and_is_raised_at_the_end() -> None:
    calls: list[str] = []
    model = Regressor()
    trainer = Trainer(
        model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[ClosingCallback("a", calls, fail=True), ClosingCallback("b", calls)],
        loggers=[Closing("logger", calls, fail=True)],
        progress_bar=False,
    )
    with pytest.raises(
        RuntimeError,
        match=r"failed 2 times: RuntimeError: a failed to close; OSError: logger could not flush",
    ):
        trainer.close()
    # the callbacks whose close failed get no post_close
    assert calls == ["close a", "close b", "close logger", "post_close b"]


def test_one_failing_close_is_raised_as_it_is() -> None:
    model = Regressor()
    trainer = Trainer(
        model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        loggers=[Closing("logger", [], fail=True)],
        progress_bar=False,
    )
    with pytest.raises(OSError, match="logger could not flush"):
        trainer.close()
