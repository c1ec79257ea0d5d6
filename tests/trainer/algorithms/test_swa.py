"""SWA: the final weights are the average of the snapshots, BatchNorm statistics are recomputed, swa_lr anneals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric.trainer.algorithms.swa import SWA
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp


class Normalised(nn.Module):
    """BatchNorm first, so its running mean after ``update_bn`` is the data's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.layer = nn.BatchNorm1d(3), nn.Linear(3, 1)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.layer(self.norm(batch[0]))


def test_swa_weights_are_the_average_of_the_snapshots_and_bn_is_recomputed() -> None:
    torch.manual_seed(0)
    model = Normalised()
    data = [(torch.randn(8, 3) + 2.0,) for _ in range(4)]
    state = State(model=model, max_duration=Time.from_timestring("6ba"))
    state.dataloader = data
    swa = SWA(swa_start="2ba", swa_end="5ba", update_interval="1ba")
    engine = Engine(state, None, [swa])
    snapshots = []
    for batch in range(1, 7):
        with torch.no_grad():
            model.layer.weight.copy_(torch.randn(1, 3))
        if 2 <= batch < 5:
            snapshots.append(model.layer.weight.detach().clone())
        state.timestamp = Timestamp(batch=batch)
        engine.run_event(Event.BATCH_END)
        if batch == 5:
            torch.testing.assert_close(model.layer.weight, torch.stack(snapshots).mean(dim=0))
    assert swa.completed and len(snapshots) == 3
    # update_bn ran over the dataloader with momentum=None: the running mean is the mean of the data.
    torch.testing.assert_close(model.norm.running_mean, torch.cat([x for (x,) in data]).mean(dim=0))


def test_swa_lr_anneals_to_swa_lr_over_anneal_steps_despite_the_trainer_schedule() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = State(model=model, max_duration=Time.from_timestring("20ba"), optimizers=[optimizer])
    engine = Engine(state, None, [SWA(swa_start="5ba", swa_end="20ba", swa_lr=0.1, anneal_steps=4)])
    lrs = []
    for batch in range(12):
        state.timestamp = Timestamp(batch=batch)
        optimizer.param_groups[0]["lr"] = 1.0  # what the trainer's schedule sets at every BATCH_START
        engine.run_event(Event.BEFORE_TRAIN_BATCH)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
    assert lrs[:5] == [1.0] * 5  # before swa_start the schedule rules
    assert lrs[5:10] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1])  # linear over 4 steps from the LR at start
    assert lrs[10:] == pytest.approx([0.1, 0.1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"swa_start": "0.9dur", "swa_end": "0.5dur"}, "must come before swa_end"),
        ({"swa_start": "2ep", "swa_end": "0.9dur"}, "in the same unit"),
        ({"update_interval": "0.1dur"}, "positive count in 'ba' or 'ep'"),
        ({"swa_lr": -1.0}, "swa_lr=-1.0 must be a positive number"),
        ({"anneal_strategy": "step"}, "anneal_strategy='step'; use one of linear, cos"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SWA(**kwargs)  # type: ignore[arg-type]
