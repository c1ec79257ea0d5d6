"""What Composer users expect of the Trainer's clock (issue 13): ``dur`` and epochs counted in batches through the
dataloader's length, every evaluator running, the LR of batch k visible at all of batch k's events, epoch warmups,
and comparisons of times with numbers and strings."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit
from fabric.trainer.evaluation import Evaluator
from fabric.trainer.schedulers import (
    CosineAnnealingScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
)
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


def _loader(batches: int, batch_size: int = 2) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    samples = batches * batch_size
    return DataLoader(TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples)), batch_size)


class _Stream(IterableDataset[Batch]):
    """Batches of unknown number: no ``__len__``."""

    def __iter__(self) -> Iterator[Batch]:
        for _ in range(4):
            yield torch.randn(2, 4), torch.randn(2)


class LRAt(Callback):
    """The first param group's LR at chosen events, per batch."""

    def __init__(self, *events: Event) -> None:
        self.events = events
        self.lrs: dict[Event, list[float]] = {event: [] for event in events}

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        if event in self.lrs:
            self.lrs[event].append(float(state.optimizers[0].param_groups[0]["lr"]))


class BatchesAt(Callback):
    """``timestamp.batch`` (and the evaluator's label) at every EVAL_START."""

    def __init__(self) -> None:
        self.evaluations: list[tuple[int, str | None]] = []

    def eval_start(self, state: State, logger: Any) -> None:
        self.evaluations.append((int(state.timestamp.batch), state.dataloader_label))


def _fit(batches_per_epoch: int, max_duration: Any, **options: Any) -> Trainer:
    model = Regressor()
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(batches_per_epoch),
        max_duration=max_duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        progress_bar=False,
        seed=0,
        accelerator="cpu",
        **options,
    )
    trainer.fit()
    return trainer


# --- item 1: dur and epochs count batches -------------------------------------------------------


def test_seed_dur_milestones_under_an_epoch_max_duration_decay_at_batches_3_5_9() -> None:
    lrs = LRAt(Event.BATCH_START)
    _fit(10, 1, schedulers=MultiStepScheduler(milestones=["0.3dur", "0.5dur", "0.9dur"]), callbacks=lrs)
    expected = [1.0] * 3 + [0.1] * 2 + [0.01] * 4 + [0.001]
    assert lrs.lrs[Event.BATCH_START] == pytest.approx(expected)


def test_default_cosine_over_three_epochs_gives_one_lr_per_batch() -> None:
    lrs = LRAt(Event.BATCH_START)
    _fit(10, "3ep", schedulers=CosineAnnealingScheduler(), callbacks=lrs)
    expected = [(1 + math.cos(math.pi * k / 30)) / 2 for k in range(30)]
    assert lrs.lrs[Event.BATCH_START] == pytest.approx(expected)
    assert len(set(lrs.lrs[Event.BATCH_START])) == 30


def test_dur_eval_and_save_intervals_of_two_epochs_fire_every_quarter(tmp_path: Path) -> None:
    seen = BatchesAt()
    trainer = _fit(
        8,
        "2ep",
        eval_dataloader=_loader(2),
        eval_interval="0.25dur",
        save_folder=str(tmp_path),
        save_interval="0.25dur",
        save_latest_filename=None,
        callbacks=seen,
    )
    assert [batch for batch, _ in seen.evaluations] == [4, 8, 12, 16]
    assert trainer.saver is not None
    assert [re.search(r"-ba(\d+)-", Path(path).name)[1] for path in trainer.saver.saved] == ["4", "8", "12", "16"]  # type: ignore[index]


def test_elapsed_duration_of_an_epoch_run_moves_every_batch() -> None:
    class Elapsed(Callback):
        def __init__(self) -> None:
            self.values: list[Time[float]] = []

        def batch_end(self, state: State, logger: Any) -> None:
            self.values.append(state.get_elapsed_duration())

    elapsed = Elapsed()
    _fit(4, "2ep", callbacks=elapsed)
    assert all(value.unit is TimeUnit.DURATION for value in elapsed.values)
    assert [float(value) for value in elapsed.values] == pytest.approx([k / 8 for k in range(1, 9)])
    assert elapsed.values[3] == 0.5 and elapsed.values[3] >= "0.5dur" and elapsed.values[2] < 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eval_dataloader": _loader(1), "eval_interval": "0.25dur"}, r"eval_interval='0.25dur' is a fraction"),
        ({"save_interval": "0.5dur"}, r"save_interval='0.5dur' is a fraction"),
        ({"schedulers": CosineAnnealingScheduler()}, r"schedulers: CosineAnnealingScheduler: t_max='1.0dur' counts"),
        ({"schedulers": LinearWithWarmupScheduler("1ep", t_max="10ba")}, r"t_warmup='1ep' counts epochs"),
    ],
)
def test_without_a_dataloader_length_fit_names_the_option_that_needs_it(
    options: dict[str, Any], message: str, tmp_path: Path
) -> None:
    if "save_interval" in options:
        options["save_folder"] = str(tmp_path)
    model = Regressor()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(_Stream(), batch_size=None),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        progress_bar=False,
        accelerator="cpu",
        **options,
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit()
    assert int(trainer.state.timestamp.batch) == 0  # refused before training


