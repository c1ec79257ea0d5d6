"""Closure optimizers (issue 13, item 7): ``torch.optim.LBFGS`` steps with a closure that re-runs the batch's
forward and backward, events included, as in Composer; it trains like a plain LBFGS loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.trainer import Trainer

Batch = tuple[torch.Tensor, torch.Tensor]
TRUE_WEIGHTS = torch.tensor([[2.0, -1.0, 0.5, 3.0]])


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.forwards = 0

    def forward(self, batch: Batch) -> torch.Tensor:
        self.forwards += 1
        return self.linear(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.mse_loss(outputs.squeeze(-1), batch[1])


def _dataset(samples: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    y = (x @ TRUE_WEIGHTS.T).squeeze(-1) + 1.0 + 0.01 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y)


def _model() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def _full_loss(model: Regressor) -> float:
    x, y = _dataset().tensors
    with torch.no_grad():
        return float(F.mse_loss(model.linear(x).squeeze(-1), y))


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.losses: list[float] = []

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        self.events.append(event)
        if event is Event.BATCH_END:
            self.losses.append(float(state.loss))


def _lbfgs_trainer(model: Regressor, **kwargs: Any) -> Trainer:
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5, history_size=5)
    return Trainer(
        model,
        DataLoader(_dataset(), batch_size=8),
        optimizers=optimizer,
        progress_bar=False,
        seed=0,
        **kwargs,
    )


def test_lbfgs_trains_and_matches_a_plain_closure_loop() -> None:
    model, reference = _model(), _model()
    before = _full_loss(model)
    recorder = Recorder()
    _lbfgs_trainer(model, max_duration="1ep", callbacks=[recorder]).fit()
    assert _full_loss(model) < before / 100
    assert recorder.losses[-1] < recorder.losses[0] / 10

    optimizer = torch.optim.LBFGS(reference.parameters(), lr=1.0, max_iter=5, history_size=5)
    first_losses = []
    for x, y in DataLoader(_dataset(), batch_size=8):

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(reference.linear(x).squeeze(-1), y)
            loss.backward()
            return loss

        first_losses.append(float(optimizer.step(closure).detach()))
    assert torch.equal(model.linear.weight, reference.linear.weight)
    assert torch.equal(model.linear.bias, reference.linear.bias)
    # state.loss is the loss at the weights each batch started with: what LBFGS.step returns
    assert recorder.losses == first_losses


def test_events_between_batch_start_and_batch_end_fire_once_per_closure_call() -> None:
    model = _model()
    recorder = Recorder()
    trainer = _lbfgs_trainer(model, max_duration="2ba", callbacks=[recorder], device_train_microbatch_size=4)
    trainer.fit()
    evaluations = model.forwards // 2  # two microbatches of 4 per evaluation of the batch of 8
    assert model.forwards == 2 * evaluations and evaluations > 2  # LBFGS evaluated each batch several times
    func_evals = trainer.state.optimizers[0].optimizer.state[model.linear.weight]["func_evals"]
    assert evaluations == func_evals
    per_microbatch = [
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    ]
    per_call = [Event.BEFORE_TRAIN_BATCH, *per_microbatch, *per_microbatch, Event.AFTER_TRAIN_BATCH]
    events = recorder.events
    starts = [index for index, event in enumerate(events) if event is Event.BATCH_START]
    ends = [index for index, event in enumerate(events) if event is Event.BATCH_END]
    batches = [events[start + 1 : end] for start, end in zip(starts, ends, strict=True)]
    assert len(batches) == 2
    calls = [len(inner) // len(per_call) for inner in batches]
    assert sum(calls) == evaluations
    for inner, count in zip(batches, calls, strict=True):
        assert inner == per_call * count
    assert recorder.events.count(Event.BATCH_START) == recorder.events.count(Event.BATCH_CHECKPOINT) == 2


class CountingMetric:
    """A train metric that counts the samples it saw."""

    def __init__(self) -> None:
        self.samples = 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.samples += int(targets.shape[0])

    def compute(self) -> torch.Tensor:
        return torch.tensor(float(self.samples))

    def reset(self) -> None:
        self.samples = 0


class WithMetric(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.metric = CountingMetric()

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {"count": self.metric} if is_train else {}


class MetricAtBatchEnd(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def batch_end(self, state: State, logger: Any) -> None:
        self.values.append(state.metrics["metrics/train/count"])


def test_train_metrics_count_each_batch_once() -> None:
    torch.manual_seed(0)
    model = WithMetric()
    seen = MetricAtBatchEnd()
    _lbfgs_trainer(model, max_duration="2ba", callbacks=[seen]).fit()
    assert model.forwards > 2
    assert seen.values == [8.0, 8.0]  # each batch of 8 counted once, however often LBFGS evaluated it


def test_lbfgs_under_a_grad_scaler_fails_when_the_trainer_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"LBFGS steps with a closure .* precision='16-mixed' steps through a GradScaler"
    ):
        _lbfgs_trainer(_model(), precision="16-mixed")


def test_other_optimizers_step_without_a_closure() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    trainer = Trainer(
        model,
        DataLoader(_dataset(), batch_size=8),
        "2ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        progress_bar=False,
    )
    assert not trainer._train_step.closure_step
    trainer.fit()
    assert model.forwards == 2
    assert not torch.equal(model.linear.weight, reference.linear.weight)
