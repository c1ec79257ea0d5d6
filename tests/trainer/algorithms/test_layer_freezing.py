"""LayerFreezing: the earliest layers stop changing and leave the optimizer; the rest keep training."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms.layer_freezing import LayerFreezing, freeze_fraction, parameter_layers
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_freeze_fraction_follows_the_schedule() -> None:
    assert freeze_fraction(0.4, freeze_start=0.5, freeze_level=1.0) == 0.0
    assert freeze_fraction(0.75, freeze_start=0.5, freeze_level=1.0) == 0.5
    assert freeze_fraction(1.0, freeze_start=0.5, freeze_level=0.8) == pytest.approx(0.8)
    assert freeze_fraction(0.6, freeze_start=0.0, freeze_level=0.5) == pytest.approx(0.3)


def test_frozen_layers_are_bit_identical_and_their_optimizer_state_is_gone() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    _step(model, optimizer)  # the optimizer holds state for every parameter
    state = State(model=model, max_duration=Time.from_timestring("4ep"), optimizers=[optimizer])
    state.timestamp = Timestamp(epoch=3, batch=30)  # 75% through: half of the 4 layers freeze
    algorithm = LayerFreezing(freeze_start=0.5, freeze_level=1.0)
    Engine(state, None, [algorithm]).run_event(Event.EPOCH_END)

    layers = parameter_layers(model)
    assert algorithm.frozen_layers == 2 and layers[:2] == [model[0], model[2]]
    frozen = [p for layer in layers[:2] for p in layer.parameters()]
    trained = [p for layer in layers[2:] for p in layer.parameters()]
    assert not any(p in optimizer.state for p in frozen) and all(p in optimizer.state for p in trained)
    assert all(not p.requires_grad and p.grad is None for p in frozen)

    frozen_before = [p.detach().clone() for p in frozen]
    trained_before = [p.detach().clone() for p in trained]
    for _ in range(3):
        _step(model, optimizer)
    assert all(torch.equal(p, before) for p, before in zip(frozen, frozen_before, strict=True))
    assert all(not torch.equal(p, before) for p, before in zip(trained, trained_before, strict=True))


def test_batch_interval_freezes_at_batch_end_and_nothing_before_freeze_start() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = State(model=model, max_duration=Time.from_timestring("10ba"), optimizers=[optimizer])
    engine = Engine(state, None, [LayerFreezing(freeze_start=0.5, interval="batch")])
    state.timestamp = Timestamp(batch=5)
    engine.run_event(Event.EPOCH_END)  # not its event
    engine.run_event(Event.BATCH_END)  # at freeze_start: nothing frozen yet
    assert all(p.requires_grad for p in model.parameters())
    state.timestamp = Timestamp(batch=10)
    engine.run_event(Event.BATCH_END)
    assert not any(p.requires_grad for p in model.parameters())
    assert not optimizer.state


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"freeze_start": 1.0}, r"freeze_start=1.0 must be in \[0, 1\)"),
        ({"freeze_level": 1.5}, r"freeze_level=1.5 must be in \[0, 1\]"),
        ({"interval": "step"}, "interval='step'; use one of epoch, batch"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerFreezing(**kwargs)  # type: ignore[arg-type]


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs, batch[1])


def test_the_trainer_freezes_through_its_wrapped_optimizer() -> None:
    from fabric.trainer.trainer import Trainer

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    model = Regression()
    first_before = model.net[0].weight.detach().clone()
    trainer = Trainer(
        model=model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8),
        max_duration="4ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[LayerFreezing(freeze_start=0.0, freeze_level=0.5)],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.close()
    # Frozen share 0.5 * epochs / 4 of the 4 layers: none after epoch 1, one after epochs 2 and 3, two after 4.
    layers = [model.net[0], model.net[2], model.net[3], model.net[4]]
    assert [layer.weight.requires_grad for layer in layers] == [False, False, True, True]
    assert not torch.equal(model.net[0].weight, first_before)  # it trained during the first epoch


def test_a_run_with_frozen_layers_resumes_bit_identically(tmp_path: Path) -> None:
    from fabric.trainer.trainer import Trainer

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    torch.manual_seed(0)
    initial = Regression()

    def trainer(duration: str, **kwargs: Any) -> Trainer:
        model = copy.deepcopy(initial)
        return Trainer(
            model=model,
            train_dataloader=torch.utils.data.DataLoader(data, batch_size=8),
            max_duration=duration,
            optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
            algorithms=[LayerFreezing(freeze_start=0.0, freeze_level=0.75, interval="batch")],
            progress_bar=False,
            seed=0,
            accelerator="cpu",
            **kwargs,
        )

    straight = trainer("12ba")
    straight.fit()

    class StopAtFive(Callback):
        def batch_end(self, state: State, logger: Any) -> None:
            if int(state.timestamp.batch) == 5:
                state.stop_training()  # max_duration (and so the freezing schedule) stays 12ba until here

    first = trainer("12ba", save_folder=str(tmp_path), save_interval="5ba", callbacks=[StopAtFive()])
    first.fit()
    resumed = trainer("12ba", load_path=str(tmp_path / "ep1-ba5-rank0.pt"))
    assert resumed.state.algorithms[0].frozen_layers == first.state.algorithms[0].frozen_layers > 0
    resumed.fit()
    for ours, reference in zip(resumed.state.model.parameters(), straight.state.model.parameters(), strict=True):
        assert torch.equal(ours, reference)