def test_without_a_dataloader_length_batch_based_times_still_train() -> None:
    model = Regressor()
    lrs = LRAt(Event.BATCH_START)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(_Stream(), batch_size=None),
        max_duration="8ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        schedulers=MultiStepScheduler(["0.5dur"]),
        callbacks=lrs,
        progress_bar=False,
        accelerator="cpu",
    )
    trainer.fit()
    assert lrs.lrs[Event.BATCH_START] == pytest.approx([1.0] * 4 + [0.1] * 4)


# --- item 2: epoch warmups, scale_warmup ----------------------------------------------------------


def test_epoch_warmup_ramps_over_the_first_epochs_batches_and_is_not_scaled_by_default() -> None:
    lrs = LRAt(Event.BATCH_START)
    # scale_schedule_ratio 0.5 makes max_duration 2ep (20 batches); the 1ep warmup keeps its 10 batches.
    _fit(
        10,
        "4ep",
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="1ep"),
        scale_schedule_ratio=0.5,
        callbacks=lrs,
    )
    expected = [k / 10 for k in range(10)] + [(1 + math.cos(math.pi * (k - 10) / 10)) / 2 for k in range(10, 20)]
    assert lrs.lrs[Event.BATCH_START] == pytest.approx(expected)


def test_scale_warmup_true_scales_the_warmup_with_the_schedule() -> None:
    lrs = LRAt(Event.BATCH_START)
    scheduler = LinearWithWarmupScheduler(t_warmup="8ba", alpha_f=1.0, scale_warmup=True)  # warmup 4 batches
    _fit(4, "4ep", schedulers=scheduler, scale_schedule_ratio=0.5, callbacks=lrs)
    assert lrs.lrs[Event.BATCH_START] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])


# --- item 3: the LR of batch k is set before its first event --------------------------------------


def test_every_event_of_batch_k_sees_the_lr_batch_k_trains_with() -> None:
    events = (Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START, Event.BEFORE_FORWARD, Event.BATCH_END)
    lrs = LRAt(*events)
    model = Regressor()
    weights: list[torch.Tensor] = []

    class Weights(Callback):
        def batch_start(self, state: State, logger: Any) -> None:
            weights.append(model.linear.weight.detach().clone())

    trainer = Trainer(
        model=model,
        train_dataloader=_loader(6),
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        schedulers=LinearWithWarmupScheduler("4ba", alpha_f=1.0),
        callbacks=[lrs, Weights()],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    expected = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    for event in events:
        assert lrs.lrs[event] == pytest.approx(expected), event
    torch.testing.assert_close(weights[0], weights[1])  # batch 0 trained with the LR 0 its events showed
    assert not torch.equal(weights[1], weights[2])


# --- item 4: every evaluator runs -----------------------------------------------------------------


def test_two_evaluators_without_their_own_interval_both_run() -> None:
    seen = BatchesAt()
    evaluators = [Evaluator("first", _loader(1)), Evaluator("second", _loader(1))]
    _fit(4, "2ep", eval_dataloader=evaluators, callbacks=seen)
    assert seen.evaluations == [(4, "first"), (4, "second"), (8, "first"), (8, "second")]


def test_evaluators_with_batch_intervals_each_keep_their_own() -> None:
    seen = BatchesAt()
    evaluators = [Evaluator("often", _loader(1), eval_interval="2ba"), Evaluator("default", _loader(1))]
    _fit(4, "1ep", eval_dataloader=evaluators, eval_interval="2ba", callbacks=seen)
    assert seen.evaluations == [(2, "often"), (2, "default"), (4, "often"), (4, "default")]


@pytest.mark.parametrize("interval", [0, -1, "0ep", Time(0, TimeUnit.BATCH)])
def test_an_eval_interval_of_zero_or_less_never_evaluates_during_fit_as_in_composer(interval: Any) -> None:
    """Composer's tutorials pass ``eval_interval=0`` and call ``trainer.eval()`` themselves."""
    seen = BatchesAt()
    trainer = _fit(4, "2ep", eval_dataloader=_loader(1), eval_interval=interval, callbacks=seen)
    assert seen.evaluations == []
    trainer.eval()
    assert seen.evaluations == [(8, "eval")]


def test_an_evaluators_own_eval_interval_of_zero_turns_it_off_and_a_zero_fraction_is_refused() -> None:
    seen = BatchesAt()
    evaluators = [Evaluator("never", _loader(1), eval_interval=0), Evaluator("default", _loader(1))]
    _fit(2, "2ep", eval_dataloader=evaluators, callbacks=seen)
    assert seen.evaluations == [(2, "default"), (4, "default")]
    with pytest.raises(ValueError, match=r"eval_interval='0dur' must be positive"):
        _fit(2, "1ep", eval_dataloader=_loader(1), eval_interval="0dur")


def test_metrics_read_back_after_fit_hold_the_last_evaluation_and_the_last_batch() -> None:
    """Composer keeps the last round's metric state until the next round; notebooks display exactly this."""
    from fabric.trainer.classifier import ComposerClassifier

    torch.manual_seed(0)
    inputs, targets = torch.randn(16, 4), torch.randint(0, 2, (16,))
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)
    model = ComposerClassifier(nn.Linear(4, 2), num_classes=2)
    trainer = Trainer(
        model=model, train_dataloader=loader, eval_dataloader=loader, max_duration="1ep", progress_bar=False
    )
    trainer.fit()
    with torch.no_grad():
        logits = model.module(inputs)
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    eval_metrics = trainer.state.eval_metrics["eval"]
    assert float(eval_metrics["MulticlassAccuracy"].compute()) == pytest.approx(accuracy)
    assert float(eval_metrics["CrossEntropy"].compute()) == pytest.approx(F.cross_entropy(logits, targets).item())
    assert trainer.state.metrics["metrics/eval/MulticlassAccuracy"] == pytest.approx(accuracy)
    train_accuracy = float(trainer.state.train_metrics["MulticlassAccuracy"].compute())
    assert not math.isnan(train_accuracy)
    assert train_accuracy == trainer.state.metrics["metrics/train/MulticlassAccuracy"]  # the last batch's, alone
    trainer.eval()  # the next round starts from an empty state, not the last one
    assert float(eval_metrics["MulticlassAccuracy"].compute()) == pytest.approx(accuracy)


