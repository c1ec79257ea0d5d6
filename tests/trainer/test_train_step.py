"""The train step a run assembles from what it uses: where nothing listens between BATCH_START and the optimizer step
(and no option needs them), a batch's gradients come from one forward and backward with no events; the run trains
exactly as the step that fires every event does, and falls back to it when the state asks for more mid-run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from fabric.strategies import SingleDeviceStrategy
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.trainer import Trainer


class Classifier(nn.Module):
    """Counts its forwards: one per batch in a whole-batch step, one per microbatch otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.forwards = 0

    def forward(self, batch: Any) -> torch.Tensor:
        self.forwards += 1
        return self.net(batch[0])  # type: ignore[no-any-return]

    def loss(self, outputs: torch.Tensor, batch: Any) -> Any:
        return F.cross_entropy(outputs, batch[1])


class DictLoss(Classifier):
    """A loss in Composer's dict form: its ``"total"`` is differentiated."""

    def loss(self, outputs: torch.Tensor, batch: Any) -> Any:
        loss = F.cross_entropy(outputs, batch[1])
        return {"total": loss, "half": loss.detach() / 2}


class ListensAfterLoss(Callback):
    """A callback inside the step: the run then fires every event (and records the losses it saw)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def after_loss(self, state: State, logger: Logger) -> None:
        self.losses.append(float(_total(state.loss).detach()))


class MicrobatchesFromTheSecondBatch(Callback):
    """Sets ``device_train_microbatch_size`` after the step was chosen (at the end of batch 1)."""

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) == 1:
            state.device_train_microbatch_size = 4


def _total(loss: Any) -> torch.Tensor:
    return loss["total"] if isinstance(loss, dict) else loss


def _loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))
    return DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))


def _fit(model: nn.Module, **options: Any) -> Trainer:
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        progress_bar=False,
        seed=11,
        accelerator="cpu",
        devices=1,
        **options,
    )
    trainer.fit()
    return trainer


@pytest.mark.parametrize("model_class", [Classifier, DictLoss])
def test_a_step_nothing_observes_trains_as_the_step_that_fires_every_event(model_class: type[Classifier]) -> None:
    torch.manual_seed(0)
    plain_model = model_class()
    observed_model = copy.deepcopy(plain_model)
    listener = ListensAfterLoss()
    plain, observed = _fit(plain_model), _fit(observed_model, callbacks=listener)
    # The two runs took the two paths (the whole-batch one replaces the step's gradients method on the instance).
    assert "_gradients" in vars(plain._train_step) and "_gradients" not in vars(observed._train_step)
    for ours, theirs in zip(plain_model.parameters(), observed_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert len(listener.losses) == 8  # 4 batches x 2 epochs, each batch's loss seen once
    assert float(_total(plain.state.loss)) == pytest.approx(listener.losses[-1])
    assert float(_total(observed.state.loss)) == pytest.approx(listener.losses[-1])
    for field in ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch"):
        assert getattr(plain.state.timestamp, field) == getattr(observed.state.timestamp, field), field
    assert int(plain.state.timestamp.sample) == 128
    assert plain_model.forwards == observed_model.forwards == 8


def test_microbatches_set_after_the_step_was_chosen_are_trained() -> None:
    """An algorithm sets ``device_train_microbatch_size`` mid-run: from the next batch each batch runs as
    microbatches (4 forwards of 4 samples), and the gradients are still the whole batch's."""
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    trainer = _fit(model, callbacks=MicrobatchesFromTheSecondBatch())
    assert "_gradients" in vars(trainer._train_step)  # the whole-batch step was chosen, and gave way
    assert model.forwards == 1 + 7 * 4
    _fit(reference)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class DiscardsSomeSteps(SingleDeviceStrategy):
    """Discards the updates of the optimizer steps numbered in ``discarded`` (counting from 0), as a fault-tolerant
    strategy does with a step its replica groups did not all commit."""

    def __init__(self, discarded: set[int]) -> None:
        super().__init__(device=torch.device("cpu"))
        self.discarded, self.calls = discarded, 0

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        self.step_discarded = self.calls in self.discarded
        self.calls += 1
        return None if self.step_discarded else super().optimizer_step(optimizer, closure)


def test_a_batch_whose_update_the_strategy_discarded_is_trained_again_before_the_clock_moves() -> None:
    """The first and the fifth updates discarded: those batches are trained again, so the run ends with the weights
    and the clock of a run that discarded none, two forwards more."""
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    strategy = DiscardsSomeSteps({0, 4})
    trainer = _fit(model, strategy=strategy)
    _fit(reference)
    assert strategy.calls == 10 and model.forwards == reference.forwards + 2 == 10
    assert int(trainer.state.timestamp.batch) == 8 and int(trainer.state.timestamp.sample) == 128
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
