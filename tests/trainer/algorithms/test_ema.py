"""EMA: the average follows the closed form, evaluation swaps it in and out, and a resume continues it exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.algorithms.ema import EMA, compute_ema
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def _set_weights(model: nn.Module, value: float, batches_tracked: int) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
        model[1].running_mean.fill_(value)  # type: ignore[index, union-attr]
        model[1].num_batches_tracked.fill_(batches_tracked)  # type: ignore[index, union-attr]


def _run_batches(ema: EMA, model: nn.Module, values: list[float], first_batch: int = 1) -> State:
    """Batches ``first_batch, ...`` end with the weights filled with ``values``."""
    state = State(model=model, max_duration=Time.from_timestring("100ba"))
    engine = Engine(state, None, [ema])
    for batch, value in enumerate(values, start=first_batch):
        _set_weights(model, value, batch)
        state.timestamp = Timestamp(batch=batch)
        engine.run_event(Event.BATCH_END)
    return state


def _closed_form(values: list[float], smoothing: float) -> float:
    average = values[0]  # the first update copies the weights
    for value in values[1:]:
        average = smoothing * average + (1 - smoothing) * value
    return average


def test_half_life_sets_the_smoothing() -> None:
    assert EMA(half_life="4ba").smoothing == pytest.approx(0.5**0.25)
    assert EMA(half_life="3ep", update_interval="1ep").smoothing == pytest.approx(0.5 ** (1 / 3))
    assert EMA(half_life=None, smoothing=0.9).smoothing == 0.9


def test_ema_weights_follow_the_closed_form() -> None:
    model, ema = _model(), EMA(half_life="2ba")
    values = [1.0, 3.0, -2.0, 5.0, 0.5]
    _run_batches(ema, model, values)
    expected = _closed_form(values, 0.5**0.5)
    assert ema.averages is not None
    weight, bias, bn_weight, bn_bias, running_mean, running_var, batches_tracked = ema.averages
    for averaged in (weight, bias, bn_weight, bn_bias, running_mean):
        torch.testing.assert_close(averaged, torch.full_like(averaged, expected))
    assert torch.all(running_var == 1.0)  # never changed, so its average stays
    assert int(batches_tracked) == 5  # integer buffers are copied, not averaged


def test_update_interval_and_ema_start_choose_the_updates() -> None:
    model, ema = _model(), EMA(half_life=None, smoothing=0.5, ema_start="4ba", update_interval="2ba")
    values = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]  # batches 1..8: updates at 4, 6, 8
    _run_batches(ema, model, values)
    assert ema.averages is not None
    torch.testing.assert_close(ema.averages[0], torch.full((2, 3), _closed_form([40.0, 60.0, 80.0], 0.5)))


def test_evaluation_uses_the_average_and_training_continues_on_the_raw_weights() -> None:
    model, ema = _model(), EMA(half_life=None, smoothing=0.5)
    state = _run_batches(ema, model, [2.0, 4.0])  # average 3.0, raw 4.0
    engine = Engine(state, None, [ema])
    engine.run_event(Event.EVAL_BEFORE_ALL)
    assert torch.all(model[0].weight == 3.0)  # type: ignore[index]
    engine.run_event(Event.EVAL_AFTER_ALL)
    assert torch.all(model[0].weight == 4.0)  # type: ignore[index]
    assert ema.averages is not None and torch.all(ema.averages[0] == 3.0)


def test_a_resumed_ema_continues_exactly() -> None:
    values = [1.0, 3.0, -2.0, 5.0, 0.5, 7.0]
    uninterrupted = EMA(half_life="3ba")
    _run_batches(uninterrupted, _model(), values)

    first = EMA(half_life="3ba")
    _run_batches(first, _model(), values[:3])
    checkpoint = first.state_dict()
    resumed = EMA(half_life="3ba")
    resumed.load_state_dict(checkpoint)
    _run_batches(resumed, _model(), values[3:], first_batch=4)
    assert uninterrupted.averages is not None and resumed.averages is not None
    for expected, actual in zip(uninterrupted.averages, resumed.averages, strict=True):
        assert torch.equal(expected, actual)


def test_compute_ema_on_modules() -> None:
    model, ema_model = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        ema_model.weight.fill_(5.0)
    compute_ema(model, ema_model, smoothing=0.75)
    assert torch.all(ema_model.weight == 0.75 * 5.0 + 0.25 * 1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 0.9}, "exactly one of half_life or smoothing"),
        ({"half_life": None}, "exactly one of half_life or smoothing"),
        ({"half_life": "10ep"}, "must be positive and in the unit of update_interval"),
        ({"half_life": None, "smoothing": 1.0}, r"smoothing=1.0 must be in \[0, 1\)"),
        ({"update_interval": "10sp"}, "update_interval='10sp' must be a positive count in 'ba' or 'ep'"),
        ({"ema_start": "soon"}, "Time string 'soon' is not valid"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EMA(**kwargs)  # type: ignore[arg-type]


def test_the_trainer_evaluates_with_the_average_and_keeps_training_the_raw_weights() -> None:
    from fabric.trainer.core.callback import Callback
    from fabric.trainer.trainer import Trainer

    class Regression(nn.Linear):
        def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
            return super().forward(batch[0])

        def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
            return F.mse_loss(outputs, batch[1])

    class SeeWeights(Callback):
        def __init__(self) -> None:
            self.at_eval: list[torch.Tensor] = []

        def eval_start(self, state: State, logger: Any) -> None:
            self.at_eval.append(state.model.weight.detach().clone())

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    model, ema, seen = Regression(3, 1), EMA(half_life="2ba"), SeeWeights()
    trainer = Trainer(
        model=model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8),
        eval_dataloader=torch.utils.data.DataLoader(data, batch_size=8),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[ema],
        callbacks=[seen],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.close()
    assert ema.averages is not None and len(seen.at_eval) == 2
    assert torch.equal(seen.at_eval[-1], ema.averages[0])  # evaluated with the average
    assert not torch.equal(model.weight.detach(), ema.averages[0])  # the model holds the raw weights again