# --- item 5: comparisons --------------------------------------------------------------------------


def test_events_equal_their_names_and_the_clock_compares_with_ints() -> None:
    class Comparisons(Callback):
        def __init__(self) -> None:
            self.early: list[bool] = []

        def run_event(self, event: Event, state: State, logger: Any) -> None:
            if event == "batch_end":
                self.early.append(state.timestamp.batch < 3)

    comparisons = Comparisons()
    _fit(4, "1ep", callbacks=comparisons)
    assert comparisons.early == [True, True, False, False]
    assert Event.BATCH_END == "batch_end" and Event("batch_end") is Event.BATCH_END  # type: ignore[comparison-overlap]
    assert Event.BATCH_END != "batch_start"  # type: ignore[comparison-overlap]


class _LinearModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


# The LR at each epoch's end: one LinearLR step per epoch (the default) or one per batch (3 per epoch).
@pytest.mark.parametrize(("every_batch", "expected"), [(None, [0.075, 0.1, 0.1]), (True, [0.1, 0.1, 0.1])])
def test_pytorch_schedulers_step_every_epoch_by_default_as_in_composer(
    every_batch: bool | None, expected: list[float]
) -> None:
    """`LinearLR(total_iters=2)` warmed up over 2 batches here and over 2 epochs in Composer: a Composer user's
    schedule ran up to the number of batches per epoch times too fast, silently."""
    model = _LinearModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[float] = []

    class EpochEndLR(Callback):
        def epoch_end(self, state: State, logger: Any) -> None:
            seen.append(optimizer.param_groups[0]["lr"])

    data = TensorDataset(torch.randn(6, 2), torch.randn(6, 1))
    trainer = Trainer(
        model=model, train_dataloader=DataLoader(data, batch_size=2), max_duration="3ep", optimizers=optimizer,
        schedulers=torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2),
        step_schedulers_every_batch=every_batch, callbacks=[EpochEndLR()], progress_bar=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit()
    assert trainer.step_schedulers_every_batch is (every_batch is True)
    assert seen == pytest.approx(expected)


def test_composers_state_properties_answer_and_its_other_attributes_refuse_by_name() -> None:
    """``is_model_ddp`` (for Composer's unwrapping idiom), ``fsdp_enabled`` and ``device`` (one process);
    an attribute only Composer's State has says so in one line, any other is Python's plain AttributeError."""
    from fabric.trainer.devices import DeviceCPU

    model = Regressor()
    trainer = Trainer(model=model, max_duration="1ba", progress_bar=False, accelerator="cpu", devices=1)
    state = trainer.state
    assert state.is_model_ddp is True and state.model.module is model  # set up: Fabric's wrapper around the model
    assert state.fsdp_enabled is False
    assert isinstance(state.device, DeviceCPU) and state.device.name == "cpu"
    with pytest.raises(AttributeError, match=r"^state\.fsdp_state_dict_type is an attribute of Composer's State that"):
        _ = state.fsdp_state_dict_type
    with pytest.raises(AttributeError, match=r"^'State' object has no attribute 'no_such_thing'$"):
        _ = state.no_such_thing
